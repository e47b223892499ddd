"""`KVCacheProtocol`: what a layer's attention asks of a cache during a forward over new tokens.

A model forward with a cache (`M3ForCausalLM.forward(input_ids, cache=cache)`) runs

    positions = cache.positions(B, Tq, device)             # where the Tq new tokens of each row go
    for each layer l:  q, k, v, q_idx, k_idx = project(...)
                       cache.write(l, k, v, k_idx)         # the new positions' keys, values, index keys
                       o = cache.attend(l, q, q_idx, sel, mode)   # dense or MSA over what it holds
    cache.advance(Tq)                                       # the forward is done

and rollback (speculative decoding) is `cache.truncate(lengths)`.  The layer code is the same
for every cache; what differs (contiguous buffers, pages + `msa_decode`, per-row lengths with
position masks) lives in the implementations: `msakit.cache.KVCache` (contiguous),
`msakit.cache.PagedStep` (one step over a `PagedKVCache`) and the speculative `SpecCache`.

Tensor layouts: k, v [B, Tq, G, D]; k_idx [B, Tq, Di] (None for layers without an index branch);
q [B, Tq, Hq, D]; q_idx [B, Tq, G, Di] (or None); the output o [B, Tq, Hq, D] in q's dtype.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from msakit.nn.attention import MSAConfig

__all__ = ["KVCacheProtocol"]


class KVCacheProtocol(abc.ABC):
    """The cache interface of the model forward (see the module docstring)."""

    @abc.abstractmethod
    def positions(self, batch: int, num_new: int, device: torch.device) -> torch.Tensor:
        """Positions int64 [batch, num_new] of the new tokens of this forward."""

    @abc.abstractmethod
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, k_idx: torch.Tensor | None) -> None:
        """Store layer `layer`'s keys / values [B, Tq, G, D] and index keys [B, Tq, Di] (or None)
        at the new positions."""

    @abc.abstractmethod
    def attend(self, layer: int, q: torch.Tensor, q_idx: torch.Tensor | None, sel: "MSAConfig",
               mode: str) -> torch.Tensor:
        """Attention of the new positions' queries q [B, Tq, Hq, D] over every position layer
        `layer` holds up to each query's own (causal): MSA (the indexer's top-k blocks over all
        held index keys, then those blocks only) when mode == "sparse" and q_idx is given, full
        attention otherwise -> o [B, Tq, Hq, D]."""

    def advance(self, num_new: int) -> None:
        """The forward over `num_new` new tokens is done.  Caches whose lengths their owner sets
        (paged steps, speculative rows) do nothing here: a forward captured as a CUDA graph runs
        this Python once, at capture, so a captured cache keeps no host state in it."""

    @abc.abstractmethod
    def truncate(self, lengths: int | Sequence[int]) -> None:
        """Keep the first lengths (one for all rows, or per row) positions: rollback."""
