"""Gemma-style RMSNorm: x / rms(x) * (1 + w), computed in float32 (w starts at 0)."""

from __future__ import annotations

import torch
from torch import nn


class GemmaRMSNorm(nn.Module):
    """RMSNorm over the last dim with the Gemma parameterisation (1 + weight)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
