"""Helpers shared by the pure-PyTorch references: query chunking and the gather of the tokens
a row of `block_idx` selects.  Only the references use this file; the Triton kernels never do.
"""

from __future__ import annotations

import math

import torch

# Target bytes for one chunk's largest intermediate; keeps T = 32K references within a few GiB.
CHUNK_BYTES = 1 << 28


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 stays float64 (for gradcheck); everything else computes in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def default_scale(scale: float | None, dim: int) -> float:
    """A softmax scale as given, else 1 / sqrt(dim)."""
    return scale if scale is not None else 1.0 / math.sqrt(dim)


def chunk_rows(total: int, bytes_per_row: int) -> int:
    return max(1, min(total, CHUNK_BYTES // max(1, bytes_per_row)))


def selected_tokens(
    block_idx_chunk: torch.Tensor, i0: int, T: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token positions selected by rows i0 .. i0 + C - 1 of block_idx.

    block_idx_chunk: int [B, G, C, K].  Returns (pos, valid), both [B, G, C, K * block_size]:
    `pos` the token index (clamped into [0, T) where invalid, so it can be gathered), and
    `valid` True exactly for the tokens j <= i inside the selected blocks.  Block ids are a
    set: a repeated id counts once; -1 entries select nothing.
    """
    idx = block_idx_chunk.long().sort(dim=-1).values
    dup = torch.zeros_like(idx, dtype=torch.bool)
    dup[..., 1:] = idx[..., 1:] == idx[..., :-1]
    ok_block = (idx >= 0) & ~dup
    B, G, C, K = idx.shape
    offs = torch.arange(block_size, device=idx.device)
    pos = idx.unsqueeze(-1) * block_size + offs  # [B, G, C, K, bs]
    rows = torch.arange(i0, i0 + C, device=idx.device).view(1, 1, C, 1, 1)
    valid = ok_block.unsqueeze(-1) & (pos <= rows) & (pos >= 0)
    pos = pos.clamp(0, T - 1)
    return pos.reshape(B, G, C, K * block_size), valid.reshape(B, G, C, K * block_size)


def gather_tokens(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """x [B, T, G, D] (or [B, T, D], shared by groups), pos [B, G, C, L] -> [B, G, C, L, D]."""
    B, G, C, L = pos.shape
    if x.dim() == 3:
        x = x.unsqueeze(2).expand(x.shape[0], x.shape[1], G, x.shape[2])
    xg = x.transpose(1, 2)  # [B, G, T, D]
    D = xg.shape[-1]
    flat = pos.reshape(B, G, C * L, 1).expand(B, G, C * L, D)
    return torch.gather(xg, 2, flat).view(B, G, C, L, D)


def masked_softmax_parts(scores: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Numerically safe pieces of a masked softmax over the last dim.

    Returns (p_unnormalised, denom, m) with p = exp(s - m) on valid entries and 0 elsewhere,
    denom = sum(p) (0 for a row with no valid entry) and m the detached row max (0 for empty
    rows).  No NaN appears in the forward or the backward, also for empty rows.
    """
    s = scores.masked_fill(~valid, float("-inf"))
    m = s.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    return p, p.sum(dim=-1, keepdim=True), m
