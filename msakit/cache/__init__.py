"""KV caches behind one protocol (`KVCacheProtocol`: write the new positions' keys, attend dense or
MSA over what is held, truncate): the contiguous `KVCache`, the paged `PagedKVCache` (one
forward over it: `PagedStep`); the speculative `SpecCache` lives in `msakit.speculative`."""

from __future__ import annotations

from msakit.cache.base import KVCacheProtocol
from msakit.cache.contiguous import KVCache
from msakit.cache.paged import DecodeMetadata, PagedKVCache, PagedStep, gather_pages, quantize_fp8
from msakit.cache.rows import PagedRows
from msakit.ops.decode.reference import PagedLayer

__all__ = ["KVCacheProtocol", "KVCache", "PagedRows", "PagedKVCache", "PagedStep", "PagedLayer",
           "DecodeMetadata", "gather_pages", "quantize_fp8"]
