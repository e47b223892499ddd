"""Reference meaning of `sparse_attention` (pure PyTorch, gathers the selected tokens).

Head h of group r = h // (Hq // G) at query i attends exactly the tokens j <= i that lie in
the blocks block_idx[b, r, i] (a set: -1 and repeated ids add nothing):

    o(h, i)   = sum_j softmax_j(scale * q_h(i) . k_r(j)) v_r(j)     (float32 softmax)
    lse(h, i) = log sum_j exp(scale * q_h(i) . k_r(j))              (natural log)

A row that selects no token gives o = 0 and lse = -inf.  Differentiable (autograd through
the gathers); chunks are recomputed in backward so memory stays bounded.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from .._gather import chunk_rows, compute_dtype, default_scale, gather_tokens, masked_softmax_parts, selected_tokens


def _chunk(q, k, v, bidx, row0: int, block_size: int, scale: float):
    B, C, Hq, D = q.shape
    T, G = k.shape[1], k.shape[2]
    cdt = compute_dtype(q)
    pos, valid = selected_tokens(bidx, row0, T, block_size)  # [B, G, C, L]
    kc = gather_tokens(k, pos).to(cdt)  # [B, G, C, L, D]
    vc = gather_tokens(v, pos).to(cdt)
    qc = q.to(cdt).view(B, C, G, Hq // G, D).permute(0, 2, 1, 3, 4)  # [B, G, C, hpg, D]
    s = torch.einsum("bgchd,bgcld->bgchl", qc, kc) * scale
    p, denom, m = masked_softmax_parts(s, valid.unsqueeze(3))
    # denom >= 1 on any row with a token (p = exp(s - max)); clamping at 1 keeps empty rows NaN-free
    o = torch.einsum("bgchl,bgcld->bgchd", p, vc) / denom.clamp_min(1.0)
    lse = (m + torch.log(denom)).squeeze(-1)  # [B, G, C, hpg]
    o = o.permute(0, 2, 1, 3, 4).reshape(B, C, Hq, D)
    lse = lse.permute(0, 1, 3, 2).reshape(B, Hq, C)
    return o, lse


def sparse_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_idx: torch.Tensor,
    *,
    block_size: int,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    cu_seqlens: torch.Tensor | None = None,
):
    """q [B,T,Hq,D], k/v [B,T,G,D], block_idx [B,G,T,K] -> o [B,T,Hq,D] (q.dtype), lse [B,Hq,T] fp32.

    cu_seqlens [ndocs + 1]: a packed variable-length batch, documents d = [cu_seqlens[d],
    cu_seqlens[d+1]) of q [1, total, Hq, D], k/v [1, total, G, D], block_idx [1, G, total, topk].
    Block ids are relative to each document's start (block b of document d covers the tokens
    cu_seqlens[d] + b*block_size ...), and no token attends outside its document: each
    document is computed on its own slice.  block_size is given (the public op states the default).
    """
    if cu_seqlens is not None:
        bounds = [int(x) for x in cu_seqlens.tolist()]
        outs, lses = [], []
        for s, e in zip(bounds[:-1], bounds[1:]):
            if e > s:
                o, lse = sparse_attention_reference(
                    q[:, s:e], k[:, s:e], v[:, s:e], block_idx[:, :, s:e],
                    block_size=block_size, softmax_scale=softmax_scale, return_lse=True,
                )
                outs.append(o)
                lses.append(lse)
        o = torch.cat(outs, dim=1)
        return (o, torch.cat(lses, dim=2)) if return_lse else o
    B, T, Hq, D = q.shape
    G = k.shape[2]
    K = block_idx.shape[-1]
    scale = default_scale(softmax_scale, D)
    L = K * block_size
    C = chunk_rows(T, B * G * L * (2 * D + 2 + Hq // G) * 4)
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    outs, lses = [], []
    for i0 in range(0, T, C):
        i1 = min(T, i0 + C)
        args = (q[:, i0:i1], k, v, block_idx[:, :, i0:i1], i0 + k.shape[1] - T, block_size, scale)
        o, lse = checkpoint(_chunk, *args, use_reentrant=False) if grad else _chunk(*args)
        outs.append(o)
        lses.append(lse)
    o = torch.cat(outs, dim=1).to(q.dtype)
    if return_lse:
        return o, torch.cat(lses, dim=2).float()
    return o
