"""KV caches: storage with one lifecycle (`KVCacheProtocol`: begin a forward, write the new
positions' keys, view what is held, end), read by the one attention core (`msakit.nn.core`).

The contiguous `KVCache`; the paged `PagedKVCache` (pages shared by every layer) with its one-forward
steps `PagedStep` / `DeferredPagedStep` and the per-row-length `PagedRows`; the speculative
`SpecCache` lives in `msakit.speculative`.  Nothing here imports msakit above `ops`."""

from __future__ import annotations

from msakit.cache.base import DeferredPagedKeys, HeldKeys, KeyView, KVCacheProtocol, PagedKeys, RollbackCache
from msakit.cache.contiguous import KVCache
from msakit.cache.paged import DecodeMetadata, DeferredPagedStep, PagedKVCache, PagedStep, gather_pages, quantize_fp8
from msakit.cache.rows import PagedRows
from msakit.ops.decode.reference import PagedLayer

__all__ = ["KVCacheProtocol", "RollbackCache", "HeldKeys", "PagedKeys", "DeferredPagedKeys", "KeyView", "KVCache",
           "PagedRows", "PagedKVCache", "PagedStep", "DeferredPagedStep", "PagedLayer", "DecodeMetadata",
           "gather_pages", "quantize_fp8"]
