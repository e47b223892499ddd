"""Quantization for MiniMax-M3.1-Flash: the MXFP8 and NVFP4 block formats (``formats``,
see docs/formats.md).  The QAT plan builds on these."""

from __future__ import annotations

from .formats import (
    E2M1_MAX,
    E4M3_MAX,
    E8M0_BIAS,
    NVFP4_BLOCK,
    NVFP4_GLOBAL_DIVISOR,
    SCALE_RULES,
    mxfp8_dequantize,
    mxfp8_fake_quantize,
    mxfp8_quantize,
    nvfp4_dequantize,
    nvfp4_fake_quantize,
    nvfp4_global_scale,
    nvfp4_quantize,
)

__all__ = [
    "E2M1_MAX",
    "E4M3_MAX",
    "E8M0_BIAS",
    "NVFP4_BLOCK",
    "NVFP4_GLOBAL_DIVISOR",
    "SCALE_RULES",
    "mxfp8_quantize",
    "mxfp8_dequantize",
    "mxfp8_fake_quantize",
    "nvfp4_global_scale",
    "nvfp4_quantize",
    "nvfp4_dequantize",
    "nvfp4_fake_quantize",
]
