"""Key-block-outer work lists for the sm_90 sparse-attention backward (torch ops: any device).

The backward's unit of query work is an m-block: MB_QUERIES (4) consecutive queries of one
(batch, kv group), 4 x 16 heads = 64 MMA rows, m-block mb = queries 4 mb .. 4 mb + 3.  Per key
block (b, g, blk) the kernel walks the m-blocks whose union (the forward's union tiles, split in
halves) contains blk, each with a 4-bit mask of its queries that selected blk:

    ent    int32 [E]               entry = mb << MB_BITS | mask, grouped by key (b, g, blk),
                                   m-blocks ascending within a key
    items  int32 [n_items, 4]      (b * G + g, blk, first entry, number of entries): each key's
                                   entries cut into runs of at most `chunk` m-blocks, one CTA
                                   each, longest runs first

`bwd_worklist_from_union` converts the forward's work list (`worklist.union_worklist` or
`worklist_from_union_plan`, tiles of 4 or 8 queries) into this form (one host sync: the number of
entries and items sizes the grid); `bwd_worklist` builds it from block_idx.
`bwd_worklist_reference` is the definition in Python lists (the tests).
"""

from __future__ import annotations

import torch

from .consts import MB_BITS, MB_QUERIES, QBITS
from .worklist import tile_count, union_worklist

CHUNK = 128  # m-blocks per item at most (512 queries x 16 heads)


def mblock_count(T: int) -> int:
    """m-blocks covering T queries."""
    return tile_count(T, MB_QUERIES)


def bwd_worklist_from_union(work: torch.Tensor, count: torch.Tensor, queries: int, nblocks: int,
                            chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """(items, ent) of the module docstring from the forward's (work [B, G, ntiles, cap],
    count [B, G, ntiles]) of tiles of `queries` (4 or 8) queries and key blocks < nblocks."""
    if queries not in (4, 8):
        raise ValueError(f"queries must be 4 or 8 (whole m-blocks of {MB_QUERIES} queries), got {queries!r}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive integer, got {chunk!r}")
    if work.dim() != 4 or count.shape != work.shape[:3]:
        raise ValueError(f"work must be [B, G, ntiles, cap] and count [B, G, ntiles], got "
                         f"{tuple(work.shape)}, {tuple(count.shape)}")
    B, G, nt, cap = work.shape
    dev = work.device
    halves = queries // MB_QUERIES
    nmb = nt * halves
    slot = torch.arange(cap, device=dev)
    valid = slot < count.unsqueeze(-1).long()
    bg = (torch.arange(B, device=dev).view(B, 1, 1, 1) * G + torch.arange(G, device=dev).view(1, G, 1, 1))
    tile = torch.arange(nt, device=dev).view(1, 1, nt, 1)
    e = work.long()
    blk = e >> QBITS
    mask = e & ((1 << QBITS) - 1)
    keys, masks = [], []
    for h in range(halves):
        m = (mask >> (MB_QUERIES * h)) & ((1 << MB_QUERIES) - 1)
        ok = valid & (m != 0)
        keys.append(((bg * nblocks + blk) * nmb + tile * halves + h)[ok])
        masks.append(m[ok])
    key = torch.cat(keys)  # (b, g, blk) * nmb + mb
    msk = torch.cat(masks)
    order = torch.sort(key).indices
    key, msk = key[order], msk[order]
    mb = key % nmb
    ent = ((mb << MB_BITS) | msk).to(torch.int32)
    nkeys = B * G * nblocks
    kid = key // nmb
    per = torch.zeros(nkeys, dtype=torch.int64, device=dev).scatter_add_(0, kid, torch.ones_like(kid))
    first = torch.cumsum(per, 0) - per
    nchunks = (per + chunk - 1) // chunk
    item_key = torch.repeat_interleave(torch.arange(nkeys, device=dev), nchunks)
    item0 = torch.cumsum(nchunks, 0) - nchunks
    ci = torch.arange(item_key.numel(), device=dev) - item0[item_key]
    start = first[item_key] + ci * chunk
    n = torch.minimum(per[item_key] - ci * chunk, torch.full_like(start, chunk))
    items = torch.stack([item_key // nblocks, item_key % nblocks, start, n], dim=1)
    items = items[torch.sort(n, descending=True, stable=True).indices]
    return items.to(torch.int32).contiguous(), ent.contiguous()


def bwd_worklist(block_idx: torch.Tensor, nblocks: int, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """(items, ent) for block_idx int [B, G, T, topk] (ids in [0, nblocks) or -1), through the
    forward's union work list of 8-query tiles."""
    work, count = union_worklist(block_idx, 2 * MB_QUERIES, nblocks)
    return bwd_worklist_from_union(work, count, 2 * MB_QUERIES, nblocks, chunk)


def bwd_worklist_reference(block_idx: torch.Tensor) -> dict[tuple[int, int, int], list[tuple[int, int]]]:
    """{(b, g, blk): [(mb, mask), ...] ascending in mb} for every key block some query selects
    (slow; the definition the tests compare against)."""
    B, G, T, K = block_idx.shape
    out: dict[tuple[int, int, int], dict[int, int]] = {}
    for b in range(B):
        for g in range(G):
            for t in range(T):
                for blk in set(int(x) for x in block_idx[b, g, t].tolist() if int(x) >= 0):
                    d = out.setdefault((b, g, blk), {})
                    mb = t // MB_QUERIES
                    d[mb] = d.get(mb, 0) | (1 << (t % MB_QUERIES))
    return {key: sorted(d.items()) for key, d in out.items()}


def dq_from_accum(dq_accum: torch.Tensor, B: int, G: int, T: int, hpg: int, D: int) -> torch.Tensor:
    """dq [B, T, G * hpg, D] float32 from the kernel's dQ accumulator fp32 [B, G, nmb, 2, 64, 64]:
    per m-block two halves of D (one per consumer warpgroup), each 64 rows (row = query-in-m-block
    * hpg + head) x 64 columns, column c of row r stored at c ^ (8 * (r % 8)) (bank-conflict-free
    shared-memory stores; the bulk reduce copies that order)."""
    nmb = dq_accum.shape[2]
    rows = torch.arange(64, device=dq_accum.device).view(64, 1)
    cols = torch.arange(64, device=dq_accum.device).view(1, 64)
    idx = (cols ^ (8 * (rows % 8))).expand(B, G, nmb, 2, 64, 64)
    a = torch.gather(dq_accum.view(B, G, nmb, 2, 64, 64), -1, idx)
    a = a.view(B, G, nmb, 2, MB_QUERIES, hpg, D // 2).permute(0, 2, 4, 1, 5, 3, 6)
    return a.reshape(B, nmb * MB_QUERIES, G * hpg, D)[:, :T]
