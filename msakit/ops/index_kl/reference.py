"""Reference meaning of `index_kl_loss` (pure PyTorch).

Over the tokens T_sel(r, i) selected by block_idx[b, r, i] (j <= i; see sparse_attention):

    P(i, j)     = mean_{h in group r} softmax_j(softmax_scale * q_h(i) . k_r(j))     (no gradient)
    P_idx(i, j) = softmax_j(index_softmax_scale * q_idx(r, i) . k_idx(j))
    loss        = mean_{b, r, i} KL(P(i, .) || P_idx(i, .))

Gradients reach q_idx and k_idx only.  A row with no selected token contributes 0 (and still
counts in the mean).  over="all" takes both distributions over every token j <= i instead (the
selection of every block at or before the query's own block; block_idx is ignored).

Also here: `selected_lse_reference` (the per-head LSE over the selected tokens that the kernel takes as `lse`).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from .._gather import chunk_rows, compute_dtype, default_scale, gather_tokens, masked_softmax_parts, selected_tokens


def _chunk(q, k, q_idx, k_idx, bidx, row0: int, block_size: int, scale: float, iscale: float):
    B, C, Hq, D = q.shape
    T, G = k.shape[1], k.shape[2]
    cdt = compute_dtype(q_idx)
    pos, valid = selected_tokens(bidx, row0, T, block_size)  # [B, G, C, L]
    with torch.no_grad():
        kc = gather_tokens(k, pos).to(cdt)
        qc = q.to(cdt).view(B, C, G, Hq // G, D).permute(0, 2, 1, 3, 4)
        s = torch.einsum("bgchd,bgcld->bgchl", qc, kc) * scale
        p, denom, _ = masked_softmax_parts(s, valid.unsqueeze(3))
        # denom >= 1 on any row with a token (p = exp(s - max)); clamping at 1 keeps empty rows NaN-free
        P = (p / denom.clamp_min(1.0)).mean(dim=3)  # [B, G, C, L]
    kic = gather_tokens(k_idx, pos).to(cdt)  # [B, G, C, L, Di]
    qic = q_idx.to(cdt).permute(0, 2, 1, 3)  # [B, G, C, Di]
    z = torch.einsum("bgcd,bgcld->bgcl", qic, kic) * iscale
    z = z.masked_fill(~valid, -1e30)  # finite: an empty row stays NaN-free
    logq = torch.log_softmax(z, dim=-1)
    kl = torch.xlogy(P, P) - P * torch.where(valid, logq, torch.zeros_like(logq))
    return kl.sum()


def all_blocks(B: int, G: int, T: int, block_size: int, device: torch.device) -> torch.Tensor:
    """int32 [B, G, T, nblk]: every block id on every row (the selection that over="all" means)."""
    nblk = (T + block_size - 1) // block_size
    return torch.arange(nblk, dtype=torch.int32, device=device).expand(B, G, T, nblk)


def index_kl_loss_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    block_idx: torch.Tensor,
    *,
    block_size: int,
    softmax_scale: float | None = None,
    index_softmax_scale: float | None = None,
    over: str = "selected",
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scalar KL(P || P_idx) averaged over (b, r, i); layouts as in docs/msa.md.

    over="all": over every token j <= i (block_idx is ignored and may be None).
    cu_seqlens [ndocs + 1]: documents packed along T (tensors [1, total, ...], block_idx
    [1, G, total, K] with ids relative to each document's start); the mean over all (r, i)
    of all documents.  block_size is given (the public op states the default).
    """
    if cu_seqlens is not None:
        cu = [int(x) for x in cu_seqlens.tolist()]
        acc = q_idx.new_zeros((), dtype=compute_dtype(q_idx))
        for s, e in zip(cu[:-1], cu[1:]):
            if e > s:
                part = index_kl_loss_reference(
                    q[:, s:e], k[:, s:e], q_idx[:, s:e], k_idx[:, s:e], None if over == "all" else block_idx[:, :, s:e],
                    block_size=block_size, softmax_scale=softmax_scale, index_softmax_scale=index_softmax_scale,
                    over=over,
                )
                acc = acc + part * (e - s)
        return acc / cu[-1]
    B, T, Hq, D = q.shape
    G = k.shape[2]
    Di = q_idx.shape[-1]
    if over == "all":
        block_idx = all_blocks(B, G, T, block_size, q.device)
    elif over != "selected":
        raise ValueError(f"over must be 'selected' or 'all', got {over!r}")
    K = block_idx.shape[-1]
    scale = default_scale(softmax_scale, D)
    iscale = default_scale(index_softmax_scale, Di)
    L = K * block_size
    C = chunk_rows(T, B * G * L * (D + Di + Hq // G + 6) * 4)
    grad = torch.is_grad_enabled() and (q_idx.requires_grad or k_idx.requires_grad)
    total = q_idx.new_zeros((), dtype=compute_dtype(q_idx))
    for i0 in range(0, T, C):
        i1 = min(T, i0 + C)
        args = (q[:, i0:i1], k, q_idx[:, i0:i1], k_idx, block_idx[:, :, i0:i1], i0 + k.shape[1] - T, block_size, scale, iscale)
        total = total + (checkpoint(_chunk, *args, use_reentrant=False) if grad else _chunk(*args))
    return total / (B * G * T)


def _lse_chunk(q, k, bidx, i0: int, block_size: int, scale: float):
    B, C, Hq, D = q.shape
    T, G = k.shape[1], k.shape[2]
    cdt = compute_dtype(q)
    pos, valid = selected_tokens(bidx, i0, T, block_size)
    kc = gather_tokens(k, pos).to(cdt)
    qc = q.to(cdt).view(B, C, G, Hq // G, D).permute(0, 2, 1, 3, 4)
    s = torch.einsum("bgchd,bgcld->bgchl", qc, kc) * scale
    s = s.masked_fill(~valid.unsqueeze(3), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [B, G, C, hpg]; -inf for an empty row
    return lse.permute(0, 1, 3, 2).reshape(B, Hq, C)


@torch.no_grad()
def selected_lse_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    block_idx: torch.Tensor,
    *,
    block_size: int,
    softmax_scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """lse [B, Hq, T] float32 (float64 for float64 q): log sum_{j in T_sel(r, i)} exp(scale * q_h(i) . k_r(j)).

    -inf for a row selecting nothing.  With cu_seqlens (B = 1), ids are relative to each document.
    """
    B, T, Hq, D = q.shape
    G = k.shape[2]
    K = block_idx.shape[-1]
    scale = default_scale(softmax_scale, D)
    if cu_seqlens is not None:
        cu = [int(x) for x in cu_seqlens.tolist()]
        out = torch.full((B, Hq, T), float("-inf"), device=q.device, dtype=compute_dtype(q))
        for s, e in zip(cu[:-1], cu[1:]):
            if e > s:
                out[:, :, s:e] = selected_lse_reference(
                    q[:, s:e], k[:, s:e], block_idx[:, :, s:e], block_size=block_size, softmax_scale=scale
                )
        return out
    C = chunk_rows(T, B * G * K * block_size * (D + Hq // G + 4) * 4)
    parts = [_lse_chunk(q[:, i0:i0 + C], k, block_idx[:, :, i0:i0 + C], i0, block_size, scale) for i0 in range(0, T, C)]
    return torch.cat(parts, dim=2)

