"""Dense SwiGLU-OAI MLP (M3's dense layers and shared experts).

M3's `hidden_act` is "swigluoai" for every feed-forward block (dense MLPs, the shared expert and
the routed experts; transformers' MiniMaxM3VL computes it inline from `swiglu_alpha` and
`swiglu_limit`).  Gate and up are separate projections (not interleaved):

    gate = clamp(gate, max=limit);  up = clamp(up, -limit, limit)
    out  = gate * sigmoid(alpha * gate) * (up + 1)
"""

from __future__ import annotations

import torch
from torch import nn

from msakit.ops.moe import swiglu_oai

__all__ = ["swiglu_oai", "SwiGLUMLP"]


class SwiGLUMLP(nn.Module):
    """`down_proj(swiglu_oai(gate_proj(x), up_proj(x)))`; HF names gate_proj / up_proj / down_proj."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, alpha: float = 1.702, limit: float = 7.0) -> None:
        super().__init__()
        if hidden_size < 1 or intermediate_size < 1:
            raise ValueError(f"hidden_size and intermediate_size must be positive, got {hidden_size}, {intermediate_size}")
        self.alpha = float(alpha)
        self.limit = float(limit)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H] -> [..., H]; gate and up read one 2-D view (inductor can merge them into one GEMM)."""
        x2 = x.reshape(-1, x.shape[-1])
        y = self.down_proj(swiglu_oai(self.gate_proj(x2), self.up_proj(x2), self.alpha, self.limit))
        return y.view(*x.shape[:-1], y.shape[-1])

    def reset_parameters(self, std: float = 0.02, out_std: float | None = None) -> None:
        nn.init.normal_(self.gate_proj.weight, std=std)
        nn.init.normal_(self.up_proj.weight, std=std)
        nn.init.normal_(self.down_proj.weight, std=std if out_std is None else out_std)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, limit={self.limit}"
