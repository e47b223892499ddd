"""Paged KV cache with MSA index keys (one object for all layers, shared page tables).

Layout (per layer l; every layer uses the same pages for the same tokens, so one page table
serves the whole model):

    k[l], v[l]        [num_pages, G, page_size, D]   kv_dtype: bf16 / fp16 / fp32, or fp8 e4m3 codes
    k_scale[l]        [num_pages, G, page_size]      float32 (fp8 K only)
    v_scale[l]        [num_pages, G, page_size]      float32 (fp8 V only)
    k_idx[l]          [num_pages, page_size, Di]     index_dtype: bf16 / fp16 / fp32, or fp8 e4m3 codes
    k_idx_scale[l]    [num_pages, page_size]         float32 (fp8 index keys only)

Token j of a sequence lives in page `pages[j // page_size]`, slot `j % page_size`.  A page is
one selection block of MSA (M3: page_size = block_size = 128).  `layer(l)` returns the pools of
layer l as a `msakit.ops.decode.PagedLayer` (views, no copies).

fp8 scales are per token and per head (K, V: one float32 per (page, head, slot); index keys:
one per (page, slot)): `x ~= codes.float() * scale`, scale = amax(|x| over the row of D (or Di)
values) / 448 (the largest e4m3 value), clamped to the smallest normal float32, so every token is
quantized once when it is written and never re-quantized when the page fills up.  The per-token
float32 scale costs 4 bytes per 128-byte fp8 row (3 %).  This is the same per-row rule as the
prefill fp8 scoring path (`msakit.ops.quantize_fp8`).

Host-side bookkeeping (Python lists, never a GPU sync):
- a free list of pages and a refcount per page;
- per sequence: its page list and its length.
`fork(seq)` shares every page of `seq` (refcount + 1).  Full pages are never written again; the
partially filled last page is copied (all layers, K / V / index keys / scales) by whichever
sequence appends to it first while it is shared (copy-on-write), so a fork costs nothing until
one side appends.  `free(seq)` drops its references; pages at refcount 0 return to the free list.

Writing: `append_slots(seq_ids, counts)` reserves positions (allocating pages, doing the
copy-on-write) and returns the flat slot ids (`page * page_size + offset`, int64 on the cache's
device); `write(layer, slots, k, v, k_idx)` scatters one layer's new tokens there (no host
sync: capturable).  `prefill(seq, k, v, k_idx)` writes a prompt for all layers at once with
whole-page copies; `append(seq, k, v, k_idx)` appends a few tokens for all layers.

Decoding: `decode_metadata(seq_ids, width=None, out=None)` builds the int32 page table
[batch, width] and seq_lens [batch] on the device (once per forward; identical for all layers)
plus their host copies for validation; `None` in seq_ids is a padding slot (length 0).  Pass
`out=` (a previous DecodeMetadata) to refill static buffers in place for CUDA-graph replays.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from msakit.cache.base import DeferredPagedKeys, KVCacheProtocol, PagedKeys
from msakit.ops.decode.reference import PagedLayer, gather_sequence
from msakit.ops.fp8 import FP8, quantize_fp8

KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32, FP8)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as their uint8 bytes (several indexing kernels lack fp8 support)."""
    return t.view(torch.uint8) if t.dtype == FP8 else t


@dataclass
class DecodeMetadata:
    """Page table and lengths of a decode batch: device tensors for the kernels, host copies
    for validation (`msa_decode` / `plan_decode` check them without touching the GPU)."""

    page_table: torch.Tensor  # int32 [B, width] on the cache's device (0 beyond a sequence's pages)
    seq_lens: torch.Tensor  # int32 [B] on the cache's device
    page_table_host: torch.Tensor  # int32 [B, width] on the CPU
    seq_lens_host: list[int]

    @property
    def batch(self) -> int:
        return self.page_table.shape[0]

    @property
    def width(self) -> int:
        return self.page_table.shape[1]


class _Seq:
    __slots__ = ("pages", "length")

    def __init__(self, pages: list[int], length: int) -> None:
        self.pages = pages
        self.length = length


