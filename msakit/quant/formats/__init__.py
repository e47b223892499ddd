"""MXFP8 and NVFP4 block formats along the last dimension (docs/formats.md).

Public entry points validate their arguments (``ValueError`` naming the argument) and
dispatch: ``backend="auto"`` runs the fused Triton kernel for CUDA tensors and the PyTorch
reference otherwise; ``"triton"`` forces the kernel (on CPU it needs TRITON_INTERPRET=1, set
before triton is imported: that is how the CPU tests run the kernels); ``"reference"`` forces
the reference.  Both backends give the same bits.

None of these functions records autograd history (inputs are detached): the QAT layers add
their own straight-through estimator around ``*_fake_quantize``.

Host syncs: quantizing checks once that x is finite (``torch.isfinite(x).all()``; for NVFP4
with a computed global scale, the finiteness of amax(|x|), which the scale needs anyway).
``check_finite=False`` skips it (non-finite input then gives unspecified codes).
"""

from __future__ import annotations

import math

import torch

from msakit.ops.dispatch import BACKENDS, use_triton  # the one backend choice of every kernel

from .reference import (
    E2M1_MAX,
    E4M3_MAX,
    E8M0_BIAS,
    NVFP4_BLOCK,
    NVFP4_GLOBAL_DIVISOR,
    SCALE_RULES,
    mxfp8_dequantize_ref,
    mxfp8_fake_quantize_ref,
    mxfp8_quantize_ref,
    nvfp4_dequantize_ref,
    nvfp4_fake_quantize_ref,
    nvfp4_quantize_ref,
)

__all__ = [
    "E2M1_MAX",
    "E4M3_MAX",
    "E8M0_BIAS",
    "NVFP4_BLOCK",
    "NVFP4_GLOBAL_DIVISOR",
    "SCALE_RULES",
    "BACKENDS",
    "E8M0_DTYPE",
    "FP4X2_DTYPE",
    "mxfp8_quantize",
    "mxfp8_dequantize",
    "mxfp8_fake_quantize",
    "nvfp4_global_scale",
    "nvfp4_quantize",
    "nvfp4_dequantize",
    "nvfp4_fake_quantize",
]

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP4X2_DTYPE = getattr(torch, "float4_e2m1fn_x2", None)  # torch's packed-FP4 dtype where it has one
E8M0_DTYPE = getattr(torch, "float8_e8m0fnu", None)  # torch's E8M0 scale dtype where it has one


# ----------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------


def _check_float(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() < 1:
        raise ValueError(f"{name} must have at least one dimension (blocks run along the last), got a scalar")
    return x.detach()


def _check_dtype_arg(dtype: object) -> torch.dtype:
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype must be torch.float32, torch.bfloat16 or torch.float16, got {dtype!r}")
    return dtype  # type: ignore[return-value]


def _check_scale_block_size(scale_block_size: object) -> int:
    if isinstance(scale_block_size, bool) or not isinstance(scale_block_size, int) or scale_block_size < 1:
        raise ValueError(f"scale_block_size must be a positive integer, got {scale_block_size!r}")
    if scale_block_size & (scale_block_size - 1) or scale_block_size > 4096:
        raise ValueError(f"scale_block_size must be a power of two <= 4096, got {scale_block_size}")
    return scale_block_size


def _check_divisible(name: str, x: torch.Tensor, block: int, what: str) -> None:
    K = x.shape[-1]
    if K % block:
        raise ValueError(f"{name}'s last dimension K={K} must be divisible by {what}={block}")


def _check_scale_rule(scale_rule: object) -> str:
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")
    return scale_rule  # type: ignore[return-value]


def _check_finite(name: str, x: torch.Tensor) -> None:
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} contains NaN or inf: it cannot be quantized")


