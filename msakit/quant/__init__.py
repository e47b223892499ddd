"""Quantization for MiniMax-M3.1-Flash: the MXFP8 and NVFP4 block formats (``formats``,
see docs/formats.md), quantization plans (``plan``), quantization-aware training and
`convert` (``qat``), packed inference modules (``linear``) and the ModelOpt MIXED_PRECISION
checkpoint layout (``checkpoint``)."""

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
from .plan import (
    FORMATS,
    RECIPES,
    PlanEntry,
    module_formats,
    nvfp4_scale_groups,
    plan_counts,
    plan_entries,
    plan_from_quant_config,
    plan_tensor,
    plan_to_quant_config,
    quantization_plan,
    resolve_plan,
    validate_plan,
)
from .linear import PackedEmbedding, PackedExperts, PackedLinear, fake_quantize_weight, pack_weight, unpack_weight
from .qat import QATConfig, capture_weight_refresh, convert, is_qat, prepare_qat, qat_stats, qat_step, remove_qat
from .checkpoint import ScaleReport, check_scales, load_for_qat, load_quantized, read_quantization_config, save_quantized

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
    # plans
    "FORMATS",
    "RECIPES",
    "PlanEntry",
    "quantization_plan",
    "plan_entries",
    "resolve_plan",
    "validate_plan",
    "plan_tensor",
    "plan_counts",
    "module_formats",
    "nvfp4_scale_groups",
    "plan_from_quant_config",
    "plan_to_quant_config",
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
