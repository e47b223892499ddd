"""`SpecCache`: the speculative rounds' caches, with one length per row.

The target's K, V [B, max_len, G, D] (and index keys [B, max_len, Di] of MSA layers) per layer,
behind `msakit.cache.KVCacheProtocol`, and the drafter's context K, V per draft layer.  Rows
advance by different amounts (accepted drafts), so attention masks by position: key j is
visible to a query at position p iff j <= p (the views are `HeldKeys` with the queries'
positions, or the paged rows' views).  Rolling back is setting a smaller length.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from msakit.cache import HeldKeys, KVCacheProtocol, PagedKeys, PagedKVCache, PagedRows, RollbackCache

__all__ = ["SpecCache", "positions_check", "SPEC_CACHE_KINDS"]

SPEC_CACHE_KINDS = ("auto", "contiguous", "paged")


class SpecCache(KVCacheProtocol, RollbackCache):
    """Contiguous per-row-length caches: the target's K, V [B, max_len, G, D] (and index keys
    [B, max_len, Di] of MSA layers) per layer, and the drafter's context K, V per draft layer.

    `lengths` (int64 [B], on the device) and `host_lengths` (list) hold how many positions of each
    row are valid; positions at or beyond a row's length hold stale keys that masks ignore.
    Rolling back is setting a smaller length (`rollback` / `truncate`).

    A target forward over it (`KVCacheProtocol`) is placed first with `place(lengths, Lk)`: the new
    tokens of row b go to positions lengths[b] + i (lengths a device tensor: no host read) and the
    views cover the first Lk positions, the queries at their positions.

    With `rows` (a `msakit.cache.rows.PagedRows`, see `SpecCache.for_target`) the target's keys
    live in pages instead (k, v, k_idx stay None) and forwards of up to 8 new tokens per row attend
    through msa_decode; the drafter's context stays contiguous."""

    def __init__(self, num_target_layers: int, num_draft_layers: int, batch: int, max_len: int,
                 device: torch.device, rows: PagedRows | None = None) -> None:
        self.max_len = max_len
        self.batch = batch
        self.device = device
        self.k: list[torch.Tensor | None] = [None] * num_target_layers
        self.v: list[torch.Tensor | None] = [None] * num_target_layers
        self.k_idx: list[torch.Tensor | None] = [None] * num_target_layers
        self.dk: list[torch.Tensor | None] = [None] * num_draft_layers
        self.dv: list[torch.Tensor | None] = [None] * num_draft_layers
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.host_lengths = [0] * batch
        self.written = [0] * batch  # per row: positions written by the last forward (valid or pending)
        self._start: torch.Tensor | None = None  # the current forward's lengths [B] and key count
        self._keys = 0
        self.rows = rows
        if rows is not None and (rows.batch != batch or rows.max_len < max_len):
            raise ValueError(f"rows hold {rows.batch} x {rows.max_len} positions, need {batch} x {max_len}")

    @classmethod
    def for_target(cls, target: Any, num_draft_layers: int, batch: int, max_len: int, device: torch.device, *,
                   paged: bool = False, kv_dtype: torch.dtype | None = None, backend: str = "auto") -> "SpecCache":
        """The cache of a speculative run of `target` (an M3ForCausalLM): contiguous, or with the
        target's keys in a PagedKVCache (`paged`; pages of the selection block, pools in
        kv_dtype, default the target's dtype; msa_decode's `backend`)."""
        L = target.config.num_hidden_layers
        if not paged:
            return cls(L, num_draft_layers, batch, max_len, device)
        msa = [l.self_attn for l in target.model.layers]
        cfg = msa[0].cfg
        index_layers = [i for i, a in enumerate(msa) if a.index_branch]
        dt = kv_dtype or (target.dtype if target.dtype in (torch.float32, torch.float16, torch.bfloat16)
                          else torch.bfloat16)
        ps = cfg.selection.block_size
        pages = batch * (-(-max_len // ps))
        pool = PagedKVCache(L, pages, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                            index_dim=cfg.index_dim if index_layers else 0, page_size=ps, kv_dtype=dt, index_dtype=dt,
                            index_layers=index_layers, device=device)
        rows = PagedRows(pool, batch, max_len, backend=backend, sel=cfg.selection, num_heads=cfg.num_heads)
        return cls(L, num_draft_layers, batch, max_len, device, rows=rows)

    # ------------------------------------------------------------------ buffers
    @staticmethod
    def _write(buf: torch.Tensor | None, x: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, max_len: int):
        if buf is None:
            buf = x.new_zeros((x.shape[0], max_len) + tuple(x.shape[2:]))  # zeros: masked slots stay finite
        buf[rows, pos] = x.to(buf.dtype)
        return buf

    def write_target(self, layer: int, k, v, k_idx, rows, pos) -> None:
        self.k[layer] = self._write(self.k[layer], k, rows, pos, self.max_len)
        self.v[layer] = self._write(self.v[layer], v, rows, pos, self.max_len)
        if k_idx is not None:
            self.k_idx[layer] = self._write(self.k_idx[layer], k_idx, rows, pos, self.max_len)

    def write_draft(self, layer: int, k, v, rows, pos) -> None:
        self.dk[layer] = self._write(self.dk[layer], k, rows, pos, self.max_len)
        self.dv[layer] = self._write(self.dv[layer], v, rows, pos, self.max_len)

    # ------------------------------------------------------------------ the protocol
    def place(self, lengths: torch.Tensor, num_keys: int) -> None:
        """The next forward writes row b's new tokens at lengths[b] + i (int64 [B] on the device)
        and views the first num_keys positions."""
        if lengths.shape != (self.batch,):
            raise ValueError(f"lengths must have shape [{self.batch}], got {tuple(lengths.shape)}")
        if not 0 < num_keys <= self.max_len:
            raise ValueError(f"num_keys must lie in [1, {self.max_len}], got {num_keys}")
        self._start, self._keys = lengths, int(num_keys)
        if self.rows is not None:
            self.rows.place(lengths, num_keys)

    def begin(self, batch: int, num_new: int, device: torch.device) -> torch.Tensor:
        if self.rows is not None:
            return self.rows.begin(batch, num_new, device)
        if self._start is None:
            raise ValueError("SpecCache: call place(lengths, num_keys) before a forward")
        if batch != self.batch:
            raise ValueError(f"SpecCache holds {self.batch} rows, got {batch}")
        pos = self._start.view(batch, 1) + torch.arange(num_new, device=device).view(1, num_new)
        self._pos = pos
        self._rows = torch.arange(batch, device=device).view(batch, 1).expand(batch, num_new)
        return pos

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, k_idx: torch.Tensor | None) -> None:
        if self.rows is not None:
            return self.rows.write(layer, k, v, k_idx)
        self.write_target(layer, k, v, k_idx, self._rows, self._pos)

    def view(self, layer: int) -> HeldKeys | PagedKeys:
        if self.rows is not None:
            return self.rows.view(layer)
        Lk = self._keys
        ki = self.k_idx[layer]
        return HeldKeys(self.k[layer][:, :Lk], self.v[layer][:, :Lk], None if ki is None else ki[:, :Lk], self._pos)

    def end(self) -> None:
        pass

    def truncate(self, lengths: int | Sequence[int]) -> None:
        self.rollback([lengths] * self.batch if isinstance(lengths, int) else lengths)

    # ------------------------------------------------------------------ lengths
    def reset(self) -> None:
        """Every row empty (length 0); the buffers stay allocated."""
        self.set_lengths(torch.zeros(self.batch, dtype=torch.long, device=self.device), [0] * self.batch)
        self.written = [0] * self.batch

    def set_lengths(self, lengths: torch.Tensor, host: Sequence[int]) -> None:
        self.lengths = lengths
        self.host_lengths = [int(x) for x in host]
        self.written = [max(w, h) for w, h in zip(self.written, self.host_lengths)]

    def rollback(self, lengths: Sequence[int]) -> None:
        """Keep the first lengths[b] positions of each row: those before the last forward's and
        as many of its new ones as were accepted; the rest are dropped (no data moves)."""
        lengths = [int(n) for n in lengths]
        if len(lengths) != self.batch or any(n < 0 or n > w for n, w in zip(lengths, self.written)):
            raise ValueError(f"rollback lengths {lengths} must lie in [0, written {self.written}] per row")
        self.set_lengths(torch.as_tensor(lengths, dtype=torch.long, device=self.device), lengths)
        self.written = list(lengths)


def positions_check(cache: SpecCache, width: int) -> None:
    """ValueError when `width` more positions would run past the cache's max_len in some row."""
    if max(cache.host_lengths) + width > cache.max_len:
        raise ValueError(f"speculative cache overflow: {max(cache.host_lengths) + width} > {cache.max_len}")
