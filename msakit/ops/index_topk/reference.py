"""Reference meaning of `index_topk` (pure PyTorch; O(T^2) time, chunked over queries).

    s(i, j)  = q_idx(r, i) . k_idx(j)                for j <= i
    M(i, b)  = max_{j in block b, j <= i} s(i, j)
    forced   = {i // bs, ..., i // bs - local_blocks + 1} U {0, ..., init_blocks - 1}  (valid ones)
    rest     = valid blocks (b <= i // bs) by descending M, ties to the lower block id
    row      = forced (ascending id), then rest, truncated to topk, padded with -1

The scale of s does not change the ranking, so none is applied.
"""

from __future__ import annotations

import torch

from .._gather import chunk_rows, compute_dtype


def index_topk_reference(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    *,
    block_size: int = 128,
    topk: int = 16,
    local_blocks: int = 1,
    init_blocks: int = 0,
) -> torch.Tensor:
    """q_idx [B, T, G, Di], k_idx [B, Tk, Di] -> block_idx int32 [B, G, T, topk].

    With Tk > T the queries are the last T positions of the keys' sequence (decode).
    """
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
