"""The meaning of MSA's block selection (pure PyTorch): ONE rule, at any query positions.

A query at position p (row b, group r) sees the keys j <= p.  Blocks are `block_size` keys wide;
block c is *valid* for the query when c <= p // block_size.  Given a score per (query, block)
(`block_scores`: the index score max-pooled over the block's visible keys; or any other score,
e.g. the oracle's attention mass `attention_block_mass`), the selection (`rank_blocks`) is

    forced = {own, own - 1, ..., own - local_blocks + 1} U {0, ..., init_blocks - 1}  (valid ones)
    rest   = the other valid blocks by descending score, ties to the lower block id
    row    = forced (ascending id), then rest, truncated to topk, padded with -1

where own = p // block_size.  A NaN score counts as -inf and a block whose score is -inf is never
selected unless forced (NaN in q_idx or k_idx never wins a slot).  The scale of the index score
does not change the ranking, so none is applied.

Every selection of msakit follows this rule: the `index_topk` op (its Triton kernel is tested
against `select_blocks`), decode (`msa_decode`, whose kernels are tested against it), the caches'
per-row attention, the evaluation policies and the recall metric.  A new rule changes this file,
then the kernels of `index_topk` and `decode`, whose tests compare with it.
"""

from __future__ import annotations

import math

import torch

from .._gather import chunk_rows, compute_dtype
from ..fp8 import quantize_fp8_reference

__all__ = [
    "attention_block_mass",
    "block_scores",
    "fp8_scoring_inputs",
    "index_topk_reference",
    "query_positions",
    "rank_blocks",
    "select_blocks",
    "selected_token_mask",
]


def query_positions(num_queries: int, num_keys: int, device: torch.device | str | None = None) -> torch.Tensor:
    """int64 [1, T]: the default placement, T queries at the last T of num_keys positions."""
    if num_queries > num_keys:
        raise ValueError(f"{num_queries} queries cannot be the last positions of {num_keys} keys")
    return torch.arange(num_keys - num_queries, num_keys, device=device).unsqueeze(0)


def _positions(positions: torch.Tensor | None, B: int, T: int, Lk: int, device) -> torch.Tensor:
    if positions is None:
        return query_positions(T, Lk, device)
    if not isinstance(positions, torch.Tensor) or positions.dim() != 2 or positions.shape[-1] != T \
            or positions.shape[0] not in (1, B):
        raise ValueError(f"positions must be an integer tensor [B={B} or 1, T={T}], got "
                         f"{tuple(positions.shape) if isinstance(positions, torch.Tensor) else type(positions).__name__}")
    return positions.to(device=device, dtype=torch.long)