class PagedKVCache:
    """K / V pools for `num_layers` layers plus index-key pools for the MSA layers, one page
    table for all.  See the module docstring for the layout and the API."""

    def __init__(self, num_layers: int, num_pages: int, *, num_kv_heads: int, head_dim: int, index_dim: int = 0,
                 page_size: int = 128, kv_dtype: torch.dtype = torch.bfloat16,
                 index_dtype: torch.dtype = torch.bfloat16, index_layers=None, device=None) -> None:
        for name, val in (("num_layers", num_layers), ("num_pages", num_pages), ("num_kv_heads", num_kv_heads),
                          ("head_dim", head_dim), ("page_size", page_size)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{name} must be a positive integer, got {val!r}")
        if isinstance(index_dim, bool) or not isinstance(index_dim, int) or index_dim < 0:
            raise ValueError(f"index_dim must be an integer >= 0, got {index_dim!r}")
        if kv_dtype not in KV_DTYPES or index_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype and index_dtype must be one of {KV_DTYPES}, got {kv_dtype}, {index_dtype}")
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.num_kv_heads, self.head_dim, self.index_dim = num_kv_heads, head_dim, index_dim
        self.kv_dtype, self.index_dtype = kv_dtype, index_dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if index_dim == 0:
            layers = ()
        elif index_layers is None:
            layers = tuple(range(num_layers))
        else:
            layers = tuple(sorted(set(int(x) for x in index_layers)))
            if any(x < 0 or x >= num_layers for x in layers):
                raise ValueError(f"index_layers must lie in [0, {num_layers}), got {index_layers}")
        self.index_layers = layers
        self._islot = {l: i for i, l in enumerate(layers)}
        dev, P, G, ps, D = self.device, num_pages, num_kv_heads, page_size, head_dim
        # zero-filled: slots past a sequence's end hold finite values (the kernels also mask them)
        self.k = torch.zeros(num_layers, P, G, ps, D, dtype=kv_dtype, device=dev)
        self.v = torch.zeros(num_layers, P, G, ps, D, dtype=kv_dtype, device=dev)
        self.k_scale = self.v_scale = None
        if kv_dtype == FP8:
            self.k_scale = torch.ones(num_layers, P, G, ps, dtype=torch.float32, device=dev)
            self.v_scale = torch.ones(num_layers, P, G, ps, dtype=torch.float32, device=dev)
        self.k_idx = self.k_idx_scale = None
        if layers:
            self.k_idx = torch.zeros(len(layers), P, ps, index_dim, dtype=index_dtype, device=dev)
            if index_dtype == FP8:
                self.k_idx_scale = torch.ones(len(layers), P, ps, dtype=torch.float32, device=dev)
        self._free: list[int] = list(range(P - 1, -1, -1))  # pop() hands out page 0 first
        self._ref: list[int] = [0] * P
        self._seqs: dict[int, _Seq] = {}
        self._next_id = 0

    # ------------------------------------------------------------------ views
    def layer(self, l: int) -> PagedLayer:
        """The pools of layer l (views)."""
        if not 0 <= l < self.num_layers:
            raise ValueError(f"layer must lie in [0, {self.num_layers}), got {l}")
        i = self._islot.get(l)
        return PagedLayer(
            k=self.k[l],
            v=self.v[l],
            k_idx=None if i is None else self.k_idx[i],
            k_scale=None if self.k_scale is None else self.k_scale[l],
            v_scale=None if self.v_scale is None else self.v_scale[l],
            k_idx_scale=None if (i is None or self.k_idx_scale is None) else self.k_idx_scale[i],
        )

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def refcount(self, page: int) -> int:
        return self._ref[page]

    def length(self, seq_id: int) -> int:
        return self._seq(seq_id).length

    def pages(self, seq_id: int) -> list[int]:
        return list(self._seq(seq_id).pages)

    def sequences(self) -> list[int]:
        return list(self._seqs)

    def _seq(self, seq_id: int) -> _Seq:
        s = self._seqs.get(seq_id)
        if s is None:
            raise ValueError(f"unknown sequence id {seq_id!r}")
        return s

    # ------------------------------------------------------------------ lifetime
    def allocate(self) -> int:
        """A new empty sequence; pages come with its first append."""
        sid = self._next_id
        self._next_id += 1
        self._seqs[sid] = _Seq([], 0)
        return sid

    def fork(self, seq_id: int) -> int:
        """A new sequence sharing all of seq_id's tokens (pages refcounted, copy-on-write)."""
        src = self._seq(seq_id)
        sid = self._next_id
        self._next_id += 1
        for p in src.pages:
            self._ref[p] += 1
        self._seqs[sid] = _Seq(list(src.pages), src.length)
        return sid

    def free(self, seq_id: int) -> None:
        s = self._seq(seq_id)
        del self._seqs[seq_id]
        for p in s.pages:
            self._ref[p] -= 1
            if self._ref[p] == 0:
                self._free.append(p)

    def _take_page(self) -> int:
        p = self._free.pop()
        self._ref[p] = 1
        return p

    def _copy_page(self, src: int, dst: int) -> None:
        for t in (self.k, self.v, self.k_scale, self.v_scale, self.k_idx, self.k_idx_scale):
            if t is not None:
                _raw(t)[:, dst] = _raw(t)[:, src]

    # ------------------------------------------------------------------ writing
    def append_slots(self, seq_ids, counts) -> torch.Tensor:
        """Reserve `counts[i]` new positions at the end of sequence seq_ids[i] (an int count is
        used for every sequence) and return their flat slots (int64 [sum(counts)] on the cache's
        device, sequence by sequence).  Allocates pages and copies a shared partial last page
        (copy-on-write) first; raises ValueError, changing nothing, when pages run out."""
        return torch.tensor(self.append_slots_host(seq_ids, counts), dtype=torch.int64, device=self.device)

    def append_slots_host(self, seq_ids, counts) -> list[int]:
        """`append_slots` returning the slots as a Python list (no device tensor: the caller
        stages them itself, e.g. into the static buffers of a CUDA-graph decode step)."""
        seq_ids = [seq_ids] if isinstance(seq_ids, int) else list(seq_ids)
        counts = [counts] * len(seq_ids) if isinstance(counts, int) else list(counts)
        if len(counts) != len(seq_ids):
            raise ValueError(f"counts has {len(counts)} entries for {len(seq_ids)} sequences")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("append_slots: a sequence id appears twice")
        ps = self.page_size
        need = 0
        for sid, n in zip(seq_ids, counts):
            s = self._seq(sid)
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"counts must be integers >= 0, got {n!r}")
            need += (s.length + n + ps - 1) // ps - len(s.pages)
            if n and s.length % ps and self._ref[s.pages[-1]] > 1:
                need += 1  # copy-on-write of the shared partial last page
        if need > len(self._free):
            raise ValueError(f"out of pages: {need} needed, {len(self._free)} free (of {self.num_pages})")
        slots: list[int] = []
        for sid, n in zip(seq_ids, counts):
            s = self._seq(sid)
            if n == 0:
                continue
            if s.length % ps and self._ref[s.pages[-1]] > 1:
                old = s.pages[-1]
                new = self._take_page()
                self._copy_page(old, new)
                self._ref[old] -= 1
                s.pages[-1] = new
            while len(s.pages) * ps < s.length + n:
                s.pages.append(self._take_page())
            for j in range(s.length, s.length + n):
                slots.append(s.pages[j // ps] * ps + j % ps)
            s.length += n
        return slots

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_idx: torch.Tensor | None = None) -> None:
        """Scatter one layer's tokens: k, v [N, G, D], k_idx [N, Di] into `slots` (int64 [N] on the
        cache's device, from append_slots).  fp8 pools quantize here (per-token scales)."""
        pools = self.layer(layer)
        G, D = self.num_kv_heads, self.head_dim
        N = slots.shape[0]
        if tuple(k.shape) != (N, G, D) or tuple(v.shape) != (N, G, D):
            raise ValueError(f"k and v must have shape [N={N}, G={G}, D={D}], got {tuple(k.shape)}, {tuple(v.shape)}")
        if (k_idx is None) != (pools.k_idx is None):
            raise ValueError(f"layer {layer} {'needs' if pools.k_idx is not None else 'has no'} index keys")
        if k_idx is not None and tuple(k_idx.shape) != (N, self.index_dim):
            raise ValueError(f"k_idx must have shape [N={N}, Di={self.index_dim}], got {tuple(k_idx.shape)}")
        page = torch.div(slots, self.page_size, rounding_mode="floor")
        off = slots % self.page_size
        for x, pool, sc in ((k, pools.k, pools.k_scale), (v, pools.v, pools.v_scale)):
            if pool.dtype == FP8:
                codes, s = quantize_fp8(x)
                _raw(pool)[page, :, off] = _raw(codes)
                sc[page, :, off] = s
            else:
                pool[page, :, off] = x.to(pool.dtype)
        if k_idx is not None:
            if pools.k_idx.dtype == FP8:
                codes, s = quantize_fp8(k_idx)
                _raw(pools.k_idx)[page, off] = _raw(codes)
                pools.k_idx_scale[page, off] = s
            else:
                pools.k_idx[page, off] = k_idx.to(pools.k_idx.dtype)

    def write_pages(self, layer: int, pages, k: torch.Tensor, v: torch.Tensor, k_idx: torch.Tensor | None = None) -> None:
        """Whole-page write of T tokens that start at a page boundary: k, v [T, G, D], k_idx
        [T, Di] go to pages[0], pages[1], ... (the tail of the last page is zero-filled)."""
        pools = self.layer(layer)
        ps = self.page_size
        T = k.shape[0]
        n = (T + ps - 1) // ps
        idx = torch.as_tensor(list(pages)[:n], dtype=torch.long).to(self.device)
        if idx.numel() != n:
            raise ValueError(f"write_pages: {T} tokens need {n} pages, got {idx.numel()}")
        pad = n * ps - T

        def paged(x):  # [T, ...] -> [n, ps, ...], zero-padded
            if pad:
                x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
            return x.reshape(n, ps, *x.shape[1:])

        for x, pool, sc in ((k, pools.k, pools.k_scale), (v, pools.v, pools.v_scale)):
            if pool.dtype == FP8:
                codes, s = quantize_fp8(paged(x.float()))  # [n, ps, G, D], [n, ps, G]
                _raw(pool).index_copy_(0, idx, _raw(codes.permute(0, 2, 1, 3).contiguous()))
                sc.index_copy_(0, idx, s.permute(0, 2, 1).contiguous())
            else:
                pool.index_copy_(0, idx, paged(x.to(pool.dtype)).permute(0, 2, 1, 3).contiguous())
        if k_idx is not None:
            if pools.k_idx is None:
                raise ValueError(f"layer {layer} has no index keys")
            if pools.k_idx.dtype == FP8:
                codes, s = quantize_fp8(paged(k_idx.float()))
                _raw(pools.k_idx).index_copy_(0, idx, _raw(codes.contiguous()))
                pools.k_idx_scale.index_copy_(0, idx, s.contiguous())
            else:
                pools.k_idx.index_copy_(0, idx, paged(k_idx.to(pools.k_idx.dtype)).contiguous())
        elif pools.k_idx is not None:
            raise ValueError(f"layer {layer} needs index keys")

    def _per_layer(self, x, name):
        if x is None:
            return [None] * self.num_layers
        if isinstance(x, (list, tuple)):
            if len(x) != self.num_layers:
                raise ValueError(f"{name} must hold one tensor per layer ({self.num_layers}), got {len(x)}")
            return list(x)
        return [x] if self.num_layers == 1 else list(x.unbind(0))

    def _index_list(self, k_idx):
        if k_idx is None:
            return [None] * self.num_layers
        if isinstance(k_idx, (list, tuple)):
            return list(k_idx)
        if self.num_layers == 1:
            return [k_idx]
        xs = list(k_idx.unbind(0))
        if len(xs) == len(self.index_layers) and len(xs) != self.num_layers:  # only the index layers given
            out = [None] * self.num_layers
            for l, x in zip(self.index_layers, xs):
                out[l] = x
            return out
        return xs

    def prefill(self, seq_id: int, k, v, k_idx=None) -> torch.Tensor:
        """Append T tokens to seq_id for every layer: k, v [num_layers, T, G, D] (or [T, G, D]
        with one layer, or lists per layer), k_idx [num_layers or len(index_layers), T, Di].
        Writes whole pages when the sequence ends on a page boundary (a fresh sequence does).
        Returns the slots."""
        ks, vs, kis = self._per_layer(k, "k"), self._per_layer(v, "v"), self._index_list(k_idx)
        start = self.length(seq_id)
        T = ks[0].shape[0]
        slots = self.append_slots([seq_id], [T])
        if start % self.page_size == 0:
            pages = self._seq(seq_id).pages[start // self.page_size:]
            for l in range(self.num_layers):
                self.write_pages(l, pages, ks[l], vs[l], kis[l] if l in self._islot else None)
        else:
            for l in range(self.num_layers):
                self.write(l, slots, ks[l], vs[l], kis[l] if l in self._islot else None)
        return slots

    def append(self, seq_id: int, k, v, k_idx=None) -> torch.Tensor:
        """Append t tokens (one or several) to seq_id for every layer (shapes as in prefill)."""
        ks, vs, kis = self._per_layer(k, "k"), self._per_layer(v, "v"), self._index_list(k_idx)
        slots = self.append_slots([seq_id], [ks[0].shape[0]])
        for l in range(self.num_layers):
            self.write(l, slots, ks[l], vs[l], kis[l] if l in self._islot else None)
        return slots

    def truncate(self, seq_id: int, length: int) -> None:
        """Keep the first `length` tokens of seq_id (rollback); pages past them are released."""
        s = self._seq(seq_id)
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= s.length:
            raise ValueError(f"length must be an integer in [0, {s.length}], got {length!r}")
        keep = -(-length // self.page_size)
        for p in s.pages[keep:]:
            self._ref[p] -= 1
            if self._ref[p] == 0:
                self._free.append(p)
        del s.pages[keep:]
        s.length = length

    # ------------------------------------------------------------------ reading
    def gather(self, layer: int, seq_id: int):
        """Contiguous (k [L, G, D], v [L, G, D], k_idx [L, Di] or None) of a sequence (fp8
        pools dequantized to float32)."""
        s = self._seq(seq_id)
        return gather_sequence(self.layer(layer), s.pages, s.length)

    def decode_metadata(self, seq_ids, *, width: int | None = None, out: DecodeMetadata | None = None) -> DecodeMetadata:
        """Page table int32 [B, width] and seq_lens int32 [B] of the sequences (None = padding
        slot of length 0), on the cache's device, plus host copies.  With `out`, its device
        tensors are refilled in place (static buffers for CUDA graphs; width = out.width)."""
        seqs = [None if sid is None else self._seq(sid) for sid in seq_ids]
        need = max([len(s.pages) for s in seqs if s is not None] + [1])
        if out is not None:
            width = out.width
            if out.batch != len(seqs):
                raise ValueError(f"out holds a batch of {out.batch}, got {len(seqs)} sequences")
        width = need if width is None else width
        if width < need:
            raise ValueError(f"width={width} is smaller than the longest page list ({need})")
        table = torch.zeros(len(seqs), width, dtype=torch.int32)
        lens = []
        for b, s in enumerate(seqs):
            if s is None:
                lens.append(0)
                continue
            if s.pages:
                table[b, : len(s.pages)] = torch.tensor(s.pages, dtype=torch.int32)
            lens.append(s.length)
        lens_t = torch.tensor(lens, dtype=torch.int32)
        if out is not None:
            out.page_table.copy_(table, non_blocking=False)
            out.seq_lens.copy_(lens_t)
            out.page_table_host = table
            out.seq_lens_host = lens
            return out
        return DecodeMetadata(table.to(self.device), lens_t.to(self.device), table, lens)


def gather_pages(pool: torch.Tensor, scale: torch.Tensor | None, table: torch.Tensor) -> torch.Tensor:
    """pool [P, G, ps, D] gathered through table int64 [B, W] -> [B, G, W * ps, D] (fp8 dequantized
    to float32 with its per-token scales [P, G, ps])."""
    B, W = table.shape
    if pool.dtype == FP8:
        x = pool.view(torch.uint8)[table].view(FP8).float() * scale[table].unsqueeze(-1)
    else:
        x = pool[table]  # [B, W, G, ps, D]
    G, ps, D = x.shape[2:]
    return x.permute(0, 2, 1, 3, 4).reshape(B, G, W * ps, D)


class PagedStep(KVCacheProtocol):
    """One forward of nq new tokens per row over a `PagedKVCache`, from device metadata only.

    positions int64 [B, nq]; slots int64 [B * nq] (reserved with `append_slots`, row by row);
    page_table int32 [B, W] and seq_lens int32 [B] (lengths including the new tokens); `plan`
    the `plan_decode` plan of this (batch, nq, width) or None (msa_decode then plans itself:
    eager use only).  Its views are `PagedKeys` (one shared memo per step).  No host sync and
    no Python value that depends on the lengths: a forward over a PagedStep built from static
    buffers can be captured as a CUDA graph.  The step is one forward: its owner reserved the
    slots, so `end` changes nothing."""

    def __init__(self, cache: PagedKVCache, positions: torch.Tensor, slots: torch.Tensor, page_table: torch.Tensor,
                 seq_lens: torch.Tensor, plan=None, backend: str = "auto") -> None:
        if positions.dim() != 2 or slots.shape != (positions.numel(),):
            raise ValueError(f"positions must be [B, nq] and slots [B * nq], got {tuple(positions.shape)}, "
                             f"{tuple(slots.shape)}")
        if page_table.dim() != 2 or page_table.shape[0] != positions.shape[0] or seq_lens.shape != (positions.shape[0],):
            raise ValueError(f"page_table must be [B, W] and seq_lens [B] for B={positions.shape[0]}, got "
                             f"{tuple(page_table.shape)}, {tuple(seq_lens.shape)}")
        self.cache, self.pos, self.slots = cache, positions, slots
        self.page_table, self.seq_lens, self.plan, self.backend = page_table, seq_lens, plan, backend
        self._memo: dict = {}

    def begin(self, batch: int, num_new: int, device: torch.device) -> torch.Tensor:
        if tuple(self.pos.shape) != (batch, num_new):
            raise ValueError(f"this step holds positions {tuple(self.pos.shape)}, got {batch} x {num_new} new tokens")
        return self.pos

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, k_idx: torch.Tensor | None) -> None:
        B, nq, G, D = k.shape
        ki = None if k_idx is None else k_idx.reshape(B * nq, -1)
        self.cache.write(layer, self.slots, k.reshape(B * nq, G, D), v.reshape(B * nq, G, D), ki)

    def view(self, layer: int) -> PagedKeys:
        return PagedKeys(self.cache.layer(layer), self.page_table, self.seq_lens, self.cache.page_size, self.plan,
                         self.backend, self._memo)

    def end(self) -> None:
        pass


class DeferredPagedStep(KVCacheProtocol):
    """A `PagedStep` whose writes happen inside the attention op (the compiled decode step:
    `msakit.nn.core.paged_step_attend` writes and attends in one op opaque to torch.compile,
    over the cache of `paged_step_context`).  `write` keeps the layer's new keys; `view` hands
    them over as `DeferredPagedKeys`.  Holds no cache."""

    def __init__(self, positions: torch.Tensor, slots: torch.Tensor, page_table: torch.Tensor,
                 seq_lens: torch.Tensor) -> None:
        self.pos, self.slots, self.page_table, self.seq_lens = positions, slots, page_table, seq_lens
        self._new: dict[int, tuple] = {}

    def begin(self, batch: int, num_new: int, device: torch.device) -> torch.Tensor:
        if tuple(self.pos.shape) != (batch, num_new):
            raise ValueError(f"this step holds positions {tuple(self.pos.shape)}, got {batch} x {num_new} new tokens")
        return self.pos

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, k_idx: torch.Tensor | None) -> None:
        self._new[layer] = (k, v, k_idx)

    def view(self, layer: int) -> DeferredPagedKeys:
        k, v, k_idx = self._new.pop(layer)
        return DeferredPagedKeys(layer, k, v, k_idx, self.slots, self.page_table, self.seq_lens)

    def end(self) -> None:
        pass
