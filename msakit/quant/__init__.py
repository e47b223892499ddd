"""Quantization for MiniMax-M3.1-Flash: the MXFP8 and NVFP4 block formats (``formats``,
see docs/formats.md), quantization plans (``plan``), quantization-aware training and
`convert` (``qat``), packed inference modules (``linear``) and the ModelOpt MIXED_PRECISION
checkpoint layout (``checkpoint``)."""

from __future__ import annotations

from . import formats, plan
from .formats import *  # noqa: F403 (the names of formats.__all__)
from .plan import *  # noqa: F403 (the names of plan.__all__)
from .linear import PackedEmbedding, PackedExperts, PackedLinear, fake_quantize_weight, pack_weight, unpack_weight
from .qat import QATConfig, capture_weight_refresh, convert, is_qat, prepare_qat, qat_stats, qat_step, remove_qat
from .checkpoint import ScaleReport, check_scales, load_for_qat, load_quantized, read_quantization_config, save_quantized

__all__ = [
    *formats.__all__,
    *plan.__all__,
    # QAT and packed inference
    "QATConfig",
    "prepare_qat",
    "capture_weight_refresh",
    "qat_step",
    "qat_stats",
    "is_qat",
    "remove_qat",
    "convert",
    "PackedLinear",
    "PackedEmbedding",
    "PackedExperts",
    "pack_weight",
    "unpack_weight",
    "fake_quantize_weight",
    # checkpoints
    "ScaleReport",
    "save_quantized",
    "load_quantized",
    "load_for_qat",
    "check_scales",
    "read_quantization_config",
]