def rank_blocks(scores: torch.Tensor, positions: torch.Tensor, *, block_size: int, topk: int, local_blocks: int = 1,
                init_blocks: int = 0) -> torch.Tensor:
    """THE selection rule (module docstring): scores float [B, G, T, nb] (NaN = -inf) of
    queries at positions int [B or 1, T] -> block ids int32 [B, G, T, topk]."""
    B, G, T, nb = scores.shape
    dev = scores.device
    own = (positions.to(dev).long() // block_size).view(positions.shape[0], 1, T, 1)
    blocks = torch.arange(nb, device=dev).view(1, 1, 1, nb)
    forced = ((blocks <= own) & (blocks > own - local_blocks)) | ((blocks < init_blocks) & (blocks <= own))
    s = scores.masked_fill(torch.isnan(scores), float("-inf"))
    s = s.masked_fill(forced, float("inf")).masked_fill(blocks > own, float("-inf"))
    order = torch.sort(s, dim=-1, descending=True, stable=True)
    kk = min(topk, nb)
    ids = order.indices[..., :kk].to(torch.int32).masked_fill(order.values[..., :kk] == float("-inf"), -1)
    if kk < topk:
        ids = torch.nn.functional.pad(ids, (0, topk - kk), value=-1)
    return ids


def block_scores(q_idx: torch.Tensor, k_idx: torch.Tensor, positions: torch.Tensor, *, block_size: int) -> torch.Tensor:
    """M(i, c) = max over the keys j <= position(i) of block c of q_idx(r, i) . k_idx(j).

    q_idx [B, T, G, Di], k_idx [B, Lk, Di], positions int [B or 1, T] -> float [B, G, T, nb]
    (nb = ceil(Lk / block_size); -inf where a block has no visible key; NaN scores are -inf).
    Computed in float32 (float64 inputs stay float64)."""
    B, T, G, _ = q_idx.shape
    Lk = k_idx.shape[1]
    cdt = compute_dtype(q_idx)
    s = torch.einsum("bigd,bjd->bgij", q_idx.to(cdt), k_idx.to(cdt))  # [B, G, T, Lk]
    s = s.masked_fill(torch.isnan(s), float("-inf"))
    cols = torch.arange(Lk, device=s.device).view(1, 1, 1, Lk)
    s = s.masked_fill(cols > positions.to(s.device).view(positions.shape[0], 1, T, 1), float("-inf"))
    nb = (Lk + block_size - 1) // block_size
    if nb * block_size > Lk:
        s = torch.nn.functional.pad(s, (0, nb * block_size - Lk), value=float("-inf"))
    return s.view(B, G, T, nb, block_size).amax(dim=-1)


def select_blocks(q_idx: torch.Tensor, k_idx: torch.Tensor, *, block_size: int, topk: int, local_blocks: int = 1,
                  init_blocks: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
    """The indexer's selection: `rank_blocks(block_scores(...))`, chunked over the queries.

    q_idx [B, T, G, Di], k_idx [B, Lk, Di]; positions int [B or 1, T] (query i of row b sits at
    positions[b, i] and sees keys j <= it; default: the last T of the Lk positions) -> block ids
    int32 [B, G, T, topk], -1 padded."""
    B, T, G, _ = q_idx.shape
    Lk = k_idx.shape[1]
    dev = q_idx.device
    pos = _positions(positions, B, T, Lk, dev)
    out = torch.full((B, G, T, topk), -1, dtype=torch.int32, device=dev)
    nb_all = (Lk + block_size - 1) // block_size
    C = chunk_rows(T, B * G * nb_all * block_size * 8)
    for i0 in range(0, T, C):
        i1 = min(T, i0 + C)
        p = pos[:, i0:i1]
        # keys any row of this chunk can see: with the default placement, up to the chunk's last
        # query (no host read); with given positions, all of them
        jmax = min(Lk, ((Lk - T + i1 - 1) // block_size + 1) * block_size) if positions is None else Lk
        M = block_scores(q_idx[:, i0:i1], k_idx[:, :jmax], p, block_size=block_size)
        out[:, :, i0:i1] = rank_blocks(M, p, block_size=block_size, topk=topk, local_blocks=local_blocks,
                                       init_blocks=init_blocks)
    return out


def selected_token_mask(block_idx: torch.Tensor, positions: torch.Tensor, num_keys: int, *, block_size: int) -> torch.Tensor:
    """block_idx int [B, G, T, K] (-1 padded; a set: repeats add nothing) of queries at positions
    int [B or 1, T] -> bool [B, G, T, num_keys], True on the keys j <= position of the selected blocks."""
    B, G, T, K = block_idx.shape
    dev = block_idx.device
    nb = (num_keys + block_size - 1) // block_size
    ids = block_idx.long()
    ids = torch.where((ids >= 0) & (ids < nb), ids, torch.full_like(ids, nb))
    chosen = torch.zeros(B, G, T, nb + 1, dtype=torch.bool, device=dev).scatter_(-1, ids, True)[..., :nb]
    tok = chosen.repeat_interleave(block_size, dim=-1)[..., :num_keys]
    cols = torch.arange(num_keys, device=dev).view(1, 1, 1, num_keys)
    return tok & (cols <= positions.to(dev).view(positions.shape[0], 1, T, 1))


def attention_block_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    *,
    block_size: int,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """The oracle's block score: the true attention mass of each key block.

    q [B, T, Hq, D], k [B, Lk, G, D], positions int [B or 1, T] -> float32 [B, G, T, nb]:
    mass(r, i, c) = mean over the heads h of group r of the sum over keys j <= position(i) in
    block c of softmax_j(scale * q_h(i) . k_r(j)) (over the visible keys only).  Not chunked:
    callers bound T."""
    B, T, Hq, D = q.shape
    Lk, G = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    cdt = compute_dtype(q)
    qc = q.to(cdt).view(B, T, G, Hq // G, D)
    s = torch.einsum("bighd,bjgd->bghij", qc, k.to(cdt)) * scale  # [B, G, hpg, T, Lk]
    cols = torch.arange(Lk, device=s.device).view(1, 1, 1, 1, Lk)
    s = s.masked_fill(cols > positions.to(s.device).view(positions.shape[0], 1, 1, T, 1), float("-inf"))
    p = torch.softmax(s, dim=-1).mean(dim=2)  # [B, G, T, Lk]
    p = torch.nan_to_num(p, nan=0.0)  # a query that sees no key has no mass
    nb = (Lk + block_size - 1) // block_size
    if nb * block_size > Lk:
        p = torch.nn.functional.pad(p, (0, nb * block_size - Lk))
    return p.view(B, G, T, nb, block_size).sum(-1).float()


def index_topk_reference(q_idx: torch.Tensor, k_idx: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None,
                         **selection: int) -> torch.Tensor:
    """The `index_topk` op's meaning: `select_blocks(q_idx, k_idx, **selection)` (block_size, topk,
    local_blocks, init_blocks) with the T queries at the last T of the Tk key positions ->
    block_idx int32 [B, G, T, topk].

    cu_seqlens [ndocs + 1]: packed documents, q_idx [1, total, G, Di], k_idx [1, total, Di].
    Document d holds tokens cu_seqlens[d] .. cu_seqlens[d + 1] - 1 and is an independent
    sequence: its blocks are counted from its first token and the ids in its rows are relative
    to that token; tokens outside every document stay -1.
    """
    if cu_seqlens is None:
        return select_blocks(q_idx, k_idx, **selection)
    _, total, G, _ = q_idx.shape
    out = torch.full((1, G, total, selection["topk"]), -1, dtype=torch.int32, device=q_idx.device)
    bounds = [int(x) for x in cu_seqlens.tolist()]
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e > s:
            out[:, :, s:e] = select_blocks(q_idx[:, s:e], k_idx[:, s:e], **selection)
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