def _check_leading(a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor) -> None:
    if a.device != b.device:
        raise ValueError(f"{b_name} is on {b.device} but {a_name} is on {a.device}")
    if a.dim() != b.dim() or a.shape[:-1] != b.shape[:-1]:
        raise ValueError(
            f"{b_name} {tuple(b.shape)} must have the leading dimensions of {a_name} {tuple(a.shape)} "
            f"(only the last dimension differs)"
        )


def _global_scale_tensor(global_scale: object, device: torch.device) -> torch.Tensor:
    """A user-given global scale -> float32 0-d tensor on `device` (checks what needs no sync)."""
    if isinstance(global_scale, torch.Tensor):
        if global_scale.numel() != 1:
            raise ValueError(f"global_scale must be a scalar (one element), got shape {tuple(global_scale.shape)}")
        if not (global_scale.is_floating_point()):
            raise ValueError(f"global_scale must be a floating tensor, got {global_scale.dtype}")
        return global_scale.detach().to(device=device, dtype=torch.float32).reshape(())
    if isinstance(global_scale, bool) or not isinstance(global_scale, (int, float)):
        kind = type(global_scale).__name__
        raise ValueError(f"global_scale must be a float, a one-element tensor or None, got {kind}")
    if not math.isfinite(global_scale) or global_scale < 0:
        raise ValueError(f"global_scale must be finite and >= 0, got {global_scale!r}")
    return torch.full((), float(global_scale), dtype=torch.float32, device=device)


# ----------------------------------------------------------------------------------------------
# MXFP8
# ----------------------------------------------------------------------------------------------


def _mxfp8_args(x, scale_block_size, scale_rule, check_finite) -> tuple[torch.Tensor, int, str]:
    x = _check_float("x", x)
    scale_block_size = _check_scale_block_size(scale_block_size)
    _check_divisible("x", x, scale_block_size, "scale_block_size")
    scale_rule = _check_scale_rule(scale_rule)
    if check_finite:
        _check_finite("x", x)
    return x, scale_block_size, scale_rule


