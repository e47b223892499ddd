"""GEMMs on packed NVFP4 / MXFP8 weights (meaning: `reference.py`; kernels: `triton.py`).

    packed_grouped_mm(x, counts, weight, scales, global_scale, fmt=)   routed experts: x [M, K]
        sorted by group (counts[g] rows each) -> [M, N] in x's dtype, weight [G, N, ...] packed
    packed_linear(x, weight, scales, global_scale, fmt=)               one weight [N, ...]: x [..., K] -> [..., N]
    mxfp8_scaled_mm(x_codes, x_scales, weight, scales, out_dtype=)     MXFP8 x MXFP8 on FP8 tensor cores

The weight is dequantized in registers into x's dtype (the values `unpack_weight` gives; MXFP8
with bfloat16 x at decode sizes: the codes in float16 and the scales on the float32 accumulator,
the exact product up to the accumulation, docs/packed.md), so only the packed bytes are read:
the decode regime (a few rows per weight) is bound by them.
Each op is a `torch.library` custom op (torch.compile sees one node, CUDA graphs capture its
launch: the kernels take the counts on the device, no host sync).
"""

from __future__ import annotations

import torch

from ..checks import FLOAT_DTYPES
from ..dispatch import use_triton
from .reference import dequantize_reference, grouped_mm_reference, scaled_mm_reference

__all__ = ["packed_grouped_mm", "packed_linear", "mxfp8_scaled_mm", "dequantize_reference", "grouped_mm_reference",
           "scaled_mm_reference", "FORMATS"]

FORMATS = ("nvfp4", "mxfp8")
_XDT = tuple(d for d in FLOAT_DTYPES if d != torch.float64)


@torch.library.custom_op("msakit::packed_grouped_mm", mutates_args=())
def _grouped_op(x: torch.Tensor, counts: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                global_scale: torch.Tensor | None, fmt: str, backend: str) -> torch.Tensor:
    if use_triton("packed_grouped_mm", backend, x.device):
        from .triton import grouped_mm_triton

        return grouped_mm_triton(x, counts, weight, scales, global_scale, fmt)
    return grouped_mm_reference(x, counts, weight, scales, global_scale, fmt)


@_grouped_op.register_fake
def _grouped_fake(x, counts, weight, scales, global_scale, fmt, backend):
    return x.new_empty(x.shape[0], weight.shape[1])


@torch.library.custom_op("msakit::mxfp8_scaled_mm", mutates_args=())
def _scaled_op(x_codes: torch.Tensor, x_scales: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
               out_dtype: torch.dtype, backend: str) -> torch.Tensor:
    if use_triton("mxfp8_scaled_mm", backend, x_codes.device):
        from .triton import scaled_mm_triton

        return scaled_mm_triton(x_codes, x_scales, weight, scales, out_dtype)
    return scaled_mm_reference(x_codes, x_scales, weight, scales, out_dtype)


@_scaled_op.register_fake
def _scaled_fake(x_codes, x_scales, weight, scales, out_dtype, backend):
    return torch.empty((x_codes.shape[0], weight.shape[0]), dtype=out_dtype, device=x_codes.device)


