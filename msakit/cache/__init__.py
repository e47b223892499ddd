"""Paged KV cache with MSA index keys for decoding (see paged.py for the layout and the API)."""

from __future__ import annotations

from ..ops.decode.reference import PagedLayer
from .paged import DecodeMetadata, PagedKVCache, quantize_fp8

__all__ = ["PagedKVCache", "PagedLayer", "DecodeMetadata", "quantize_fp8"]
