"""What a cache is: storage with one lifecycle, and the views of what it holds.

A model forward over new tokens with a cache (`M3ForCausalLM.forward(input_ids, cache=cache)`)
runs

    positions = cache.begin(B, Tq, device)        # where the Tq new tokens of each row go
    for each layer l:  q, k, v, q_idx, k_idx = project(...)
                       cache.write(l, k, v, k_idx)   # store the new positions' keys, values, index keys
                       o = attend(q, q_idx, cache.view(l), ...)   # msakit.nn.core: the one attention core
    cache.end()                                    # the forward is done

A cache never computes attention: `view(l)` describes what layer l holds and where the new
queries sit, and the attention core (`msakit.nn.core.attend`) reads it:

- `HeldKeys`: contiguous k, v [B, Lk, G, D] and index keys [B, Lk, Di], with the new queries at
  `positions` [B or 1, Tq] (None: the last Tq of the Lk positions);
- `PagedKeys`: a `PagedKVCache` layer's pools, the page table and lengths of the rows (the new
  queries are the last positions of each row), and `msa_decode`'s plan;
- `DeferredPagedKeys`: the same for a step whose cache write happens inside the attention op
  (the compiled decode step: the write and the attention are one op opaque to torch.compile).

Caches whose rows can be rolled back (speculative decoding) implement `RollbackCache` too.

Tensor layouts: k, v [B, Tq, G, D]; k_idx [B, Tq, Di] (None for layers without an index branch).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from msakit.ops.decode.reference import PagedLayer

__all__ = ["KVCacheProtocol", "RollbackCache", "HeldKeys", "PagedKeys", "DeferredPagedKeys", "KeyView"]


@dataclass
class HeldKeys:
    """Contiguous keys of one layer: k, v [B, Lk, G, D], k_idx [B, Lk, Di] or None.  The queries
    sit at `positions` int64 [B or 1, Tq] and see the keys j <= their position; None places them
    at the last Tq of the Lk positions (Tq == Lk: the whole sequence, the training layout)."""

    k: torch.Tensor
    v: torch.Tensor
    k_idx: torch.Tensor | None = None
    positions: torch.Tensor | None = None


@dataclass
class PagedKeys:
    """One layer of a `PagedKVCache` as the rows of a step see it: `pools` (views of the layer's
    pages), page_table int32 [B, W], seq_lens int32 [B] (lengths including the new tokens),
    positions int64 [B, nq] of the new tokens, `plan` (msa_decode's plan or None) and msa_decode's
    `backend`.  `memo` is shared by every layer of one step (masks made once per step)."""

    pools: PagedLayer
    page_table: torch.Tensor
    seq_lens: torch.Tensor
    page_size: int
    plan: Any = None
    backend: str = "auto"
    memo: dict = field(default_factory=dict)


@dataclass
class DeferredPagedKeys:
    """A paged step whose new keys k, v [B, nq, G, D] and k_idx [B, nq, Di] (or None) are written
    to `slots` int64 [B * nq] of layer `layer` by the attention op itself (the cache, the plan and
    the backend are the running step's context: `msakit.nn.core.paged_step_context`)."""

    layer: int
    k: torch.Tensor
    v: torch.Tensor
    k_idx: torch.Tensor | None
    slots: torch.Tensor
    page_table: torch.Tensor
    seq_lens: torch.Tensor


KeyView = HeldKeys | PagedKeys | DeferredPagedKeys


class KVCacheProtocol(abc.ABC):
    """Storage of the keys a model forward writes and attends (see the module docstring)."""

    @abc.abstractmethod
    def begin(self, batch: int, num_new: int, device: torch.device) -> torch.Tensor:
        """Start a forward of `num_new` new tokens per row -> their positions int64 [batch, num_new]."""

    @abc.abstractmethod
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, k_idx: torch.Tensor | None) -> None:
        """Store layer `layer`'s keys / values [B, Tq, G, D] and index keys [B, Tq, Di] (or None)
        at this forward's new positions."""

    @abc.abstractmethod
    def view(self, layer: int) -> KeyView:
        """What layer `layer` holds, as the attention core reads it (written positions included)."""

    @abc.abstractmethod
    def end(self) -> None:
        """This forward is done.  A cache that keeps its own length advances it; caches whose lengths
        their owner sets (one paged step, rows of per-row lengths) keep no host state here, since a
        forward captured as a CUDA graph runs this Python once, at capture."""


class RollbackCache(abc.ABC):
    """A cache whose rows can be cut back to shorter lengths (speculative rollback)."""

    @abc.abstractmethod
    def truncate(self, lengths: int | Sequence[int]) -> None:
        """Keep the first lengths (one for all rows, or one per row) positions."""
