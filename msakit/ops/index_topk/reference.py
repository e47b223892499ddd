"""Reference meaning of `index_topk` (pure PyTorch; O(T^2) time, chunked over queries).

    s(i, j)  = q_idx(r, i) . k_idx(j)                for j <= i  (NaN counts as -inf)
    M(i, b)  = max_{j in block b, j <= i} s(i, j)
    forced   = {i // bs, ..., i // bs - local_blocks + 1} U {0, ..., init_blocks - 1}  (valid ones)
    rest     = valid blocks (b <= i // bs) by descending M, ties to the lower block id
    row      = forced (ascending id), then rest, truncated to topk, padded with -1

The scale of s does not change the ranking, so none is applied.  A NaN score counts as -inf:
a block whose scores are all NaN is never selected unless it is forced (NaN in q_idx or k_idx
never wins a slot).
"""

from __future__ import annotations

import torch

from .._gather import chunk_rows, compute_dtype
from ..fp8 import quantize_fp8_reference


def index_topk_reference(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    *,
    block_size: int,
    topk: int,
    local_blocks: int = 1,
    init_blocks: int = 0,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """q_idx [B, T, G, Di], k_idx [B, Tk, Di] -> block_idx int32 [B, G, T, topk].

    With Tk > T the queries are the last T positions of the keys' sequence (decode).  block_size
    and topk are given (the public `index_topk` states the defaults).

    cu_seqlens [ndocs + 1]: packed documents, q_idx [1, total, G, Di], k_idx [1, total, Di].
    Document d holds tokens cu_seqlens[d] .. cu_seqlens[d + 1] - 1 and is an independent
    sequence: its blocks are counted from its first token and the ids in its rows are relative
    to that token; tokens outside every document stay -1.
    """
    kw = dict(block_size=block_size, topk=topk, local_blocks=local_blocks, init_blocks=init_blocks)
    if cu_seqlens is not None:
        _, total, G, _ = q_idx.shape
        out = torch.full((1, G, total, topk), -1, dtype=torch.int32, device=q_idx.device)
        bounds = [int(x) for x in cu_seqlens.tolist()]
        for s, e in zip(bounds[:-1], bounds[1:]):
            if e > s:
                out[:, :, s:e] = index_topk_reference(q_idx[:, s:e], k_idx[:, s:e], **kw)
        return out
    B, T, G, _ = q_idx.shape
    Tk = k_idx.shape[1]
    off = Tk - T
    dev = q_idx.device
    cdt = compute_dtype(q_idx)
    nblocks = (Tk + block_size - 1) // block_size
    out = torch.full((B, G, T, topk), -1, dtype=torch.int32, device=dev)
    qf = q_idx.to(cdt)
    kf = k_idx.to(cdt)
    C = chunk_rows(T, B * G * (nblocks * block_size) * 8)
    for i0 in range(0, T, C):
        i1 = min(T, i0 + C)
        nb = (off + i1 - 1) // block_size + 1  # blocks any row of this chunk can see
        jmax = min(Tk, nb * block_size)
        s = torch.einsum("bigd,bjd->bgij", qf[:, i0:i1], kf[:, :jmax])  # [B, G, C, jmax]
        s = s.masked_fill(torch.isnan(s), float("-inf"))  # a NaN score is never selected
        rows = torch.arange(off + i0, off + i1, device=dev).view(-1, 1)
        cols = torch.arange(jmax, device=dev).view(1, -1)
        s = s.masked_fill(cols > rows, float("-inf"))
        if jmax < nb * block_size:
            s = torch.nn.functional.pad(s, (0, nb * block_size - jmax), value=float("-inf"))
        M = s.view(B, G, i1 - i0, nb, block_size).amax(dim=-1)  # [B, G, C, nb]
        own = (rows // block_size)  # [C, 1]
        blocks = torch.arange(nb, device=dev).view(1, -1)
        forced = ((blocks <= own) & (blocks > own - local_blocks)) | ((blocks < init_blocks) & (blocks <= own))
        M = M.masked_fill(forced, float("inf"))
        M = M.masked_fill(blocks > own, float("-inf"))
        order = torch.sort(M, dim=-1, descending=True, stable=True)
        kk = min(topk, nb)
        ids = order.indices[..., :kk].to(torch.int32)
        vals = order.values[..., :kk]
        ids = ids.masked_fill(vals == float("-inf"), -1)
        out[:, :, i0:i1, :kk] = ids
    return out


def fp8_scoring_inputs(q_idx: torch.Tensor, k_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 (q, k) whose exact scores the FP8 scoring path ranks.

    The kernel scores q8(r, i) . k8(j) * k_scale(j): the per-(token, group) q scale is positive,
    so it cannot change a row's ranking and is dropped; the per-token k scale varies along the
    row and is applied to each key.  index_topk_reference on these tensors is the meaning of
    `score_dtype="fp8"` (up to float32 rounding order).
    """
    q8, _ = quantize_fp8_reference(q_idx)
    k8, ks = quantize_fp8_reference(k_idx)
    return q8.float(), k8.float() * ks.unsqueeze(-1)
