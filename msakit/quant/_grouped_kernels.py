"""The Triton kernel behind QAT's routed-expert fake-quantization and packing: NVFP4 quantize /
fake-quantize of G stacked tensors with one global scale each (the experts of a layer: one
launch instead of G), the fake-quantized output written in float32 / bfloat16 / float16 (the
QAT cache is kept in the autocast dtype).

Self-contained on purpose: it uses the simple bit-exact device helpers of the formats' first
kernels (integer rounding on float32 bits, ``div.rn`` divisions, explicit RNE bfloat16 stores:
docs/formats.md, "Kernels") rather than the private internals of ``formats/triton.py``, which
are tuned independently.  The tests check it bit for bit against the reference under
TRITON_INTERPRET=1 and `benchmarks/qat.py` on CUDA.  Folding a per-group global scale into
``msakit.quant.formats.nvfp4_*`` would make it unnecessary.  Imported lazily (imports triton).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["nvfp4_grouped_triton"]

NVFP4_BLOCK = 16
_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _load_f32(ptr, offs, mask, KIND: tl.constexpr):
    if KIND == 1:  # bfloat16 through an int16 view: the float32 bits are bf16 << 16 (exact)
        b = tl.load(ptr + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
        return (b << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr + offs, mask=mask, other=0).to(tl.float32)


@triton.jit
def _store_f32(ptr, offs, v, mask, KIND: tl.constexpr):
    if KIND == 1:  # bfloat16, RNE, through an int16 view
        u = v.to(tl.int32, bitcast=True)
        mag = u & 0x7FFFFFFF
        mag = tl.where(mag > 0x7F800000, 0x7FC00000, mag)  # any NaN -> the quiet NaN 0x7FC0
        r = (mag + 0x7FFF + ((mag >> 16) & 1)) >> 16  # finite overflow rounds to inf (0x7F80)
        r = r | ((u >> 16) & 0x8000)
        tl.store(ptr + offs, r.to(tl.int16), mask=mask)
    elif KIND == 2:
        tl.store(ptr + offs, v.to(tl.float16), mask=mask)  # cvt.rn.f16.f32 / numpy: RNE
    else:
        tl.store(ptr + offs, v, mask=mask)


@triton.jit
def _round_mag(a, MBITS: tl.constexpr, EMIN: tl.constexpr, MAXBITS: tl.constexpr):
    """Magnitude bits `a` (int32, a non-negative float32) -> the bits of the nearest value (ties
    to even) of a float format with MBITS mantissa bits and minimum normal exponent EMIN,
    saturated to MAXBITS (subnormal outputs included: a rounding carry moves into the exponent)."""
    be = a >> 23
    E = tl.maximum(be, 1) - 127
    m = (a & 0x7FFFFF) | tl.where(be > 0, 0x800000, 0)  # a = m * 2^(E - 23)
    et = tl.maximum(E, EMIN)
    s = tl.minimum(23 - MBITS + et - E, 25)  # s = 25 already rounds every m < 2^24 to 0
    n = (m + ((1 << (s - 1)) - 1) + ((m >> s) & 1)) >> s
    return tl.minimum(((et - EMIN) << MBITS) + n, MAXBITS)


@triton.jit
def _e4m3_to_f32(c):
    """float8_e4m3fn bits (int32 0..255) -> float32 (0x7F/0xFF -> NaN, 0x80 -> -0.0)."""
    ef = (c >> 3) & 15
    mt = c & 7
    normal = ((ef + 120) << 23) | (mt << 20)
    sub = (mt.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)  # mt * 2^-9, exact
    mag = tl.where(ef == 0, sub, normal)
    mag = tl.where((c & 0x7F) == 0x7F, 0x7FC00000, mag)
    return (mag | ((c & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_to_f32(c):
    """E2M1 codes (int32 0..15) -> float32 (code 8 -> -0.0)."""
    i = c & 7
    bits = (((i >> 1) + 126) << 23) | ((i & 1) << 22)  # 1, 1.5, 2, 3, 4, 6 for i = 2..7
    bits = tl.where(i == 1, 0x3F000000, bits)
    bits = tl.where(i == 0, 0, bits)
    return (bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _nvfp4_grouped_kernel(
    x_ptr,
    gs_ptr,
    packed_ptr,
    scales_ptr,
    out_ptr,
    n_blocks,
    blocks_per_group,
    BR: tl.constexpr,
    IN_KIND: tl.constexpr,
    OUT_KIND: tl.constexpr,
    FAKE: tl.constexpr,
):
    BS: tl.constexpr = 16
    pid = tl.program_id(0)
    blk = pid.to(tl.int64) * BR + tl.arange(0, BR)
    bmask = blk < n_blocks
    offs = blk[:, None] * BS + tl.arange(0, BS)[None, :]
    mask = bmask[:, None]
    x = _load_f32(x_ptr, offs, mask, IN_KIND)
    xb = x.to(tl.int32, bitcast=True)
    amax_bits = tl.max(xb & 0x7FFFFFFF, axis=1)
    amax = amax_bits.to(tl.float32, bitcast=True)
    gs = tl.load(gs_ptr + blk // blocks_per_group, mask=bmask, other=1.0)  # this block's group scale
    gs_safe = tl.where(gs == 0, 1.0, gs)
    t = tl.math.div_rn(tl.math.div_rn(amax, tl.full([BR], 6.0, tl.float32)), gs_safe)
    t_bits = tl.where((amax_bits == 0) | (gs == 0), 0, t.to(tl.int32, bitcast=True))
    bs_bits = _round_mag(t_bits, 3, -6, 0x7E)
    bs = _e4m3_to_f32(bs_bits)
    d = bs * gs
    d_safe = tl.where(d == 0, 1.0, d)
    q = tl.math.div_rn(x, tl.broadcast_to(d_safe[:, None], [BR, BS]))
    q_bits = tl.where(d[:, None] == 0, 0, q.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    code = _round_mag(q_bits, 1, 0, 7) | ((xb >> 28) & 8)
    if FAKE:
        out = (_e2m1_to_f32(code) * bs[:, None]) * gs[:, None]
        _store_f32(out_ptr, offs, out, mask, OUT_KIND)
    else:
        lo, hi = tl.split(tl.reshape(code, [BR, BS // 2, 2]))
        poffs = blk[:, None] * (BS // 2) + tl.arange(0, BS // 2)[None, :]
        tl.store(packed_ptr + poffs, (lo | (hi << 4)).to(tl.uint8), mask=mask)
        tl.store(scales_ptr + blk, bs_bits.to(tl.uint8), mask=bmask)


def _view(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def nvfp4_grouped_triton(
    x: torch.Tensor, global_scales: torch.Tensor, *, fake: bool, out_dtype: torch.dtype | None = None
):
    """x [G, ...] (contiguous per group, K % 16 == 0), global_scales float32 [G] on x's device.
    fake=True -> fake-quantized x in `out_dtype` (x's dtype by default); else (packed uint8
    [..., K/2], block scales float8_e4m3fn [..., K/16])."""
    x = x.contiguous()
    G = x.shape[0]
    gs = global_scales.to(device=x.device, dtype=torch.float32).reshape(G).contiguous()
    n_blocks = x.numel() // NVFP4_BLOCK
    bpg = max(1, n_blocks // max(G, 1))
    tile = 16384 if os.environ.get("TRITON_INTERPRET", "0") == "1" else 4096  # elements per program
    br = max(1, min(tile // NVFP4_BLOCK, triton.next_power_of_2(max(n_blocks, 1))))
    grid = (triton.cdiv(n_blocks, br),) if n_blocks else None
    if fake:
        out_dtype = x.dtype if out_dtype is None else out_dtype
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
        if grid:
            ov = _view(out)
            _nvfp4_grouped_kernel[grid](
                _view(x), gs, ov, ov, ov, n_blocks, bpg,
                BR=br, IN_KIND=_KIND[x.dtype], OUT_KIND=_KIND[out_dtype], FAKE=True,
            )  # fmt: skip
        return out
    K = x.shape[-1]
    packed = torch.empty((*x.shape[:-1], K // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty((*x.shape[:-1], K // NVFP4_BLOCK), dtype=torch.float8_e4m3fn, device=x.device)
    if grid:
        _nvfp4_grouped_kernel[grid](
            _view(x), gs, packed, scales.view(torch.uint8), packed, n_blocks, bpg,
            BR=br, IN_KIND=_KIND[x.dtype], OUT_KIND=0, FAKE=False,
        )  # fmt: skip
    return packed, scales
