"""Rows of their own lengths in pages (speculative decoding: rows accept different numbers of
drafts), with the lengths on the device so that a forward reads no host value.

`PagedRows` keeps the rows in a `PagedKVCache` with every page reserved up front (the page table
never changes).  Its owner places each forward (`place(lengths, num_keys)`); a forward of nq <=
`MAX_NQ` new tokens per row is a `PagedStep` (its views `PagedKeys`: msa_decode for sparse-mode MSA
layers, one plan per nq for the full width), longer ones (the prompt's chunks) view the rows'
pages gathered, the queries at their positions (`HeldKeys`).
"""

from __future__ import annotations

import torch

from msakit.cache.base import HeldKeys, KVCacheProtocol, PagedKeys
from msakit.cache.paged import PagedKVCache, PagedStep, gather_pages
from msakit.ops.decode import plan_decode
from msakit.ops.dispatch import use_triton
from msakit.ops.index_topk import Selection

__all__ = ["PagedRows"]


class PagedRows(KVCacheProtocol):
    """`batch` rows of up to `max_len` tokens in `cache` (a fresh PagedKVCache with at least
    batch * ceil(max_len / page_size) pages), every page reserved at construction.

    Each forward is placed first (`place(lengths, num_keys)`, int64 [B] on the device: row b's
    new tokens go to positions lengths[b] + i); slots and seq_lens (lengths + nq) are computed on
    the device, so no host value depends on the lengths and the forward can be captured as a CUDA
    graph when nq <= MAX_NQ (`PagedStep`; plans per nq for the full width, made on first use
    outside capture: call `plan(nq)` before capturing).  Keys past a row's length are stale and
    masked; rolling back is the owner's smaller lengths at the next `place`."""

    MAX_NQ = 8

    def __init__(self, cache: PagedKVCache, batch: int, max_len: int, *, backend: str = "auto",
                 sel: Selection | None = None, num_heads: int | None = None) -> None:
        if cache.sequences():
            raise ValueError("PagedRows needs a PagedKVCache without sequences")
        self.cache, self.batch, self.max_len, self.backend = cache, int(batch), int(max_len), backend
        self.sel, self.num_heads = sel, num_heads
        self.seq_ids = [cache.allocate() for _ in range(batch)]
        cache.append_slots_host(self.seq_ids, max_len)  # every page reserved: the table never changes
        self.page_table = cache.decode_metadata(self.seq_ids).page_table  # int32 [B, W] on the device
        self.width = self.page_table.shape[1]
        self._plans: dict[int, object] = {}
        self._start: torch.Tensor | None = None
        self._keys = self.max_len
        self.step: PagedStep | None = None  # the current forward's step (set by begin)

    def sparse_triton(self) -> bool:
        """msa_decode runs its Triton kernels (and takes a plan) for this cache's device."""
        return bool(self.cache.index_layers) and use_triton("msa_decode", self.backend, self.cache.device)

    def plan(self, nq: int):
        """The msa_decode plan of nq new tokens per row over the full width (None: no Triton)."""
        if nq not in self._plans:
            p = None
            if self.sparse_triton() and self.sel is not None:
                s = self.sel
                p = plan_decode(self.cache.layer(self.cache.index_layers[0]), batch=self.batch, nq=nq,
                                num_heads=self.num_heads, width=self.width, topk=s.topk, local_blocks=s.local_blocks,
                                init_blocks=s.init_blocks)
            self._plans[nq] = p
        return self._plans[nq]

    def place(self, lengths: torch.Tensor, num_keys: int | None = None) -> None:
        """The next forward writes row b's new tokens at lengths[b] + i; a long one (more than
        MAX_NQ new tokens per row) views the first num_keys positions (default all)."""
        if lengths.shape != (self.batch,):
            raise ValueError(f"lengths must have shape [{self.batch}], got {tuple(lengths.shape)}")
        self._start = lengths
        self._keys = self.max_len if num_keys is None else min(int(num_keys), self.max_len)

    def begin(self, batch: int, num_new: int, device: torch.device) -> torch.Tensor:
        if self._start is None:
            raise ValueError("PagedRows: call place(lengths) before a forward")
        if batch != self.batch:
            raise ValueError(f"PagedRows holds {self.batch} rows, got {batch}")
        ps = self.cache.page_size
        pos = self._start.view(batch, 1) + torch.arange(num_new, device=device).view(1, num_new)
        slots = (self.page_table.long().gather(1, pos // ps) * ps + pos % ps).reshape(-1)
        seq_lens = (self._start + num_new).to(torch.int32)
        plan = self.plan(num_new) if num_new <= self.MAX_NQ else None
        self.step = PagedStep(self.cache, pos, slots, self.page_table, seq_lens, plan, self.backend)
        return pos

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, k_idx: torch.Tensor | None) -> None:
        self.step.write(layer, k, v, k_idx)

    def view(self, layer: int) -> PagedKeys | HeldKeys:
        st = self.step
        if st.pos.shape[1] <= self.MAX_NQ:
            return st.view(layer)
        # a long forward (the prompt's chunks): the rows' pages gathered, the queries at their positions
        pools = self.cache.layer(layer)
        table = self.page_table[:, : -(-self._keys // self.cache.page_size)].long()
        k = gather_pages(pools.k, pools.k_scale, table).transpose(1, 2)
        v = gather_pages(pools.v, pools.v_scale, table).transpose(1, 2)
        k_idx = None
        if pools.k_idx is not None:
            k_idx = gather_pages(pools.k_idx.unsqueeze(1), None if pools.k_idx_scale is None
                                 else pools.k_idx_scale.unsqueeze(1), table).squeeze(1)
        return HeldKeys(k, v, k_idx, st.pos)

    def end(self) -> None:
        pass
