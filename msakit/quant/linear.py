"""Packed weights: packing / unpacking helpers and the inference modules `convert` swaps in.

Storage per format (the ModelOpt ``MIXED_PRECISION`` checkpoint tensors, docs/formats.md), for a
weight [*lead, N, K] (lead = (E,) for stacked routed experts, () otherwise):

| fmt | tensors |
|---|---|
| nvfp4 | ``weight`` uint8 [*lead, N, K/2] (element 2j in the low nibble), ``weight_scale`` float8_e4m3fn [*lead, N, K/16], ``weight_scale_2`` float32 [*lead] (decode global scale), ``input_scale`` float32 [*lead] (1.0: M3's constant expert-input amax) |
| mxfp8 | ``weight`` float8_e4m3fn [*lead, N, K], ``weight_scale_inv`` uint8 E8M0 [*lead, N, K/32] |
| bf16 / fp32 | ``weight`` in that dtype |

Execution on CUDA: the packed GEMMs of `msakit.ops.packed_gemm` read the packed bytes and
dequantize in registers (Hopper has no block-scaled MMA for MXFP8 / NVFP4), giving the values
`unpack_weight` gives (docs/packed.md):
- NVFP4 (routed experts, any NVFP4 linear): the weight-only grouped GEMM (W4A16) up to
  `KERNEL_MAX_ROWS` rows per weight (decode, small batches); larger batches dequantize then run
  cuBLAS / `torch._grouped_mm` (the extra pass over the weight is small against the GEMM there).
- MXFP8 linears: up to `KERNEL_MAX_ROWS` rows the weight-only kernel (W8A16) on the
  fake-quantized input; above, dequantize-then-matmul (`mxfp8_scaled_mm`, the FP8 tensor-core
  GEMM, is not dispatched: 25-28x slower than dequantize + cuBLAS at 4096-16384 rows on an H100,
  docs/packed.md).
**Dequantize-then-matmul** (`unpack_weight` into the compute dtype, then `F.linear` or
`msakit.nn.moe.grouped_mm`) is the reference, the CPU path and the fallback (it warns once
on CUDA when the kernels cannot run).  It is exact: the dequantized values are the ones QAT
trained with, so `convert` reproduces the QAT forward bit for bit.  Routed experts on that path
dequantize only the experts that received tokens when all of them would exceed
``max_dequant_bytes`` (full-size models), in chunks of that size.

Activations: MXFP8 layers quantize their input along K (1 x 32 blocks, dynamic, the same rule
as the weights), as in QAT.  NVFP4 expert inputs stay in the compute dtype (W4A16 on Hopper;
``input_scale`` is stored for Blackwell engines).

`pack_weight` / `unpack_weight` / `fake_quantize_weight` are the single definition of these
layouts used by QAT, `convert` and the checkpoint code: ``fake_quantize_weight(w, ...) ==
unpack_weight(pack_weight(w, ...), ...)`` bit for bit, with the scales either derived by the
rule or given (frozen scales of a loaded checkpoint).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from msakit.nn.mlp import swiglu_oai
from msakit.ops.dispatch import use_triton
from msakit.nn.moe import GroupedExperts, grouped_mm
from msakit.ops.packed_gemm import packed_grouped_mm, packed_linear

from .formats import (
    NVFP4_GLOBAL_DIVISOR,
    SCALE_RULES,
    mxfp8_dequantize,
    mxfp8_fake_quantize,
    mxfp8_quantize,
    nvfp4_dequantize,
)
from .formats.reference import (
    pow2,
    e2m1_codes,
    e2m1_round,
    e4m3_round,
)

__all__ = [
    "SUFFIXES",
    "packed_spec",
    "nvfp4_global_scales",
    "nvfp4_quantize_grouped",
    "nvfp4_fake_quantize_grouped",
    "mxfp8_fake_quantize_to",
    "nvfp4_quantize_with_scales",
    "mxfp8_quantize_with_scales",
    "pack_weight",
    "unpack_weight",
    "fake_quantize_weight",
    "compute_dtype",
    "PackedLinear",
    "PackedEmbedding",
    "PackedExperts",
    "packed_path",
    "KERNEL_MAX_ROWS",
]

SUFFIXES = {
    "nvfp4": ("weight", "weight_scale", "weight_scale_2", "input_scale"),
    "mxfp8": ("weight", "weight_scale_inv"),
    "bf16": ("weight",),
    "fp32": ("weight",),
}
_FLOAT = {"bf16": torch.bfloat16, "fp32": torch.float32}

# Dispatch of the packed forward on CUDA (rows = tokens of a linear, mean rows per active expert
# of the routed experts): the in-register kernels up to KERNEL_MAX_ROWS, dequantize-then-matmul
# above.  On an H100 (benchmarks/packed_gemm.py, docs/packed.md) the NVFP4 kernel is 6-10x the
# dequantize path at 1-16 rows per expert and 1.5x at 128; MXFP8 W8A16 2.8-2.9x at 1-16 rows.
KERNEL_MAX_ROWS = 64


def packed_spec(fmt: str, shape: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{suffix: (shape, dtype)} of the stored tensors of a weight of `shape` [*lead, N, K]."""
    *lead, N, K = shape
    lead = tuple(lead)
    if fmt == "nvfp4":
        return {"weight": ((*lead, N, K // 2), torch.uint8), "weight_scale": ((*lead, N, K // 16), torch.float8_e4m3fn),
                "weight_scale_2": (lead, torch.float32), "input_scale": (lead, torch.float32)}
    if fmt == "mxfp8":
        return {"weight": ((*lead, N, K), torch.float8_e4m3fn), "weight_scale_inv": ((*lead, N, K // 32), torch.uint8)}
    if fmt in _FLOAT:
        return {"weight": ((*lead, N, K), _FLOAT[fmt])}
    raise ValueError(f"unknown format {fmt!r}")


def compute_dtype(device_type: str, default: torch.dtype) -> torch.dtype:
    """The autocast dtype when autocast is on for `device_type`, else `default`."""
    if device_type in ("cuda", "cpu") and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return default


# ---------------------------------------------------------------------------------------------
# Format helpers over stacked tensors (one global scale per leading index)
# ---------------------------------------------------------------------------------------------


def nvfp4_global_scales(*ws: torch.Tensor) -> torch.Tensor:
    """The NVFP4 decode global scale amax / 2688 per leading index of tensors [*lead, N, K]
    (float32 [*lead]); several tensors share the max of their amaxes (w1 and w3 of an expert).
    Bit-equal to `msakit.quant.formats.nvfp4_global_scale` per slice; no host sync."""
    amax = None
    for w in ws:
        lead = w.shape[:-2]
        flat = w.detach().reshape(*lead, -1) if lead else w.detach().reshape(-1)
        if flat.shape[-1] == 0:
            a = torch.zeros(lead, dtype=torch.float32, device=w.device)
        elif lead:
            mn, mx = torch.aminmax(flat, dim=-1)
            a = torch.maximum(mx.float(), -mn.float()).abs()
        else:
            mn, mx = torch.aminmax(flat)
            a = torch.maximum(mx.float(), -mn.float()).abs()
        amax = a if amax is None else torch.maximum(amax, a)
    return amax / torch.full((), NVFP4_GLOBAL_DIVISOR, dtype=torch.float32, device=amax.device)


def _lead(x: torch.Tensor) -> tuple[int, ...]:
    return tuple(x.shape[:-2])


def _groups(x: torch.Tensor, gs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [*lead, N, K] -> [G, N, K]; gs [*lead] -> [G]."""
    G = 1
    for d in _lead(x):
        G *= d
    return x.reshape(G, *x.shape[-2:]), gs.reshape(G)


def nvfp4_quantize_grouped(
    x: torch.Tensor, global_scales: torch.Tensor, *, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [*lead, N, K] with one decode global scale per leading index (float32 [*lead]) ->
    (packed uint8 [*lead, N, K/2], block scales float8_e4m3fn [*lead, N, K/16]).  Bit-equal to
    `nvfp4_quantize(x[i], global_scale=global_scales[i])` for every i; one kernel launch."""
    xg, gs = _groups(x, global_scales)
    if use_triton("nvfp4_quantize", backend, x.device):
        from .formats.triton import nvfp4_quantize_triton

        packed, bs = nvfp4_quantize_triton(xg, gs.to(device=x.device, dtype=torch.float32))  # one scale per group
    else:
        bs = _nvfp4_block_scales_ref(xg, gs)
        packed = nvfp4_quantize_with_scales(xg, bs, gs)
    lead = _lead(x)
    return packed.reshape(*lead, *packed.shape[1:]), bs.reshape(*lead, *bs.shape[1:])


def nvfp4_fake_quantize_grouped(
    x: torch.Tensor, global_scales: torch.Tensor, out_dtype: torch.dtype | None = None, *, backend: str = "auto"
) -> torch.Tensor:
    """dequantize(quantize(x)) per leading index in `out_dtype` (x's dtype by default), one
    launch: the float32 value (e2m1 * block_scale) * global_scale rounded once to out_dtype."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    xg, gs = _groups(x, global_scales)
    if use_triton("nvfp4_fake_quantize", backend, x.device):
        from .formats.triton import nvfp4_fake_quantize_triton

        out = nvfp4_fake_quantize_triton(xg, gs.to(device=x.device, dtype=torch.float32), out_dtype=out_dtype)
    else:
        bs = _nvfp4_block_scales_ref(xg, gs)
        packed = nvfp4_quantize_with_scales(xg, bs, gs)
        out = unpack_weight({"weight": packed, "weight_scale": bs, "weight_scale_2": gs}, "nvfp4", out_dtype,
                            backend="reference")
    return out.reshape(x.shape)


def _nvfp4_block_scales_ref(xg: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """Block scales of xg [G, N, K] with global scales gs [G], vectorized over G: the
    reference's RNE_E4M3(amax_block / 6 / gs), 0 for all-zero blocks or gs == 0."""
    G, N, K = xg.shape
    amax = xg.detach().float().reshape(G, N, K // 16, 16).abs().amax(dim=-1)
    g = gs.float().reshape(G, 1, 1)
    six = torch.full((), 6.0, dtype=torch.float32, device=xg.device)
    t = amax / six / g
    t = torch.where((amax == 0) | (g == 0), torch.zeros_like(t), t)
    return e4m3_round(t).to(torch.float8_e4m3fn)


def mxfp8_fake_quantize_to(
    x: torch.Tensor, out_dtype: torch.dtype | None = None, *, scale_rule: str = "rceil", backend: str = "auto"
) -> torch.Tensor:
    """MXFP8 (1 x 32 blocks along the last dim) fake-quantize (`msakit.quant.formats`' fused
    kernel on CUDA), in `out_dtype` (x's dtype by default; MXFP8 values are exact in bfloat16,
    so a cast after the kernel changes nothing).  No finiteness check, no host sync."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    y = mxfp8_fake_quantize(x, scale_rule=scale_rule, backend=backend, check_finite=False)
    return y if y.dtype == out_dtype else y.to(out_dtype)  # exact: MXFP8 values fit every output dtype


def nvfp4_quantize_with_scales(
    x: torch.Tensor, block_scales: torch.Tensor, global_scales: torch.Tensor | float
) -> torch.Tensor:
    """Codes of x [*lead, N, K] under GIVEN scales (frozen checkpoint scales): block scales
    float8_e4m3fn [*lead, N, K/16], global scales float32 [*lead] (or a scalar) -> packed uint8
    [*lead, N, K/2].  code = RNE_E2M1(x / (block_scale * global_scale)), clamped to +/-6, 0 where
    that decode scale is 0: exactly `nvfp4_quantize`'s element rule, so with the rule's own
    scales both agree bit for bit."""
    K = x.shape[-1]
    xb = x.detach().float().reshape(*x.shape[:-1], K // 16, 16)
    gs = torch.as_tensor(global_scales, dtype=torch.float32, device=x.device)
    gs = gs.reshape(*gs.shape, 1, 1) if gs.dim() else gs
    d = (block_scales.float() * gs).unsqueeze(-1)
    q = torch.where(d == 0, torch.zeros_like(xb), xb / d)
    codes = e2m1_codes(e2m1_round(q), torch.signbit(xb)).reshape(x.shape)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def mxfp8_quantize_with_scales(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Codes of x [..., K] under GIVEN E8M0 scale bytes [..., K/bs] (frozen checkpoint scales)
    -> float8_e4m3fn [..., K]: RNE_E4M3(x * 2^(127 - byte)), saturating at +/-448 -- exactly
    `mxfp8_quantize`'s element rule."""
    if scales.dtype != torch.uint8:
        scales = scales.view(torch.uint8)
    K, nb = x.shape[-1], scales.shape[-1]
    xb = x.detach().float().reshape(*x.shape[:-1], nb, K // nb)
    e = scales.to(torch.int32) - 127  # unbiased exponent in [-127, 127] (255 = NaN is rejected by callers)
    neg = -e
    # 2^-e is a normal float32 for -e in [-126, 127]; -e = -127 (byte 254) is applied in two exact halves
    f1 = pow2(torch.clamp(neg, min=-126))
    f2 = torch.where(neg < -126, torch.full_like(f1, 0.5), torch.ones_like(f1))
    q = xb * f1.unsqueeze(-1) * f2.unsqueeze(-1)
    mag = e4m3_round(q)
    signed = torch.where(torch.signbit(xb), -mag, mag)
    return signed.to(torch.float8_e4m3fn).reshape(x.shape)


# ---------------------------------------------------------------------------------------------
# pack / unpack / fake-quantize (the one definition used by QAT, convert and checkpoints)
# ---------------------------------------------------------------------------------------------


def _frozen_index(frozen: Mapping[str, Any], lead: tuple[int, ...], device) -> torch.Tensor | None:
    """Flat indices (into the leading dims) of the frozen slices; None = all of them."""
    mask = frozen.get("mask")
    if mask is None:
        return None
    mask = torch.as_tensor(mask, dtype=torch.bool).reshape(-1)
    return torch.nonzero(mask).reshape(-1).to(device)


def _check_frozen(fmt: str, w: torch.Tensor, frozen: Mapping[str, Any]) -> None:
    spec = packed_spec(fmt, tuple(w.shape))
    for k in ("weight_scale", "weight_scale_2") if fmt == "nvfp4" else ("weight_scale_inv",):
        t = frozen.get(k)
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"frozen {fmt} scales need {k!r}")
        want_shape, want_dtype = spec[k]
        if tuple(t.shape) != tuple(want_shape):
            raise ValueError(f"frozen {k} has shape {tuple(t.shape)}, expected {tuple(want_shape)}")
        if k == "weight_scale_inv" and t.dtype not in (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8)):
            raise ValueError(f"frozen weight_scale_inv must be uint8 (E8M0), got {t.dtype}")
        if k == "weight_scale" and t.dtype != torch.float8_e4m3fn:
            raise ValueError(f"frozen weight_scale must be float8_e4m3fn, got {t.dtype}")


def _frozen_slices(fmt, w, frozen):
    """(flat index or None, w slices [n, N, K], frozen tensors restricted to them)."""
    lead = _lead(w)
    idx = _frozen_index(frozen, lead, w.device)
    G = 1
    for d in lead:
        G *= d
    wg = w.reshape(G, *w.shape[-2:])
    keys = ("weight_scale", "weight_scale_2") if fmt == "nvfp4" else ("weight_scale_inv",)
    fr = {}
    for k in keys:
        t = frozen[k].to(w.device)
        t = t.reshape(G, *t.shape[len(lead):])
        fr[k] = t if idx is None else t[idx]
    return idx, (wg if idx is None else wg[idx]), fr


def pack_weight(
    w: torch.Tensor,
    fmt: str,
    *,
    global_scale: torch.Tensor | None = None,
    frozen: Mapping[str, Any] | None = None,
    scale_rule: str = "rceil",
    backend: str = "auto",
    check_finite: bool = True,
    name: str = "weight",
) -> dict[str, torch.Tensor]:
    """Quantize w [*lead, N, K] into its stored tensors {suffix: tensor} (see the module table).

    nvfp4: `global_scale` float32 [*lead] (a shared w1/w3 scale) or None (amax rule per slice);
    `frozen` = {"weight_scale", "weight_scale_2"[, "mask" bool [*lead]]} keeps those scales for
    the slices in mask (all without a mask).  mxfp8: `frozen` = {"weight_scale_inv"[, "mask"]}."""
    if fmt not in SUFFIXES:
        raise ValueError(f"unknown format {fmt!r} for {name}")
    if fmt in _FLOAT:
        return {"weight": w.detach().to(_FLOAT[fmt])}
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")
    if w.dim() < 2:
        raise ValueError(f"{name}: expected a weight [*lead, N, K], got shape {tuple(w.shape)}")
    if check_finite and w.numel() and not bool(torch.isfinite(w).all()):
        raise ValueError(f"{name} contains NaN or inf: it cannot be quantized")
    if frozen is not None:
        _check_frozen(fmt, w, frozen)
    w = w.detach()
    lead = _lead(w)
    if fmt == "mxfp8":
        codes, scales = mxfp8_quantize(w, scale_rule=scale_rule, backend=backend, check_finite=False)
        if frozen is not None:
            idx, ws, fr = _frozen_slices(fmt, w, frozen)
            fc = mxfp8_quantize_with_scales(ws, fr["weight_scale_inv"])
            fs = fr["weight_scale_inv"].view(torch.uint8) if fr["weight_scale_inv"].dtype != torch.uint8 else fr["weight_scale_inv"]
            if idx is None:
                codes, scales = fc.reshape(w.shape), fs.reshape(scales.shape).clone()
            else:
                cg = codes.reshape(-1, *w.shape[-2:])
                sg = scales.reshape(-1, *scales.shape[-2:])
                cg[idx] = fc
                sg[idx] = fs
        return {"weight": codes, "weight_scale_inv": scales}
    # nvfp4
    gs = nvfp4_global_scales(w) if global_scale is None else global_scale.detach().to(w.device, torch.float32).reshape(lead)
    gs = gs.clone()
    packed, bs = nvfp4_quantize_grouped(w, gs, backend=backend)
    if frozen is not None:
        idx, ws, fr = _frozen_slices(fmt, w, frozen)
        fp = nvfp4_quantize_with_scales(ws, fr["weight_scale"], fr["weight_scale_2"].float())
        G = max(1, gs.numel())
        pg, bg, gg = packed.reshape(G, *packed.shape[-2:]), bs.reshape(G, *bs.shape[-2:]), gs.reshape(G)
        sel = slice(None) if idx is None else idx
        pg[sel] = fp
        bg[sel] = fr["weight_scale"]
        gg[sel] = fr["weight_scale_2"].float()
    input_scale = torch.ones(lead, dtype=torch.float32, device=w.device)
    return {"weight": packed, "weight_scale": bs, "weight_scale_2": gs, "input_scale": input_scale}


def unpack_weight(
    tensors: Mapping[str, torch.Tensor], fmt: str, dtype: torch.dtype = torch.bfloat16, *, backend: str = "auto"
) -> torch.Tensor:
    """The stored tensors of one weight (see `pack_weight`) -> its dequantized value in `dtype`.
    NVFP4 computes the float32 (e2m1 * block_scale) * global_scale per leading index and rounds
    it once to `dtype` (one kernel for every slice)."""
    if fmt in _FLOAT:
        return tensors["weight"].to(dtype)
    if fmt == "mxfp8":
        return mxfp8_dequantize(tensors["weight"], tensors["weight_scale_inv"], dtype, backend=backend)
    if fmt != "nvfp4":
        raise ValueError(f"unknown format {fmt!r}")
    packed, bs, gs = tensors["weight"], tensors["weight_scale"], tensors["weight_scale_2"]
    if gs.dim() == 0:
        return nvfp4_dequantize(packed, bs, gs, dtype, backend=backend)
    # e2m1 * block_scale is exact in float32 (global scale 1), then one float32 multiply per slice
    v = nvfp4_dequantize(packed, bs, 1.0, torch.float32, backend=backend)
    v = v * gs.float().reshape(*gs.shape, 1, 1)
    return v.to(dtype)


def fake_quantize_weight(
    w: torch.Tensor,
    fmt: str,
    out_dtype: torch.dtype | None = None,
    *,
    global_scale: torch.Tensor | None = None,
    frozen: Mapping[str, Any] | None = None,
    scale_rule: str = "rceil",
    backend: str = "auto",
) -> torch.Tensor:
    """``unpack_weight(pack_weight(w, ...), out_dtype)`` without materialising the codes where
    the scales follow the rule (one fused kernel: the QAT forward); no finiteness check."""
    out_dtype = w.dtype if out_dtype is None else out_dtype
    w = w.detach()
    if fmt in _FLOAT:
        return w.to(_FLOAT[fmt]).to(out_dtype)
    if frozen is not None and frozen.get("mask") is None:
        return unpack_weight(pack_weight(w, fmt, global_scale=global_scale, frozen=frozen, scale_rule=scale_rule,
                                         backend=backend, check_finite=False), fmt, out_dtype, backend=backend)
    if fmt == "mxfp8":
        out = mxfp8_fake_quantize_to(w, out_dtype, scale_rule=scale_rule, backend=backend)
    elif fmt == "nvfp4":
        gs = nvfp4_global_scales(w) if global_scale is None else global_scale.detach().to(w.device, torch.float32)
        out = nvfp4_fake_quantize_grouped(w, gs.reshape(_lead(w)), out_dtype, backend=backend)
    else:
        raise ValueError(f"unknown format {fmt!r}")
    if frozen is not None:  # some slices keep frozen scales
        _check_frozen(fmt, w, frozen)
        idx, ws, fr = _frozen_slices(fmt, w, frozen)
        if idx.numel():
            if fmt == "mxfp8":
                fq = mxfp8_dequantize(mxfp8_quantize_with_scales(ws, fr["weight_scale_inv"]),
                                      fr["weight_scale_inv"], out_dtype, backend=backend)
            else:
                fq = unpack_weight({"weight": nvfp4_quantize_with_scales(ws, fr["weight_scale"], fr["weight_scale_2"]),
                                    "weight_scale": fr["weight_scale"], "weight_scale_2": fr["weight_scale_2"].float()},
                                   "nvfp4", out_dtype, backend=backend)
            og = out.reshape(-1, *w.shape[-2:])
            og[idx] = fq
    return out


# ---------------------------------------------------------------------------------------------
# Inference modules
# ---------------------------------------------------------------------------------------------


class _PackedBase(nn.Module):
    """Keeps its stored tensors' dtypes through `.to(dtype)` / `.half()` (only devices move);
    the compute dtype follows a floating conversion of the model."""

    compute_dtype: torch.dtype

    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        probe = fn(torch.empty(0, dtype=self.compute_dtype))
        if probe.is_floating_point():
            self.compute_dtype = probe.dtype
        for k, b in list(self._buffers.items()):
            if b is None:
                continue
            nb = fn(b)
            if nb.dtype != b.dtype:
                nb = b.to(device=nb.device)
            self._buffers[k] = nb
        return self

    def _register(self, prefix: str, fmt: str, shape: tuple[int, ...], device, tensors=None) -> None:
        for suffix, (shp, dt) in packed_spec(fmt, shape).items():
            t = torch.empty(shp, dtype=dt, device=device) if tensors is None else tensors[suffix]
            self.register_buffer(prefix + suffix, t)

    def _tensors(self, prefix: str, fmt: str) -> dict[str, torch.Tensor]:
        return {s: getattr(self, prefix + s) for s in SUFFIXES[fmt]}


class PackedLinear(_PackedBase):
    """A bias-free linear layer with a packed weight (buffers named as in the checkpoint:
    ``weight``, ``weight_scale``, ``weight_scale_2``, ``input_scale`` / ``weight_scale_inv``).

    forward: MXFP8 layers fake-quantize x along K (dynamic 1 x 32 blocks); the weight is
    dequantized into the compute dtype (autocast's, else `compute_dtype`) and F.linear runs.
    ``cache_dequantized = True`` keeps the dequantized weight between calls (faster decode,
    the memory of a full-precision copy)."""

    quant_kind = "linear"

    def __init__(self, in_features: int, out_features: int, fmt: str, *, compute_dtype: torch.dtype = torch.float32,
                 quantize_input: bool | None = None, scale_rule: str = "rceil", backend: str = "auto",
                 device=None, tensors: Mapping[str, torch.Tensor] | None = None) -> None:
        super().__init__()
        if fmt not in SUFFIXES:
            raise ValueError(f"unknown format {fmt!r}")
        self.in_features, self.out_features, self.fmt = int(in_features), int(out_features), fmt
        self.compute_dtype = compute_dtype
        self.quantize_input = (fmt == "mxfp8") if quantize_input is None else bool(quantize_input)
        self.scale_rule, self.backend = scale_rule, backend
        self.cache_dequantized = False
        self._deq: tuple | None = None
        self._register("", fmt, (self.out_features, self.in_features), device, tensors)

    @classmethod
    def from_float(cls, linear: nn.Linear, fmt: str, *, frozen=None, quantize_input: bool | None = None,
                   scale_rule: str = "rceil", backend: str = "auto", name: str = "weight",
                   compute_dtype: torch.dtype | None = None) -> "PackedLinear":
        if getattr(linear, "bias", None) is not None:
            raise ValueError(f"{name}: packed linears have no bias (M3 has none)")
        w = linear.weight
        tensors = pack_weight(w, fmt, frozen=frozen, scale_rule=scale_rule, backend=backend, name=name)
        return cls(linear.in_features, linear.out_features, fmt, compute_dtype=compute_dtype or w.dtype,
                   quantize_input=quantize_input, scale_rule=scale_rule, backend=backend, tensors=tensors)

    def packed_tensors(self) -> dict[str, torch.Tensor]:
        return self._tensors("", self.fmt)

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.compute_dtype
        if not self.cache_dequantized:
            self._deq = None
            return unpack_weight(self.packed_tensors(), self.fmt, dtype, backend=self.backend)
        w0 = self.weight
        key = (dtype, w0.device, w0.data_ptr(), w0._version)
        if self._deq is None or self._deq[0] != key:
            self._deq = (key, unpack_weight(self.packed_tensors(), self.fmt, dtype, backend=self.backend))
        return self._deq[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = compute_dtype(x.device.type, self.compute_dtype)
        rows = x.numel() // max(1, self.in_features)
        path = "dequant" if self.cache_dequantized else packed_path(self.fmt, rows, x, self.backend)
        if self.quantize_input:
            x = mxfp8_fake_quantize_to(x, dt, scale_rule=self.scale_rule, backend=self.backend)
        if path == "kernel":
            t = self.packed_tensors()
            return packed_linear(x.to(dt), t["weight"], t.get("weight_scale", t.get("weight_scale_inv")),
                                 t.get("weight_scale_2"), fmt=self.fmt, backend=self.backend)
        return F.linear(x.to(dt), self.dequantized_weight(dt))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}, "
                f"quantize_input={self.quantize_input}")


class PackedEmbedding(_PackedBase):
    """An embedding stored in bf16 (or fp32); rows are looked up then cast to the compute dtype
    (the dtype of the rest of the model), which equals casting the table first."""

    quant_kind = "embedding"

    def __init__(self, num_embeddings: int, embedding_dim: int, fmt: str = "bf16", *,
                 compute_dtype: torch.dtype = torch.float32, padding_idx: int | None = None, device=None,
                 tensors: Mapping[str, torch.Tensor] | None = None) -> None:
        super().__init__()
        if fmt not in _FLOAT:
            raise ValueError(f"an embedding can only be stored as 'bf16' or 'fp32', got {fmt!r}")
        self.num_embeddings, self.embedding_dim, self.fmt = int(num_embeddings), int(embedding_dim), fmt
        self.compute_dtype = compute_dtype
        self.padding_idx = padding_idx
        self._register("", fmt, (self.num_embeddings, self.embedding_dim), device, tensors)

    @classmethod
    def from_float(cls, emb: nn.Embedding, fmt: str = "bf16") -> "PackedEmbedding":
        return cls(emb.num_embeddings, emb.embedding_dim, fmt, compute_dtype=emb.weight.dtype,
                   padding_idx=emb.padding_idx, tensors=pack_weight(emb.weight, fmt))

    def packed_tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight, self.padding_idx).to(self.compute_dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, fmt={self.fmt}"


class PackedExperts(GroupedExperts, _PackedBase):
    """Routed experts with packed stacked weights: buffers ``w1_weight`` [E, I, H/2],
    ``w1_weight_scale``, ``w1_weight_scale_2`` [E], ``w1_input_scale`` [E], ... (one set per
    projection w1 / w3 / w2, in its format); saved per expert as
    ``experts.{e}.w1.weight`` etc.  NVFP4 w1 and w3 of an expert share one global scale.

    forward = GroupedExperts.forward on the dequantized stacked weights (the QAT forward
    exactly); when dequantizing every expert would exceed `max_dequant_bytes`, only the experts
    that received tokens are dequantized, a chunk at a time."""

    quant_kind = "experts"
    max_dequant_bytes: int = 1 << 30

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, formats: Mapping[str, str], *,
                 alpha: float = 1.702, limit: float = 7.0, compute_dtype: torch.dtype = torch.float32,
                 backend: str = "auto", device=None, tensors: Mapping[str, Mapping[str, torch.Tensor]] | None = None) -> None:
        nn.Module.__init__(self)
        self.num_experts, self.hidden_size, self.intermediate_size = int(num_experts), int(hidden_size), int(intermediate_size)
        self.alpha, self.limit = float(alpha), float(limit)
        self.formats = {w: formats[w] for w in ("w1", "w3", "w2")}
        for w, f in self.formats.items():
            if f not in SUFFIXES:
                raise ValueError(f"experts.{w}: unknown format {f!r}")
        self.compute_dtype = compute_dtype
        self.backend = backend
        E, H, I = self.num_experts, self.hidden_size, self.intermediate_size
        for w, shape in (("w1", (E, I, H)), ("w3", (E, I, H)), ("w2", (E, H, I))):
            self._register(f"{w}_", self.formats[w], shape, device, None if tensors is None else tensors[w])

    @classmethod
    def from_float(cls, experts: GroupedExperts, formats: Mapping[str, str], *, frozen=None, scale_rule: str = "rceil",
                   backend: str = "auto", name: str = "experts", compute_dtype: torch.dtype | None = None) -> "PackedExperts":
        """Pack stacked float experts; `frozen` = {w: frozen spec (see pack_weight)}."""
        frozen = frozen or {}
        ws = {"w1": experts.w1, "w3": experts.w3, "w2": experts.w2}
        gsh = expert_global_scales(ws, formats, frozen)
        tensors = {w: pack_weight(ws[w], formats[w], global_scale=gsh.get(w), frozen=frozen.get(w),
                                  scale_rule=scale_rule, backend=backend, name=f"{name}.{w}") for w in ws}
        return cls(experts.num_experts, experts.hidden_size, experts.intermediate_size, formats, alpha=experts.alpha,
                   limit=experts.limit, compute_dtype=compute_dtype or experts.w1.dtype, backend=backend, tensors=tensors)

    def packed_tensors(self, w: str) -> dict[str, torch.Tensor]:
        return self._tensors(f"{w}_", self.formats[w])

    def _deq(self, w: str, dtype: torch.dtype, idx: torch.Tensor | None = None) -> torch.Tensor:
        t = self.packed_tensors(w)
        if idx is not None:
            t = {k: v[idx] for k, v in t.items()}
        return unpack_weight(t, self.formats[w], dtype, backend=self.backend)

    def expert_weights(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dev = self.w1_weight.device.type
        dt = dtype or compute_dtype(dev, self.compute_dtype)
        return self._deq("w1", dt), self._deq("w3", dt), self._deq("w2", dt)

    # forward_naive (tests) reads these
    @property
    def w1(self) -> torch.Tensor:  # type: ignore[override]
        return self._deq("w1", self.compute_dtype)

    @property
    def w3(self) -> torch.Tensor:  # type: ignore[override]
        return self._deq("w3", self.compute_dtype)

    @property
    def w2(self) -> torch.Tensor:  # type: ignore[override]
        return self._deq("w2", self.compute_dtype)

    def uses_pairs(self, x: torch.Tensor, k: int) -> bool:
        """False where the packed grouped kernel runs (the pairs kernel would dequantize every expert)."""
        if self._kernel_path(x.shape[0] * k, x):
            return False
        return super().uses_pairs(x, k)

    def _kernel_path(self, pairs: int, x: torch.Tensor) -> bool:
        if any(f not in ("nvfp4", "mxfp8") for f in self.formats.values()):
            return False
        rows = pairs // max(1, min(self.num_experts, pairs))
        return packed_path("nvfp4", rows, x, self.backend) == "kernel"

    def forward(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        dt = compute_dtype(xs.device.type, self.compute_dtype)
        if self._kernel_path(xs.shape[0], xs):
            x = xs.to(dt)
            ts = {w: self.packed_tensors(w) for w in ("w1", "w3", "w2")}

            def mm(a: torch.Tensor, w: str) -> torch.Tensor:
                t = ts[w]
                return packed_grouped_mm(a, counts, t["weight"], t.get("weight_scale", t.get("weight_scale_inv")),
                                         t.get("weight_scale_2"), fmt=self.formats[w], backend=self.backend)

            return mm(swiglu_oai(mm(x, "w1"), mm(x, "w3"), self.alpha, self.limit), "w2")
        per_expert = 3 * self.hidden_size * self.intermediate_size * torch.empty((), dtype=dt).element_size()
        if per_expert * self.num_experts <= self.max_dequant_bytes:
            return GroupedExperts.forward(self, xs, counts)
        return self._forward_active(xs, counts, dt, max(1, self.max_dequant_bytes // per_expert))

    def _forward_active(self, xs: torch.Tensor, counts: torch.Tensor, dt: torch.dtype, chunk: int) -> torch.Tensor:
        cnt = [int(c) for c in counts.tolist()]  # one host sync
        active = [e for e, c in enumerate(cnt) if c > 0]
        if not active:
            return xs.new_zeros(0, self.hidden_size).to(dt) if xs.shape[0] == 0 else xs.to(dt) * 0
        starts, s = [], 0
        for c in cnt:
            starts.append(s)
            s += c
        outs = []
        for i in range(0, len(active), chunk):
            ids = active[i:i + chunk]
            r0, r1 = starts[ids[0]], starts[ids[-1]] + cnt[ids[-1]]
            idx = torch.tensor(ids, device=xs.device)
            c = counts[idx]
            offs = c.cumsum(0).to(torch.int32)
            x = xs[r0:r1].to(dt)
            w1, w3, w2 = (self._deq(w, dt, idx) for w in ("w1", "w3", "w2"))
            g = grouped_mm(x, w1.transpose(1, 2), c, offs)
            u = grouped_mm(x, w3.transpose(1, 2), c, offs)
            outs.append(grouped_mm(swiglu_oai(g, u, self.alpha, self.limit), w2.transpose(1, 2), c, offs))
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def reset_parameters(self, std: float = 0.02, out_std: float | None = None) -> None:
        raise RuntimeError("packed experts cannot be re-initialised (load or convert a model instead)")

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
                f"formats={self.formats}")


def packed_path(fmt: str, rows: int, x: torch.Tensor, backend: str) -> str:
    """How a packed weight of `fmt` multiplies `rows` rows of x (see KERNEL_MAX_ROWS):
    "kernel" (in-register dequantization) or "dequant" (dequantize-then-matmul: CPU, autograd
    through x, large batches, or CUDA without Triton, which warns once)."""
    if fmt not in ("nvfp4", "mxfp8") or (torch.is_grad_enabled() and x.requires_grad):
        return "dequant"
    if backend == "reference" or (x.device.type != "cuda" and backend == "auto"):
        return "dequant"
    if not use_triton("packed_gemm", backend, x.device):  # warns once on CUDA without Triton
        return "dequant"
    return "kernel" if rows <= KERNEL_MAX_ROWS else "dequant"


def expert_global_scales(ws: Mapping[str, torch.Tensor], formats: Mapping[str, str],
                         frozen: Mapping[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """NVFP4 global scales [E] of stacked experts by projection: w1 and w3 share the max of their
    amaxes when both are NVFP4 (fused gate/up), w2 has its own.  Frozen slices are overridden
    later by pack/fake-quantize."""
    out: dict[str, torch.Tensor] = {}
    if formats.get("w1") == "nvfp4" and formats.get("w3") == "nvfp4":
        g = nvfp4_global_scales(ws["w1"], ws["w3"])
        out["w1"] = out["w3"] = g
    for w in ("w1", "w3", "w2"):
        if formats.get(w) == "nvfp4" and w not in out:
            out[w] = nvfp4_global_scales(ws[w])
    return out

