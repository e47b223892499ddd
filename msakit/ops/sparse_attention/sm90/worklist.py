"""Union-tile work lists for the sm_90 query-outer forward (torch ops: runs on any device).

A tile is `queries` consecutive query rows of one (batch, kv group); its rows in the kernel are
those queries x the group's heads.  The tile's work is the union of the key blocks its queries
selected, each with a bitmask of the queries (bit qi = query t0 + qi) that selected it:

    work  int32 [B, G, ntiles, cap]   entry = block << QBITS | mask, the tile's blocks ascending,
                                      then -1 (cap = min(queries * topk, nblocks))
    count int32 [B, G, ntiles]        number of valid entries of each tile

(ntiles = ceil(T / queries); the tail tile's missing queries select nothing.)  -1 slots and a
block a row repeats add nothing (the reference's set semantics).  Two builders, no host sync:

- `union_worklist`: one segmented sort per tile in torch (`torch.sort` along the tile's
  queries x topk slots); any device; the definition the kernel's tests use;
- `worklist_from_union_plan`: from the plan `union.union_plan` already built for the choice of
  forward (the same tiles, the same ascending union), one Triton program per tile turning the
  plan's per-row slot bits into per-entry query masks: what `sparse_attention` runs (the torch
  sort costs 0.5 ms at 16K and 3 ms at 128K on an H100, several times the plan).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .consts import QBITS
MAX_BLOCK = (1 << (31 - QBITS)) - 1  # largest block id an entry can hold


def tile_count(T: int, queries: int) -> int:
    """Tiles of `queries` rows covering T rows."""
    return -(-T // queries)


def union_worklist(block_idx: torch.Tensor, queries: int, nblocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(work, count) of the module docstring for block_idx int [B, G, T, topk] (ids in
    [0, nblocks) or -1) and tiles of `queries` rows (1 <= queries <= QBITS)."""
    if not isinstance(block_idx, torch.Tensor) or block_idx.dim() != 4 or block_idx.dtype.is_floating_point:
        raise ValueError(f"block_idx must be an integer tensor [B, G, T, topk], got "
                         f"{getattr(block_idx, 'dtype', type(block_idx).__name__)} {tuple(getattr(block_idx, 'shape', ()))}")
    if isinstance(queries, bool) or not isinstance(queries, int) or not 1 <= queries <= QBITS:
        raise ValueError(f"queries must be an integer in [1, {QBITS}], got {queries!r}")
    if isinstance(nblocks, bool) or not isinstance(nblocks, int) or not 1 <= nblocks <= MAX_BLOCK + 1:
        raise ValueError(f"nblocks must be an integer in [1, {MAX_BLOCK + 1}], got {nblocks!r}")
    B, G, T, K = block_idx.shape
    nt = tile_count(T, queries)
    pad = nt * queries - T
    sel = block_idx.long()
    if pad:
        sel = torch.cat([sel, sel.new_full((B, G, pad, K), -1)], dim=2)
    # key = block * queries + query-in-tile, one row of queries * K keys per tile; invalid -> big
    qi = torch.arange(queries, device=sel.device).view(1, 1, 1, queries, 1)
    sel = sel.view(B, G, nt, queries, K)
    big = torch.iinfo(torch.int64).max
    key = torch.where(sel >= 0, sel * queries + qi, torch.full_like(sel, big)).view(B, G, nt, queries * K)
    key = key.sort(dim=-1).values
    valid = key != big
    repeat = torch.zeros_like(valid)
    repeat[..., 1:] = key[..., 1:] == key[..., :-1]  # a (block, query) pair a row repeats
    valid &= ~repeat
    blk = torch.where(valid, key // queries, torch.full_like(key, -1))
    bit = torch.where(valid, torch.ones_like(key) << (key % queries), torch.zeros_like(key))
    # a new block starts where the block id changes (keys are sorted, so -1s trail the valid ones
    # apart from repeats, which carry the block of their run)
    new = valid.clone()
    new[..., 1:] &= blk[..., 1:] != torch.cummax(blk, dim=-1).values[..., :-1]
    seg = new.long().cumsum(-1) - 1  # the entry of each key (run of one block)
    cap = min(queries * K, nblocks)
    seg = torch.where(valid & (seg < cap), seg, torch.full_like(seg, cap))  # the sink column cap
    ids = torch.zeros(B, G, nt, cap + 1, dtype=torch.int64, device=sel.device)
    ids.scatter_reduce_(-1, seg, torch.where(valid, blk, torch.zeros_like(blk)), reduce="amax", include_self=True)
    masks = torch.zeros_like(ids).scatter_add_(-1, seg, bit)
    count = new.sum(-1).clamp(max=cap)
    slot = torch.arange(cap, device=sel.device)
    work = torch.where(slot < count.unsqueeze(-1), (ids[..., :cap] << QBITS) | masks[..., :cap],
                       torch.full_like(ids[..., :cap], -1))
    return work.to(torch.int32).contiguous(), count.to(torch.int32).contiguous()


def union_worklist_reference(block_idx: torch.Tensor, queries: int) -> list[list[list[list[tuple[int, int]]]]]:
    """The same work as Python lists (slow; the definition the tests compare against):
    [b][g][tile] -> [(block, mask), ...] ascending."""
    B, G, T, K = block_idx.shape
    out = []
    for b in range(B):
        per_g = []
        for g in range(G):
            tiles = []
            for t0 in range(0, T, queries):
                m: dict[int, int] = {}
                for qi in range(min(queries, T - t0)):
                    for blk in set(int(x) for x in block_idx[b, g, t0 + qi].tolist() if int(x) >= 0):
                        m[blk] = m.get(blk, 0) | (1 << qi)
                tiles.append(sorted(m.items()))
            per_g.append(tiles)
        out.append(per_g)
    return out


@triton.jit
def _entries_kernel(ulist_ptr, ucnt_ptr, bits_ptr, work_ptr, E: tl.constexpr, W: tl.constexpr, QT: tl.constexpr,
                    QB: tl.constexpr):
    """One (b, g, tile): entry s = ulist[s] << QB | (bit qi: query qi of the tile selected slot s)."""
    pid = tl.program_id(0)
    s = tl.arange(0, E)
    n = tl.load(ucnt_ptr + pid)
    blk = tl.load(ulist_ptr + pid * E + s)
    mask = tl.zeros([E], dtype=tl.int32)
    for qi in tl.static_range(QT):
        word = tl.load(bits_ptr + (pid * QT + qi) * W + (s >> 5))
        mask |= ((word >> (s & 31)) & 1) << qi
    tl.store(work_ptr + pid * E + s, tl.where(s < n, (blk << QB) | mask, -1))


def worklist_from_union_plan(plan: tuple[torch.Tensor, ...], queries: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(work, count) of the module docstring from `union.union_plan(block_idx, queries)`'s
    (ulist int32 [B, G, nT, E], ucnt int32 [B, G, nT], bits int32 [B, G, nT * queries, W], ...):
    work int32 [B, G, nT, E] (cap = E, the plan's bound), count = ucnt."""
    ulist, ucnt, bits = plan[0], plan[1], plan[2]
    if isinstance(queries, bool) or not isinstance(queries, int) or not 1 <= queries <= QBITS:
        raise ValueError(f"queries must be an integer in [1, {QBITS}], got {queries!r}")
    if ulist.dim() != 4 or ucnt.shape != ulist.shape[:3] or bits.dim() != 4 or \
            bits.shape[:3] != (*ulist.shape[:2], ulist.shape[2] * queries):
        raise ValueError(f"plan must be (ulist [B, G, nT, E], ucnt [B, G, nT], bits [B, G, nT * queries, W], ...) "
                         f"with queries={queries}, got {tuple(ulist.shape)}, {tuple(ucnt.shape)}, {tuple(bits.shape)}")
    B, G, nT, E = ulist.shape
    W = bits.shape[3]
    if E > 32 * W:
        raise ValueError(f"plan's bits hold {32 * W} slots per row, its ulist {E}")
    work = torch.empty_like(ulist)
    if B * G * nT:
        _entries_kernel[(B * G * nT,)](ulist.contiguous(), ucnt.contiguous(), bits.contiguous(), work, E=E, W=W,
                                       QT=queries, QB=QBITS, num_warps=1)
    return work, ucnt
