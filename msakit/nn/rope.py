"""NeoX-style partial rotary embedding: the first `rotary_dim` dims of each head are rotated
(halves paired: x[:r/2] with x[r/2:r]), the rest pass through unchanged."""

from __future__ import annotations

import torch


def rope_cos_sin(
    positions: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [..., T] int -> cos, sin [..., T, rotary_dim // 2] (computed in float32)."""
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
    inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, device=positions.device, dtype=torch.float32) / rotary_dim))
    ang = positions.to(torch.float32).unsqueeze(-1) * inv
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D]; cos/sin [B or 1, T, r/2] -> x with its first r dims rotated (NeoX halves)."""
    half = cos.shape[-1]
    r = 2 * half
    x1, x2, rest = x[..., :half], x[..., half:r], x[..., r:]
    c = cos.unsqueeze(2).to(torch.float32)
    s = sin.unsqueeze(2).to(torch.float32)
    x1f, x2f = x1.float(), x2.float()
    o1 = x1f * c - x2f * s
    o2 = x2f * c + x1f * s
    return torch.cat([o1.to(x.dtype), o2.to(x.dtype), rest], dim=-1)
