"""Fused Triton kernels for MXFP8 and NVFP4: quantize, dequantize and fake-quantize
(quantize-dequantize in one pass, the QAT hot path), bit-exact with ``reference.py``.

Layout: a contiguous [..., K] tensor with K divisible by the block size is a contiguous
[n_blocks, BS] matrix (one row per quantization block), so no tile ever straddles a row of
the original tensor and no column mask is needed.  One program handles BR consecutive blocks
(a [BR, BS] tile, BR * BS ~ 4K elements): loads along BS are contiguous, 16-byte vectorizable,
and consecutive block rows are adjacent in memory, so a warp's accesses are fully coalesced.

Exactness, so that TRITON_INTERPRET=1 on CPU and compiled sm_90 code give the same bits:
* all E4M3 / E2M1 rounding is integer bit manipulation on the float32 bits (``_round_mag``),
  never ``.to(tl.float8e4nv)``: that cast is ``cvt.rn.satfinite`` on sm_90 but goes through an
  RTZ fp16 intermediate below sm_90, and the interpreter has its own emulation;
* bfloat16 is loaded and stored through int16 views with explicit RNE bit arithmetic: the
  interpreter's fp32->bf16 cast truncates, while the GPU's rounds to nearest even;
* divisions use ``tl.math.div_rn`` (``div.rn.f32``, IEEE): Triton lowers ``/`` on float32 to
  the approximate ``div.full.f32``;
* there are no float additions, so FMA contraction (``enable_fp_fusion``) cannot change any
  result; the products (x * 2^-e, code * scale, block_scale * global_scale) are plain IEEE
  multiplies, which Triton does not flush to zero (only libdevice calls are FTZ).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = [
    "mxfp8_quantize_triton",
    "mxfp8_dequantize_triton",
    "mxfp8_fake_quantize_triton",
    "nvfp4_quantize_triton",
    "nvfp4_dequantize_triton",
    "nvfp4_fake_quantize_triton",
]

NVFP4_BLOCK = 16

# Float element kinds passed to the kernels: float32 as is, bfloat16 as an int16 view, float16.
_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


# ----------------------------------------------------------------------------------------------
# Bit-level helpers (all int32 arithmetic on float32 bit patterns)
# ----------------------------------------------------------------------------------------------


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
    """Magnitude bits `a` (int32, a non-negative float32, finite or +inf) -> the bits of the
    nearest value (ties to even) of a small float format with MBITS mantissa bits and minimum
    normal exponent EMIN, saturated to the bit pattern MAXBITS.  Works for subnormal outputs:
    the result bits are ((e - EMIN) << MBITS) + n, where n includes the implicit bit, so a
    rounding carry moves into the exponent field by itself."""
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
def _e8m0_to_f32(b):
    """E8M0 bytes (int32 0..255) -> 2^(b - 127) as float32 (0 -> 2^-127, 255 -> NaN)."""
    bits = tl.where(b == 0, 0x00400000, b << 23)
    bits = tl.where(b == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_to_f32(c):
    """E2M1 codes (int32 0..15) -> float32 (code 8 -> -0.0)."""
    i = c & 7
    bits = (((i >> 1) + 126) << 23) | ((i & 1) << 22)  # 1, 1.5, 2, 3, 4, 6 for i = 2..7
    bits = tl.where(i == 1, 0x3F000000, bits)
    bits = tl.where(i == 0, 0, bits)
    return (bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)


# ----------------------------------------------------------------------------------------------
# MXFP8
# ----------------------------------------------------------------------------------------------


@triton.jit
def _mxfp8_quant_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    out_ptr,
    n_blocks,
    BS: tl.constexpr,
    BR: tl.constexpr,
    IN_KIND: tl.constexpr,
    OUT_KIND: tl.constexpr,
    FLOOR: tl.constexpr,
    FAKE: tl.constexpr,
):
    pid = tl.program_id(0)
    blk = pid.to(tl.int64) * BR + tl.arange(0, BR)
    bmask = blk < n_blocks
    offs = blk[:, None] * BS + tl.arange(0, BS)[None, :]
    mask = bmask[:, None]
    x = _load_f32(x_ptr, offs, mask, IN_KIND)
    xb = x.to(tl.int32, bitcast=True)
    amax = tl.max(xb & 0x7FFFFFFF, axis=1)  # non-negative float bits order like the values
    be = amax >> 23
    e = be - 135  # floor(log2 amax) - 8
    if not FLOOR:  # rceil: +1 when the mantissa of amax exceeds 1.75
        e += ((amax & 0x7FFFFF) > 0x600000).to(tl.int32)
    e = tl.where(be == 0, -127, e)  # float32-subnormal amax: clamp to the E8M0 minimum
    e = tl.minimum(tl.maximum(e, -127), 127)
    e = tl.where(amax == 0, 0, e)  # all-zero block: scale 1 (byte 127)
    factor = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2^-e, a normal float32
    q = x * factor[:, None]  # exact unless it underflows, and then it rounds to E4M3 zero
    mag = _round_mag(q.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 3, -6, 0x7E)
    code = mag | ((xb >> 24) & 0x80)
    if FAKE:
        scale = tl.where(e == -127, 0x00400000, (e + 127) << 23).to(tl.float32, bitcast=True)
        _store_f32(out_ptr, offs, _e4m3_to_f32(code) * scale[:, None], mask, OUT_KIND)
    else:
        tl.store(codes_ptr + offs, code.to(tl.uint8), mask=mask)
        tl.store(scales_ptr + blk, (e + 127).to(tl.uint8), mask=bmask)


@triton.jit
def _mxfp8_dequant_kernel(
    codes_ptr,
    scales_ptr,
    out_ptr,
    n_blocks,
    BS: tl.constexpr,
    BR: tl.constexpr,
    OUT_KIND: tl.constexpr,
):
    pid = tl.program_id(0)
    blk = pid.to(tl.int64) * BR + tl.arange(0, BR)
    bmask = blk < n_blocks
    offs = blk[:, None] * BS + tl.arange(0, BS)[None, :]
    mask = bmask[:, None]
    c = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.int32)
    s = tl.load(scales_ptr + blk, mask=bmask, other=127).to(tl.int32)
    out = _e4m3_to_f32(c) * _e8m0_to_f32(s)[:, None]
    _store_f32(out_ptr, offs, out, mask, OUT_KIND)


# ----------------------------------------------------------------------------------------------
# NVFP4
# ----------------------------------------------------------------------------------------------


@triton.jit
def _nvfp4_quant_kernel(
    x_ptr,
    gs_ptr,
    packed_ptr,
    scales_ptr,
    out_ptr,
    n_blocks,
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
    gs = tl.broadcast_to(tl.load(gs_ptr), [BR])
    gs_safe = tl.where(gs == 0, 1.0, gs)
    t = tl.math.div_rn(tl.math.div_rn(amax, tl.full([BR], 6.0, tl.float32)), gs_safe)
    t_bits = tl.where((amax_bits == 0) | (gs == 0), 0, t.to(tl.int32, bitcast=True))
    bs_bits = _round_mag(t_bits, 3, -6, 0x7E)
    bs = _e4m3_to_f32(bs_bits)
    d = bs * gs  # float32 decode scale of each block
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


@triton.jit
def _nvfp4_dequant_kernel(
    packed_ptr,
    scales_ptr,
    gs_ptr,
    out_ptr,
    n_blocks,
    BR: tl.constexpr,
    OUT_KIND: tl.constexpr,
):
    BS: tl.constexpr = 16
    pid = tl.program_id(0)
    blk = pid.to(tl.int64) * BR + tl.arange(0, BR)
    bmask = blk < n_blocks
    mask = bmask[:, None]
    poffs = blk[:, None] * (BS // 2) + tl.arange(0, BS // 2)[None, :]
    p = tl.load(packed_ptr + poffs, mask=mask, other=0).to(tl.int32)
    vals = tl.reshape(tl.join(_e2m1_to_f32(p & 15), _e2m1_to_f32(p >> 4)), [BR, BS])
    bs = _e4m3_to_f32(tl.load(scales_ptr + blk, mask=bmask, other=0).to(tl.int32))
    gs = tl.load(gs_ptr)
    out = (vals * bs[:, None]) * gs
    offs = blk[:, None] * BS + tl.arange(0, BS)[None, :]
    _store_f32(out_ptr, offs, out, mask, OUT_KIND)


# ----------------------------------------------------------------------------------------------
# Launchers (arguments are validated by msakit.quant.formats; tensors may be any leading shape)
# ----------------------------------------------------------------------------------------------


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _tile(n_blocks: int, bs: int, tile_elems: int | None) -> int:
    """Blocks per program: ~4K elements on GPU; larger tiles (fewer programs) when interpreting."""
    if tile_elems is None:
        tile_elems = 16384 if _interpreting() else 4096
    br = max(1, tile_elems // bs)
    return max(1, min(br, triton.next_power_of_2(max(n_blocks, 1))))


def _as_kernel_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _out_kind(dtype: torch.dtype) -> int:
    if dtype not in _KIND:
        raise ValueError(f"dtype must be one of float32, bfloat16, float16, got {dtype}")
    return _KIND[dtype]


def _launch_kwargs(num_warps: int | None) -> dict:
    return {} if num_warps is None else {"num_warps": num_warps}


def mxfp8_quantize_triton(
    x: torch.Tensor,
    *,
    block_size: int = 32,
    scale_rule: str = "rceil",
    tile_elems: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.contiguous()
    K = x.shape[-1]
    codes = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((*x.shape[:-1], K // block_size), dtype=torch.uint8, device=x.device)
    n_blocks = x.numel() // block_size
    if n_blocks:
        br = _tile(n_blocks, block_size, tile_elems)
        _mxfp8_quant_kernel[(triton.cdiv(n_blocks, br),)](
            _as_kernel_view(x), codes.view(torch.uint8), scales, codes.view(torch.uint8), n_blocks,
            BS=block_size, BR=br, IN_KIND=_KIND[x.dtype], OUT_KIND=0,
            FLOOR=scale_rule == "floor", FAKE=False, **_launch_kwargs(num_warps),
        )  # fmt: skip
    return codes, scales


def mxfp8_fake_quantize_triton(
    x: torch.Tensor,
    *,
    block_size: int = 32,
    scale_rule: str = "rceil",
    tile_elems: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    n_blocks = x.numel() // block_size
    if n_blocks:
        br = _tile(n_blocks, block_size, tile_elems)
        xv, ov = _as_kernel_view(x), _as_kernel_view(out)
        _mxfp8_quant_kernel[(triton.cdiv(n_blocks, br),)](
            xv, ov, ov, ov, n_blocks,
            BS=block_size, BR=br, IN_KIND=_KIND[x.dtype], OUT_KIND=_KIND[x.dtype],
            FLOOR=scale_rule == "floor", FAKE=True, **_launch_kwargs(num_warps),
        )  # fmt: skip
    return out


def mxfp8_dequantize_triton(
    codes: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    *,
    tile_elems: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    kind = _out_kind(dtype)
    codes, scales = codes.contiguous(), scales.contiguous()
    out = torch.empty(codes.shape, dtype=dtype, device=codes.device)
    n_blocks = scales.numel()
    if n_blocks:
        bs = codes.shape[-1] // scales.shape[-1]
        br = _tile(n_blocks, bs, tile_elems)
        _mxfp8_dequant_kernel[(triton.cdiv(n_blocks, br),)](
            codes.view(torch.uint8), scales, _as_kernel_view(out), n_blocks,
            BS=bs, BR=br, OUT_KIND=kind, **_launch_kwargs(num_warps),
        )  # fmt: skip
    return out


def nvfp4_quantize_triton(
    x: torch.Tensor,
    global_scale: torch.Tensor,
    *,
    tile_elems: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`global_scale`: float32 0-d tensor on x's device (computed by the caller)."""
    x = x.contiguous()
    K = x.shape[-1]
    packed = torch.empty((*x.shape[:-1], K // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty((*x.shape[:-1], K // NVFP4_BLOCK), dtype=torch.float8_e4m3fn, device=x.device)
    n_blocks = x.numel() // NVFP4_BLOCK
    if n_blocks:
        br = _tile(n_blocks, NVFP4_BLOCK, tile_elems)
        _nvfp4_quant_kernel[(triton.cdiv(n_blocks, br),)](
            _as_kernel_view(x), global_scale, packed, scales.view(torch.uint8), packed, n_blocks,
            BR=br, IN_KIND=_KIND[x.dtype], OUT_KIND=0, FAKE=False, **_launch_kwargs(num_warps),
        )  # fmt: skip
    return packed, scales


def nvfp4_fake_quantize_triton(
    x: torch.Tensor,
    global_scale: torch.Tensor,
    *,
    tile_elems: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    n_blocks = x.numel() // NVFP4_BLOCK
    if n_blocks:
        br = _tile(n_blocks, NVFP4_BLOCK, tile_elems)
        xv, ov = _as_kernel_view(x), _as_kernel_view(out)
        _nvfp4_quant_kernel[(triton.cdiv(n_blocks, br),)](
            xv, global_scale, ov, ov, ov, n_blocks,
            BR=br, IN_KIND=_KIND[x.dtype], OUT_KIND=_KIND[x.dtype], FAKE=True, **_launch_kwargs(num_warps),
        )  # fmt: skip
    return out


def nvfp4_dequantize_triton(
    packed: torch.Tensor,
    block_scales: torch.Tensor,
    global_scale: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    *,
    tile_elems: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    kind = _out_kind(dtype)
    packed, block_scales = packed.contiguous(), block_scales.contiguous()
    out = torch.empty((*packed.shape[:-1], packed.shape[-1] * 2), dtype=dtype, device=packed.device)
    n_blocks = block_scales.numel()
    if n_blocks:
        br = _tile(n_blocks, NVFP4_BLOCK, tile_elems)
        _nvfp4_dequant_kernel[(triton.cdiv(n_blocks, br),)](
            packed, block_scales.view(torch.uint8), global_scale, _as_kernel_view(out), n_blocks,
            BR=br, OUT_KIND=kind, **_launch_kwargs(num_warps),
        )  # fmt: skip
    return out
