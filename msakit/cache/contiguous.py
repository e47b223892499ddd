"""`KVCache`: the contiguous cache of the reference generation loop (all rows at one length).

Per layer K and V [B, max_len, G, D] and, for MSA layers, the index keys [B, max_len, Di],
allocated at the first write (dtype / device of k).  A forward over Tq new tokens writes
positions [length, length + Tq) and attends the first length + Tq (see `KVCache.attend`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from msakit.cache.base import KVCacheProtocol
from msakit.nn.attention import MSAConfig, msa_attend

__all__ = ["KVCache"]


class KVCache(KVCacheProtocol):
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

    def positions(self, batch: int, num_new: int, device: torch.device) -> torch.Tensor:
        if self.length + num_new > self.max_len:
            raise ValueError(f"KV cache overflow: {self.length + num_new} positions > max_len={self.max_len}")
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

    def attend(self, layer: int, q: torch.Tensor, q_idx: torch.Tensor | None, sel: MSAConfig,
               mode: str) -> torch.Tensor:
        """The Tq new queries over the first length + Tq positions.  The prompt (length 0) takes
        the training path; later steps `msa_attend`'s path for queries at the last positions."""
        Tq = q.shape[1]
        Tk = self.length + Tq
        k, v = self.k[layer][:, :Tk], self.v[layer][:, :Tk]
        k_idx = None if self.k_idx[layer] is None else self.k_idx[layer][:, :Tk]
        return msa_attend(q, k, v, q_idx, k_idx, sel, mode=mode, compute_kl=False)[0]

    def advance(self, num_new: int) -> None:
        self.length += num_new

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
