"""KV-outer scheduling: invert a query->block selection into block->query tiles.

`block_idx` [B, G, T, K] says, per query, which key blocks it reads (query-outer view).  The
KV-outer kernels want the transpose: for each (batch, group, key block), the list of queries
that selected it, cut into tiles of at most `q_tile` queries (with Hq // G heads each, a tile is
q_tile * Hq // G rows of one tensor-core MMA against the block's keys).  Hot blocks (the local
block, an attention sink) simply produce more tiles, so the work list is balanced by
construction.

Everything stays on the device and no host synchronisation happens: the number of tiles is
bounded above (`max_tiles`), and tiles past the real count have `tile_count == 0`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class K2Q:
    """Block->query work list (all int32 tensors on block_idx's device).

    q_index [N]: query position i of each selected (b, g, i, block) entry, sorted by key;
    q_slot  [N]: the entry's slot in the row's de-duplicated, ascending selection (0..K-1), a
                 stable address for per-(query, slot) partial results;
    row_ptr [B*G*nblocks + 1]: CSR offsets (int32, int64 past 2^31 entries) of each key (b, g, block) into q_index;
    tile_key, tile_start, tile_count [max_tiles]: each tile's key, first entry and length
                 (0 for padding tiles past the real count).
    """

    q_index: torch.Tensor
    q_slot: torch.Tensor
    row_ptr: torch.Tensor
    tile_key: torch.Tensor
    tile_start: torch.Tensor
    tile_count: torch.Tensor
    nblocks: int
    q_tile: int

    @property
    def max_tiles(self) -> int:
        return self.tile_key.numel()


def canonical_selection(block_idx: torch.Tensor, T: int, block_size: int) -> torch.Tensor:
    """Each row of block_idx [B, G, T, K] as the set it means: valid ids ascending first, then -1.

    Repeated ids and blocks with no token j <= i (b * block_size > i) become -1.  int64.
    """
    s = block_idx.long().sort(dim=-1).values
    dup = torch.zeros_like(s, dtype=torch.bool)
    dup[..., 1:] = s[..., 1:] == s[..., :-1]
    rows = torch.arange(T, device=s.device).view(1, 1, T, 1)
    s = s.masked_fill(dup | (s * block_size > rows), -1)
    big = torch.iinfo(torch.int64).max
    out = torch.where(s < 0, torch.full_like(s, big), s).sort(dim=-1).values
    return out.masked_fill(out == big, -1)


def build_k2q(block_idx: torch.Tensor, block_size: int, q_tile: int) -> K2Q:
    """Invert block_idx [B, G, T, K] into block->query tiles of at most q_tile queries."""
    B, G, T, K = block_idx.shape
    dev = block_idx.device
    nb = (T + block_size - 1) // block_size
    nkeys = B * G * nb
    s = canonical_selection(block_idx, T, block_size)
    bg = torch.arange(B * G, device=dev).view(B, G, 1, 1)
    key = torch.where(s >= 0, bg * nb + s, torch.full_like(s, nkeys)).reshape(-1)
    return k2q_from_keys(key, nkeys, K, T, q_tile, nb)


def k2q_from_keys(key: torch.Tensor, nkeys: int, K: int, T: int, q_tile: int, nblocks: int) -> K2Q:
    """The work list of flat selection entries key [rows * K] (entry e = (row, slot) with row =
    e // K, query position row % T; the key id of its block in [0, nkeys), nkeys for an empty
    slot): entries stably sorted by key, CSR offsets and tiles of at most q_tile entries."""
    dev = key.device
    n = key.numel()
    order = torch.sort(key, stable=True).indices
    # scatter_add, not bincount: bincount syncs with the host on CUDA to size its output
    counts = torch.zeros(nkeys + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))[:nkeys]
    row_ptr = torch.zeros(nkeys + 1, dtype=torch.int64, device=dev)
    row_ptr[1:] = torch.cumsum(counts, 0)
    q_index = ((order // K) % T).to(torch.int32)
    q_slot = (order % K).to(torch.int32)
    tiles = (counts + q_tile - 1) // q_tile
    tile_end = torch.cumsum(tiles, 0)  # inclusive
    # int32 offsets while they fit, int64 beyond
    idx_dtype = torch.int32 if n < 2**31 else torch.int64
    max_tiles = (n + q_tile - 1) // q_tile + nkeys
    t = torch.arange(max_tiles, device=dev)
    tkey = torch.searchsorted(tile_end, t, right=True)
    real = tkey < nkeys
    tkey_c = tkey.clamp(max=nkeys - 1)
    first_tile = tile_end[tkey_c] - tiles[tkey_c]
    start = row_ptr[tkey_c] + (t - first_tile) * q_tile
    count = torch.minimum(row_ptr[tkey_c + 1] - start, torch.full_like(start, q_tile))
    count = torch.where(real, count, torch.zeros_like(count)).clamp(min=0)
    return K2Q(
        q_index=q_index,
        q_slot=q_slot,
        row_ptr=row_ptr.to(idx_dtype),
        tile_key=tkey_c.to(torch.int32),
        tile_start=start.to(idx_dtype),
        tile_count=count.to(torch.int32),
        nblocks=nblocks,
        q_tile=q_tile,
    )
