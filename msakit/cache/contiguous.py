"""`KVCache`: the contiguous cache of the reference generation loop (all rows at one length).

Per layer K and V [B, max_len, G, D] and, for MSA layers, the index keys [B, max_len, Di],
allocated at the first write (dtype / device of k).  A forward over Tq new tokens writes
positions [length, length + Tq); its view holds the first length + Tq, the queries at the end.
"""

from __future__ import annotations

from typing import Sequence

import torch

from msakit.cache.base import HeldKeys, KVCacheProtocol, RollbackCache

__all__ = ["KVCache"]


class KVCache(KVCacheProtocol, RollbackCache):
    """Contiguous per-layer cache for `num_layers` layers of up to `max_len` positions; every
    row has the same length (`length`)."""

    def __init__(self, num_layers: int, max_len: int) -> None:
        if num_layers < 1 or max_len < 1:
            raise ValueError(f"num_layers and max_len must be positive, got {num_layers}, {max_len}")
        self.num_layers = num_layers
        self.max_len = max_len
        self.length = 0
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.k_idx: list[torch.Tensor | None] = [None] * num_layers
        self._new = 0  # new tokens of the running forward

    def begin(self, batch: int, num_new: int, device: torch.device) -> torch.Tensor:
        if self.length + num_new > self.max_len:
            raise ValueError(f"KV cache overflow: {self.length + num_new} positions > max_len={self.max_len}")
        self._new = num_new
        return torch.arange(self.length, self.length + num_new, device=device).unsqueeze(0).expand(batch, num_new)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, k_idx: torch.Tensor | None) -> None:
        """Write positions [length, length + Tq) of `layer`."""
        B, Tq = k.shape[:2]
        s, e = self.length, self.length + Tq
        if e > self.max_len:
            raise ValueError(f"KV cache overflow: {e} positions > max_len={self.max_len}")
        if self.k[layer] is None:
            self.k[layer] = k.new_empty((B, self.max_len) + tuple(k.shape[2:]))
            self.v[layer] = v.new_empty((B, self.max_len) + tuple(v.shape[2:]))
            if k_idx is not None:
                self.k_idx[layer] = k_idx.new_empty((B, self.max_len) + tuple(k_idx.shape[2:]))
        self.k[layer][:, s:e] = k
        self.v[layer][:, s:e] = v
        if k_idx is not None:
            self.k_idx[layer][:, s:e] = k_idx

    def view(self, layer: int) -> HeldKeys:
        """The first length + Tq positions of `layer`, the Tq new queries at the end."""
        n = self.length + self._new
        k_idx = None if self.k_idx[layer] is None else self.k_idx[layer][:, :n]
        return HeldKeys(self.k[layer][:, :n], self.v[layer][:, :n], k_idx)

    def end(self) -> None:
        self.length += self._new
        self._new = 0

    def truncate(self, lengths: int | Sequence[int]) -> None:
        """Keep the first `lengths` positions (one length: all rows share it)."""
        if not isinstance(lengths, int):
            ls = {int(x) for x in lengths}
            if len(ls) != 1:
                raise ValueError(f"KVCache keeps one length for all rows, got {sorted(ls)}")
            lengths = ls.pop()
        if not 0 <= lengths <= self.length:
            raise ValueError(f"truncate length {lengths} must lie in [0, {self.length}]")
        self.length = lengths
