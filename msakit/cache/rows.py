"""Caches whose rows have their own lengths (speculative decoding: rows accept different numbers
of drafts), with the lengths on the device so that a forward reads no host value.

`masked_attention` is the attention of new queries at per-row positions over contiguous keys,
masked by position (MSA: `select_blocks_mask`, the `index_topk` reference per row).  `PagedRows`
keeps the rows in a `PagedKVCache` with every page reserved up front (the page table never
changes): a forward of nq <= `MAX_NQ` new tokens per row is a `PagedStep` (msa_decode for
sparse-mode MSA layers, one plan per nq for the full width), longer ones (the prompt's chunks)
attend the gathered pages with `masked_attention`.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F

from msakit.cache.base import KVCacheProtocol
from msakit.cache.paged import PagedKVCache, PagedStep, gather_pages

__all__ = ["select_blocks_mask", "masked_attention", "PagedRows"]


def select_blocks_mask(q_idx: torch.Tensor, k_idx: torch.Tensor, pos: torch.Tensor, causal: torch.Tensor,
                       sel) -> torch.Tensor:
    """`index_topk_reference` for queries at per-row positions pos [B, Tq] over keys [B, Lk]
    (q_idx [B, Tq, G, Di], k_idx [B, Lk, Di], causal bool [B, Tq, Lk]) -> bool [B, G, Tq, Lk],
    True on the tokens j <= pos of the selected blocks."""
    B, Tq, G, _ = q_idx.shape
    Lk = k_idx.shape[1]
    bs = sel.block_size
    cdt = torch.float64 if q_idx.dtype == torch.float64 else torch.float32
    s = torch.einsum("bigd,bjd->bgij", q_idx.to(cdt), k_idx.to(cdt))
    s = s.masked_fill(~causal.unsqueeze(1), float("-inf"))
    nb = (Lk + bs - 1) // bs
    if nb * bs > Lk:
        s = F.pad(s, (0, nb * bs - Lk), value=float("-inf"))
    M = s.view(B, G, Tq, nb, bs).amax(dim=-1)  # [B, G, Tq, nb]
    own = (pos // bs).view(B, 1, Tq, 1)
    blocks = torch.arange(nb, device=q_idx.device).view(1, 1, 1, nb)
    forced = ((blocks <= own) & (blocks > own - sel.local_blocks)) | ((blocks < sel.init_blocks) & (blocks <= own))
    M = M.masked_fill(forced, float("inf")).masked_fill(blocks > own, float("-inf"))
    kk = min(sel.topk, nb)
    top = M.topk(kk, dim=-1)
    ids = torch.where(top.values > float("-inf"), top.indices, torch.full_like(top.indices, nb))
    chosen = torch.zeros(B, G, Tq, nb + 1, dtype=torch.bool, device=q_idx.device).scatter_(-1, ids, True)[..., :nb]
    tok = chosen.repeat_interleave(bs, dim=-1)[..., :Lk]
    return tok & causal.unsqueeze(1)


def masked_attention(q: torch.Tensor, q_idx: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor,
                     k_idx: torch.Tensor | None, pos: torch.Tensor, causal: torch.Tensor, sel, mode: str) -> torch.Tensor:
    """Queries q [B, Tq, Hq, D] at positions pos [B, Tq] over keys k, v [B, G, Lk, D] (heads
    first) and index keys k_idx [B, Lk, Di], causal bool [B, Tq, Lk] (key j <= the query's
    position): MSA in sparse mode with q_idx, else full attention -> o [B, Tq, Hq, D]."""
    rep = q.shape[2] // k.shape[1]
    if mode == "sparse" and q_idx is not None:
        mask = select_blocks_mask(q_idx, k_idx, pos, causal, sel).repeat_interleave(rep, dim=1)
    else:
        mask = causal.unsqueeze(1)
    qh = q.transpose(1, 2)
    kh = k.repeat_interleave(rep, dim=1).to(qh.dtype)
    vh = v.repeat_interleave(rep, dim=1).to(qh.dtype)
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=1.0 / math.sqrt(q.shape[-1]))
    return o.transpose(1, 2)


class PagedRows(KVCacheProtocol):
    """`batch` rows of up to `max_len` tokens in `cache` (a fresh PagedKVCache with at least
    batch * ceil(max_len / page_size) pages), every page reserved at construction.

    A forward starts with `begin(lengths, num_keys)` (int64 [B] on the device: row b's new tokens
    go to positions lengths[b] + i); slots and seq_lens (lengths + nq) are computed on the device, so
    no host value depends on the lengths and the forward can be captured as a CUDA graph when
    nq <= MAX_NQ (`PagedStep`; plans per nq for the full width, made on first use outside
    capture: call `plan(nq)` before capturing).  Keys past a row's length are stale and masked;
    rolling back is the caller's smaller lengths."""

    MAX_NQ = 8

    def __init__(self, cache: PagedKVCache, batch: int, max_len: int, *, backend: str = "auto",
                 sel=None, num_heads: int | None = None) -> None:
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
        self.step: PagedStep | None = None  # the current forward's step (set by positions)

    def sparse_triton(self) -> bool:
        """msa_decode runs its Triton kernels (and takes a plan) for this cache's device."""
        from msakit.ops.dispatch import use_triton

        return bool(self.cache.index_layers) and use_triton("msa_decode", self.backend, self.cache.device)

    def plan(self, nq: int):
        """The msa_decode plan of nq new tokens per row over the full width (None: no Triton)."""
        if nq not in self._plans:
            p = None
            if self.sparse_triton() and self.sel is not None:
                from msakit.ops.decode import plan_decode

                s = self.sel
                p = plan_decode(self.cache.layer(self.cache.index_layers[0]), batch=self.batch, nq=nq,
                                num_heads=self.num_heads, width=self.width, topk=s.topk, local_blocks=s.local_blocks,
                                init_blocks=s.init_blocks)
            self._plans[nq] = p
        return self._plans[nq]

    def begin(self, lengths: torch.Tensor, num_keys: int | None = None) -> None:
        """The next forward writes row b's new tokens at lengths[b] + i; a long one (more than
        MAX_NQ new tokens per row) attends the first num_keys positions (default all)."""
        if lengths.shape != (self.batch,):
            raise ValueError(f"lengths must have shape [{self.batch}], got {tuple(lengths.shape)}")
        self._start = lengths
        self._keys = self.max_len if num_keys is None else min(int(num_keys), self.max_len)

    def positions(self, batch: int, num_new: int, device: torch.device) -> torch.Tensor:
        if self._start is None:
            raise ValueError("PagedRows: call begin(lengths) before a forward")
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

    def attend(self, layer: int, q: torch.Tensor, q_idx: torch.Tensor | None, sel, mode: str) -> torch.Tensor:
        nq = q.shape[1]
        if nq <= self.MAX_NQ:
            return self.step.attend(layer, q, q_idx, sel, mode)
        # a long forward (the prompt's chunks): the rows' pages gathered, masked by position
        st = self.step
        pools = self.cache.layer(layer)
        table = self.page_table[:, : -(-self._keys // self.cache.page_size)].long()
        k = gather_pages(pools.k, pools.k_scale, table)
        v = gather_pages(pools.v, pools.v_scale, table)
        k_idx = None
        if pools.k_idx is not None:
            k_idx = gather_pages(pools.k_idx.unsqueeze(1), None if pools.k_idx_scale is None
                                 else pools.k_idx_scale.unsqueeze(1), table).squeeze(1)
        causal = torch.arange(k.shape[2], device=q.device).view(1, 1, -1) <= st.pos.unsqueeze(-1)
        return masked_attention(q, q_idx, k, v, k_idx, st.pos, causal, sel, mode)

    def truncate(self, lengths: int | Sequence[int]) -> None:
        raise ValueError("PagedRows keeps no lengths of its own: pass the kept lengths to the next begin()")