def _check_weight(weight: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor | None, fmt: str, K: int,
                  lead: tuple[int, ...], device: torch.device) -> None:
    """Checks a packed weight [*lead, N, ...] of a K-wide input (the docstring layouts of `reference.py`)."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    for name, t in (("weight", weight), ("scales", scales)):
        if not isinstance(t, torch.Tensor) or t.dim() != len(lead) + 2 or tuple(t.shape[:len(lead)]) != lead:
            raise ValueError(f"{name} must be a tensor [{', '.join(map(str, lead + ('N',)))}, ...], got shape "
                             f"{tuple(getattr(t, 'shape', ()))}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but x is on {device}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit stride along its last dimension")
    N = weight.shape[-2]
    if fmt == "nvfp4":
        want = {"weight": (torch.uint8, K // 2), "scales": (torch.float8_e4m3fn, K // 16)}
        if K % 16:
            raise ValueError(f"x's K={K} must be divisible by 16 for an NVFP4 weight")
        if not isinstance(global_scale, torch.Tensor) or tuple(global_scale.shape) != lead or \
                global_scale.dtype != torch.float32 or global_scale.device != device:
            raise ValueError(f"global_scale must be a float32 tensor of shape {lead} on {device}, got "
                             f"{getattr(global_scale, 'dtype', type(global_scale).__name__)} "
                             f"{tuple(getattr(global_scale, 'shape', ()))}")
    else:
        want = {"weight": (torch.float8_e4m3fn, K), "scales": (torch.uint8, K // 32)}
        if K % 32:
            raise ValueError(f"x's K={K} must be divisible by 32 for an MXFP8 weight")
        if global_scale is not None:
            raise ValueError("global_scale must be None for an MXFP8 weight")
    for name, t in (("weight", weight), ("scales", scales)):
        dt, cols = want[name]
        if t.dtype != dt or tuple(t.shape[-2:]) != (N, cols):
            raise ValueError(f"{name} of a {fmt} weight must be {dt} [..., N={N}, {cols}] for K={K}, got {t.dtype} "
                             f"{tuple(t.shape)}")


def _check_x(name: str, x: object, ndim: int | None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dtype not in _XDT:
        raise ValueError(f"{name} must be a float32 / bfloat16 / float16 tensor, got "
                         f"{getattr(x, 'dtype', type(x).__name__)}")
    if (ndim is not None and x.dim() != ndim) or x.dim() < 1:
        raise ValueError(f"{name} must have {ndim or 'at least 1'} dimensions, got shape {tuple(x.shape)}")
    return x


def packed_grouped_mm(x: torch.Tensor, counts: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                      global_scale: torch.Tensor | None = None, *, fmt: str, backend: str = "auto") -> torch.Tensor:
    """y [M, N] (x's dtype): the rows of group g (x [M, K] sorted by group, counts int [G] rows
    each, summing to M) times dequant(weight[g]).T, float32 accumulation.

    nvfp4: weight uint8 [G, N, K/2], scales float8_e4m3fn [G, N, K/16], global_scale float32 [G];
    mxfp8: weight float8_e4m3fn [G, N, K], scales uint8 E8M0 [G, N, K/32], global_scale None.
    backend: "auto" (the Triton kernel on CUDA), "triton", "reference"."""
    _check_x("x", x, 2)
    if not isinstance(counts, torch.Tensor) or counts.dim() != 1 or counts.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"counts must be an int32 / int64 tensor [G], got {getattr(counts, 'dtype', type(counts))}")
    if counts.device != x.device:
        raise ValueError(f"counts is on {counts.device} but x is on {x.device}")
    _check_weight(weight, scales, global_scale, fmt, x.shape[1], (counts.shape[0],), x.device)
    return _grouped_op(x.contiguous(), counts.contiguous(), weight, scales, global_scale, fmt, backend)


def packed_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                  global_scale: torch.Tensor | None = None, *, fmt: str, backend: str = "auto") -> torch.Tensor:
    """x [..., K] @ dequant(weight).T -> [..., N] in x's dtype (one group of `packed_grouped_mm`:
    weight [N, ...], scales [N, ...], global_scale float32 [] for NVFP4)."""
    _check_x("x", x, None)
    K = x.shape[-1]
    _check_weight(weight, scales, global_scale, fmt, K, (), x.device)
    x2 = x.reshape(-1, K).contiguous()
    counts = torch.full((1,), x2.shape[0], dtype=torch.int32, device=x.device)
    gs = None if global_scale is None else global_scale.reshape(1)
    y = _grouped_op(x2, counts, weight.unsqueeze(0), scales.unsqueeze(0), gs, fmt, backend)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def mxfp8_scaled_mm(x_codes: torch.Tensor, x_scales: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, *,
                    out_dtype: torch.dtype = torch.bfloat16, backend: str = "auto") -> torch.Tensor:
    """y [M, N] = dequant(x) @ dequant(w).T with both operands MXFP8 (x_codes float8_e4m3fn
    [M, K], x_scales uint8 E8M0 [M, K/32] along K; weight / scales as `packed_linear`'s MXFP8),
    float32 accumulation, in `out_dtype`."""
    if not isinstance(x_codes, torch.Tensor) or x_codes.dtype != torch.float8_e4m3fn or x_codes.dim() != 2:
        raise ValueError(f"x_codes must be a float8_e4m3fn tensor [M, K], got {getattr(x_codes, 'dtype', None)} "
                         f"{tuple(getattr(x_codes, 'shape', ()))}")
    M, K = x_codes.shape
    if not isinstance(x_scales, torch.Tensor) or x_scales.dtype != torch.uint8 or tuple(x_scales.shape) != (M, K // 32):
        raise ValueError(f"x_scales must be uint8 [M={M}, K/32={K // 32}], got {getattr(x_scales, 'dtype', None)} "
                         f"{tuple(getattr(x_scales, 'shape', ()))}")
    if x_scales.device != x_codes.device:
        raise ValueError(f"x_scales is on {x_scales.device} but x_codes is on {x_codes.device}")
    if out_dtype not in _XDT:
        raise ValueError(f"out_dtype must be float32, bfloat16 or float16, got {out_dtype!r}")
    _check_weight(weight, scales, None, "mxfp8", K, (), x_codes.device)
    return _scaled_op(x_codes.contiguous(), x_scales.contiguous(), weight, scales, out_dtype, backend)
