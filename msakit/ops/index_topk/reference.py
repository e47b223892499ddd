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


def index_topk_varlen_reference(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    block_size: int = 128,
    topk: int = 16,
    local_blocks: int = 1,
    init_blocks: int = 0,
) -> torch.Tensor:
    """Packed documents: q_idx [1, total, G, Di], k_idx [1, total, Di], cu_seqlens [ndocs + 1].

    Document d holds tokens cu_seqlens[d] .. cu_seqlens[d + 1] - 1 and is an independent
    sequence: its blocks are counted from its first token and the ids in its rows are relative
    to that token.  Returns int32 [1, G, total, topk]; tokens outside every document stay -1.
    """
    _, total, G, _ = q_idx.shape
    out = torch.full((1, G, total, topk), -1, dtype=torch.int32, device=q_idx.device)
    bounds = [int(x) for x in cu_seqlens.tolist()]
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e > s:
            out[:, :, s:e] = index_topk_reference(
                q_idx[:, s:e], k_idx[:, s:e], block_size=block_size, topk=topk,
                local_blocks=local_blocks, init_blocks=init_blocks,
            )
    return out


FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_fp8_rows(x: torch.Tensor, chunk_rows: int = 1 << 18) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (last dim) symmetric float8_e4m3fn quantization: x ~= xq.float() * scale[..., None].

    Returns (xq float8_e4m3fn with x's shape, scale float32 with x's shape minus the last dim).
    All-zero rows get the smallest normal scale (their codes are 0).  Works on chunks of
    `chunk_rows` rows so the float32 temporaries stay small (q_idx at 1M tokens is 2 GiB in fp32).
    """
    D = x.shape[-1]
    rows = x.reshape(-1, D)
    xq = torch.empty(rows.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
    for r0 in range(0, rows.shape[0], chunk_rows):
        xf = rows[r0:r0 + chunk_rows].float()
        s = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
        xq[r0:r0 + chunk_rows] = (xf / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        scale[r0:r0 + chunk_rows] = s.squeeze(-1)
    return xq.view(x.shape), scale.view(x.shape[:-1])


def fp8_scoring_inputs(q_idx: torch.Tensor, k_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 (q, k) whose exact scores the FP8 scoring path ranks.

    The kernel scores q8(r, i) . k8(j) * k_scale(j): the per-(token, group) q scale is positive,
    so it cannot change a row's ranking and is dropped; the per-token k scale varies along the
    row and is applied to each key.  index_topk_reference on these tensors is the meaning of
    `score_dtype="fp8"` (up to float32 rounding order).
    """
    q8, _ = quantize_fp8_rows(q_idx)
    k8, ks = quantize_fp8_rows(k_idx)
    return q8.float(), k8.float() * ks.unsqueeze(-1)