def mxfp8_quantize(
    x: torch.Tensor,
    *,
    scale_block_size: int = 32,
    scale_rule: str = "rceil",
    backend: str = "auto",
    check_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (float32/bfloat16/float16) -> (codes float8_e4m3fn [..., K], scales uint8
    E8M0 [..., K/scale_block_size]); x ~= codes * 2^(scales - 127) per block.

    scale_rule "rceil": 2^ceil(log2(amax/448)), never saturates (cuBLAS, TE, ModelOpt);
    "floor": 2^(floor(log2 amax) - 8), codes saturated to +/-448 (OCP MX v1.0).  Codes are
    round-to-nearest-even; an all-zero block gets scale byte 127 and zero codes."""
    x, scale_block_size, scale_rule = _mxfp8_args(x, scale_block_size, scale_rule, check_finite)
    if use_triton("mxfp8_quantize", backend, x.device):
        from .triton import mxfp8_quantize_triton

        return mxfp8_quantize_triton(x, scale_block_size=scale_block_size, scale_rule=scale_rule)
    return mxfp8_quantize_ref(x, scale_block_size=scale_block_size, scale_rule=scale_rule)


def mxfp8_fake_quantize(
    x: torch.Tensor,
    *,
    scale_block_size: int = 32,
    scale_rule: str = "rceil",
    backend: str = "auto",
    check_finite: bool = True,
) -> torch.Tensor:
    """mxfp8_dequantize(*mxfp8_quantize(x), dtype=x.dtype) in one pass (the QAT forward)."""
    x, scale_block_size, scale_rule = _mxfp8_args(x, scale_block_size, scale_rule, check_finite)
    if use_triton("mxfp8_fake_quantize", backend, x.device):
        from .triton import mxfp8_fake_quantize_triton

        return mxfp8_fake_quantize_triton(x, scale_block_size=scale_block_size, scale_rule=scale_rule)
    return mxfp8_fake_quantize_ref(x, scale_block_size=scale_block_size, scale_rule=scale_rule)


def mxfp8_dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    *,
    scale_block_size: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """(codes float8_e4m3fn [..., K], scales uint8 or float8_e8m0fnu [..., K/bs]) ->
    codes * 2^(scales - 127) in `dtype` [..., K].  The block size is K / scales.shape[-1]
    (checked against `scale_block_size` when given).  Scale byte 255 (E8M0 NaN) gives NaN."""
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.float8_e4m3fn:
        raise ValueError(f"codes must be a float8_e4m3fn tensor, got {getattr(codes, 'dtype', type(codes).__name__)}")
    if not isinstance(scales, torch.Tensor) or scales.dtype not in (torch.uint8, E8M0_DTYPE):
        raise ValueError(f"scales must be a uint8 (E8M0) tensor, got {getattr(scales, 'dtype', type(scales).__name__)}")
    if scales.dtype != torch.uint8:
        scales = scales.view(torch.uint8)
    dtype = _check_dtype_arg(dtype)
    if codes.dim() < 1:
        raise ValueError("codes must have at least one dimension")
    _check_leading("codes", codes, "scales", scales)
    K, nb = codes.shape[-1], scales.shape[-1]
    if nb == 0 or K % nb:
        raise ValueError(f"codes' last dimension K={K} must be a multiple of scales' last dimension {nb}")
    bs = K // nb
    if scale_block_size is not None and scale_block_size != bs:
        raise ValueError(f"scale_block_size={scale_block_size} does not match codes/scales shapes (K={K}, {nb} blocks)")
    _check_scale_block_size(bs)
    if use_triton("mxfp8_dequantize", backend, codes.device):
        from .triton import mxfp8_dequantize_triton

        return mxfp8_dequantize_triton(codes, scales, dtype)
    return mxfp8_dequantize_ref(codes, scales, dtype)


# ----------------------------------------------------------------------------------------------
# NVFP4
# ----------------------------------------------------------------------------------------------


def _amax_scale(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(amax(|x|) as float32 0-d, amax / 2688): one read of x (aminmax), true division."""
    if x.is_cuda and x.numel():
        # one fused read in Triton, faster than torch.aminmax on CUDA (bit-identical result)
        from .triton import nvfp4_amax_scale_triton

        return nvfp4_amax_scale_triton(x)
    if x.numel() == 0:
        amax = torch.zeros((), dtype=torch.float32, device=x.device)
    else:
        mn, mx = torch.aminmax(x)
        amax = torch.maximum(mx.float(), -mn.float()).abs()  # abs: +0.0 for an all-zero x
    return amax, amax / torch.full((), NVFP4_GLOBAL_DIVISOR, dtype=torch.float32, device=x.device)


def nvfp4_global_scale(x: torch.Tensor) -> torch.Tensor:
    """The NVFP4 decode global scale amax(|x|) / (6 * 448) as a float32 0-d tensor (no sync).
    Pass max(nvfp4_global_scale(w1), nvfp4_global_scale(w3)) to tie fused gate/up scales."""
    x = _check_float("x", x)
    return _amax_scale(x)[1]


def _nvfp4_args(x, global_scale, check_finite) -> tuple[torch.Tensor, torch.Tensor]:
    x = _check_float("x", x)
    _check_divisible("x", x, NVFP4_BLOCK, "the NVFP4 block")
    if global_scale is None:
        amax, gs = _amax_scale(x)
        if check_finite and not bool(torch.isfinite(amax)):
            raise ValueError("x contains NaN or inf: it cannot be quantized")
        return x, gs
    gs = _global_scale_tensor(global_scale, x.device)
    if check_finite:
        ok = torch.isfinite(gs) & (gs >= 0)
        if x.numel():
            ok = ok & torch.isfinite(x).all()
        if not bool(ok):  # one sync; diagnose only on failure
            if not bool(torch.isfinite(gs) & (gs >= 0)):
                raise ValueError(f"global_scale must be finite and >= 0, got {gs.item()!r}")
            raise ValueError("x contains NaN or inf: it cannot be quantized")
    return x, gs


def nvfp4_quantize(
    x: torch.Tensor,
    *,
    global_scale: torch.Tensor | float | None = None,
    backend: str = "auto",
    check_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., K] (float32/bfloat16/float16, K % 16 == 0) -> (packed uint8 [..., K/2],
    block_scales float8_e4m3fn [..., K/16], global_scale float32 0-d).

    global_scale is a decode scale, amax(|x|) / (6 * 448) unless given;
    block_scale = e4m3(amax_block / 6 / global_scale) (RNE, saturating);
    code = e2m1(x / (block_scale * global_scale)) (RNE, clamped to +/-6), sign << 3 | index
    into [0, 0.5, 1, 1.5, 2, 3, 4, 6]; element 2j in the low nibble of byte j."""
    x, gs = _nvfp4_args(x, global_scale, check_finite)
    if use_triton("nvfp4_quantize", backend, x.device):
        from .triton import nvfp4_quantize_triton

        packed, scales = nvfp4_quantize_triton(x, gs)
        return packed, scales, gs
    return nvfp4_quantize_ref(x, global_scale=gs)


def nvfp4_fake_quantize(
    x: torch.Tensor,
    *,
    global_scale: torch.Tensor | float | None = None,
    backend: str = "auto",
    check_finite: bool = True,
) -> torch.Tensor:
    """nvfp4_dequantize(*nvfp4_quantize(x), dtype=x.dtype) in one fused pass (plus the amax
    reduction for the global scale when it is not given)."""
    x, gs = _nvfp4_args(x, global_scale, check_finite)
    if use_triton("nvfp4_fake_quantize", backend, x.device):
        from .triton import nvfp4_fake_quantize_triton

        return nvfp4_fake_quantize_triton(x, gs)
    return nvfp4_fake_quantize_ref(x, global_scale=gs)


def nvfp4_dequantize(
    packed: torch.Tensor,
    block_scales: torch.Tensor,
    global_scale: torch.Tensor | float,
    dtype: torch.dtype = torch.bfloat16,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """(packed uint8 [..., K/2], block_scales float8_e4m3fn [..., K/16], global_scale) ->
    x_hat [..., K] in `dtype`, x_hat = (e2m1 * block_scale) * global_scale."""
    if not isinstance(packed, torch.Tensor) or packed.dtype not in (torch.uint8, FP4X2_DTYPE):
        raise ValueError(f"packed must be a uint8 tensor, got {getattr(packed, 'dtype', type(packed).__name__)}")
    if packed.dtype != torch.uint8:
        packed = packed.view(torch.uint8)
    if not isinstance(block_scales, torch.Tensor) or block_scales.dtype != torch.float8_e4m3fn:
        got = getattr(block_scales, "dtype", type(block_scales).__name__)
        raise ValueError(f"block_scales must be a float8_e4m3fn tensor, got {got}")
    if global_scale is None:
        raise ValueError("global_scale is required to dequantize NVFP4")
    dtype = _check_dtype_arg(dtype)
    if packed.dim() < 1:
        raise ValueError("packed must have at least one dimension")
    _check_leading("packed", packed, "block_scales", block_scales)
    if packed.shape[-1] != block_scales.shape[-1] * (NVFP4_BLOCK // 2):
        raise ValueError(
            f"packed's last dimension ({packed.shape[-1]} bytes = K/2) must be 8 x block_scales' last "
            f"dimension ({block_scales.shape[-1]} = K/16)"
        )
    gs = _global_scale_tensor(global_scale, packed.device)
    if use_triton("nvfp4_dequantize", backend, packed.device):
        from .triton import nvfp4_dequantize_triton

        return nvfp4_dequantize_triton(packed, block_scales, gs, dtype)
    return nvfp4_dequantize_ref(packed, block_scales, gs, dtype)
