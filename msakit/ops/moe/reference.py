"""The meaning of `routed_experts`: a token's routed SwiGLU-OAI experts, weighted and summed.

    y[n] = sum_j w[n, j] * expert_{idx[n, j]}(x[n])
    expert_e(x) = swiglu_oai(x @ w1[e].T, x @ w3[e].T) @ w2[e].T

Layouts: x [N, H]; idx int [N, k] (expert ids); w float32 [N, k]; w1 (gate) / w3 (up) [E, I, H];
w2 (down) [E, H, I].  Each projection runs in x's dtype (float32 accumulation, the result
rounded to x's dtype, as a matmul in that dtype returns it); the weighted sum over the k slots
is float32 in slot order.  Returns float32 [N, H].
"""

from __future__ import annotations

import torch

__all__ = ["swiglu_oai", "routed_experts_reference"]


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """SwiGLU-OAI: clamp(gate, max=limit) * sigmoid(alpha * gate) * (clamp(up, +-limit) + 1)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(alpha * gate) * (up + 1.0)


def routed_experts_reference(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, w1: torch.Tensor,
                             w3: torch.Tensor, w2: torch.Tensor, alpha: float = 1.702,
                             limit: float = 7.0) -> torch.Tensor:
    """Every (token, slot) pair multiplied by its own expert's gathered weights (one bmm per
    projection): memory grows with N * k * (3 * I * H), meant for few pairs (decoding)."""
    N, k = idx.shape
    e = idx.reshape(-1).long()
    xp = x.repeat_interleave(k, dim=0).unsqueeze(1)  # [P, 1, H], pair p = n * k + j
    dt = x.dtype
    g = torch.bmm(xp, w1.index_select(0, e).to(dt).transpose(1, 2))
    u = torch.bmm(xp, w3.index_select(0, e).to(dt).transpose(1, 2))
    h = swiglu_oai(g, u, alpha, limit)
    y = torch.bmm(h, w2.index_select(0, e).to(dt).transpose(1, 2)).view(N, k, -1)
    return (y.float() * w.float().unsqueeze(-1)).sum(dim=1)
