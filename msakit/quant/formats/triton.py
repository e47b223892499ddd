"""Fused Triton kernels for MXFP8 and NVFP4: quantize, dequantize and fake-quantize
(quantize-dequantize in one pass, the QAT hot path), bit-exact with ``reference.py``.

The kernels stream HBM: per element they spend a handful of instructions, so that the
memory system, not the issue rate, sets their speed.

Layout.  A contiguous [..., K] tensor with K divisible by the block size is a contiguous
[n_blocks, BS] matrix (one row per quantization block); a program handles BR consecutive
blocks, so no tile straddles a row of the original tensor and no column mask is needed.
* MXFP8 tiles are [BR, BS] element tiles (16-byte vector loads and stores along BS, adjacent
  rows adjacent in memory, the block amax a max over the row).
* NVFP4 kernels give each thread whole 16-element blocks: a 16-bit input block is 8 int32
  words (two elements each) read as two [BR, 4] halves (two 16-byte loads); the 8 packed
  bytes of a block are one int64; the per-block work (amax, scale, the E2M1 decision points,
  the dequantization table) is done once per block, by its thread.

NVFP4 without per-element divisions.  The code of |x| is the number of E2M1 thresholds
(> 0.25, >= 0.75, > 1.25, >= 1.75, > 2.5, >= 3.5, > 5) passed by the float32 quotient
q = RN(|x| / d), d = block_scale * global_scale.  q passes threshold i exactly when the exact
|x| / d exceeds the float32 rounding midpoint MID_i next to the threshold (on the midpoint
itself q rounds to the threshold, whose significand is even: the tie goes to the side the
rule needs).  A quotient of two float32 values is never exactly such a midpoint (that would
need 25 significant bits), so
    idx >= i  <=>  |x| > d * MID_i  <=>  |x| > RZ32(d * MID_i)  =: B_i
where d * MID_i (24 x 25 significant bits) is exact in float64 and RZ32 (round toward zero)
is one conversion.  For bfloat16 / float16 input |x| lies on the 16-bit grid, so the test is
the same against RD16(B_i), and it is done on both halves of a word at once with integer
SIMD arithmetic (a three-level binary search over the seven per-block bounds).  A block
whose d is 0 gets bounds +inf: magnitude code 0, as the reference.  Dequantization and
fake-quantization read the value of each code from a per-block table of the 8 magnitudes
RN_out((e2m1 * block_scale) * global_scale) and flip the sign bit.

The per-block divisions RN32(RN32(amax / 6) / global_scale) go through float64 products
with exact results (see _nvfp4_scale; a float32 amax / 6 uses ``div.rn.f32``).
``packed_compare="hset2"`` replaces the integer comparison of the 16-bit kernel by
``set.gt.u32.{bf16,f16}x2`` (fewer instructions, same bits; see _nvfp4_gt).

Exactness, so that TRITON_INTERPRET=1 on CPU and compiled sm_90 code give the same bits:
every device helper below has a GPU form (hardware conversions ``cvt.rn.satfinite.e4m3x2``,
``cvt.rn.f16x2.e4m3x2``, ``cvt.rn.{bf16,f16}x2.f32``, ``cvt.rz.f32.f64``, and the packed
integer instructions ``prmt.b32`` / ``lop3.b32`` / ``max.u16x2``) and an interpreter form
(integer emulations, the only ones the interpreter gets right: its float8 cast does not
round to nearest even and does not saturate, its fp32 -> bf16 cast truncates, its fma
rounds twice, and it has no inline assembly).  The emulations follow the PTX ISA
definitions; the CPU tests run the kernels' whole algorithm on them, a CUDA run of the same
tests checks the hardware forms.  Besides:
* ``tl.math.div_rn`` (``div.rn.f32``) where a float32 division remains: Triton lowers ``/``
  on float32 to the approximate ``div.full.f32``;
* no float additions feed a multiply (nothing for FMA contraction to fuse); products are
  plain IEEE multiplies, which Triton does not flush to zero (only libdevice calls are FTZ).

Per-group global scales: the NVFP4 quantize launchers also take a 1-D tensor of G global scales
(x's rows split into G equal groups; QAT's routed experts, one launch per layer).  The
``*_grouped_kernel`` entry points then load each block's scale (and take its reciprocal) per
block; the float32 one can also write bfloat16 / float16 fake-quantized output (one rounding of
the float32 value).  The kernels share their bodies with the single-scale ones.

Launch constexprs: EVEN (the grid covers the blocks exactly: no masks) and I64 (64-bit
offsets), set by the launchers; their defaults (masked, 64-bit) are always correct.  Per-block
[BR] loads and stores use _scalar_offs so that they keep the one-row-per-thread layout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from msakit.ops.dispatch import interpret_mode
from msakit.ops.packed_gemm.triton import e2m1_to_f32 as _e2m1_to_f32  # the packed GEMMs decode the same way
from msakit.ops.packed_gemm.triton import e4m3_bits_to_f32 as _e4m3_to_f32
from msakit.ops.packed_gemm.triton import e8m0_to_f32 as _e8m0_to_f32
from msakit.ops.packed_gemm.triton import nvfp4_decode_word as _nvfp4_decode_word  # one byte-table decode
from msakit.ops.packed_gemm.triton import prmt as _prmt  # one definition of the prmt twin

__all__ = [
    "mxfp8_quantize_triton",
    "mxfp8_dequantize_triton",
    "mxfp8_fake_quantize_triton",
    "nvfp4_quantize_triton",
    "nvfp4_dequantize_triton",
    "nvfp4_fake_quantize_triton",
    "nvfp4_amax_scale_triton",
    "default_tile_elems",
]

NVFP4_BLOCK = 16

# Float element kinds passed to the kernels: float32 as is, bfloat16 as an int16 view, float16.
_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

# Interpreted or compiled: fixed for the process (TRITON_INTERPRET=1 must be set before triton
# is imported).  Device helpers branch on it at compile time.
_INTERP = tl.constexpr(interpret_mode())

_SIGN2 = tl.constexpr(-0x7FFF8000)  # 0x80008000 as int32: the sign bits of a packed 16-bit pair

# NVFP4 decision midpoints (float64, exact): code index >= i  <=>  |x| / d > MID_i.
_MID1 = tl.constexpr(0.25 + 2.0**-26)  # q > 0.25   (tie -> 0)
_MID2 = tl.constexpr(0.75 - 2.0**-25)  # q >= 0.75  (tie -> 1)
_MID3 = tl.constexpr(1.25 + 2.0**-24)  # q > 1.25   (tie -> 1)
_MID4 = tl.constexpr(1.75 - 2.0**-24)  # q >= 1.75  (tie -> 2)
_MID5 = tl.constexpr(2.5 + 2.0**-23)  # q > 2.5    (tie -> 2)
_MID6 = tl.constexpr(3.5 - 2.0**-23)  # q >= 3.5   (tie -> 4)
_MID7 = tl.constexpr(5.0 + 2.0**-22)  # q > 5      (tie -> 4)


# ----------------------------------------------------------------------------------------------
# Bit-level helpers (integer forms)
# ----------------------------------------------------------------------------------------------


@triton.jit
def _load_f32(ptr, offs, mask, KIND: tl.constexpr):
    """Load float32 / bfloat16 (an int16 view) / float16 elements as float32 (exact).
    mask None: no mask."""
    if mask is None:
        v = tl.load(ptr + offs)
    else:
        v = tl.load(ptr + offs, mask=mask, other=0)
    if KIND == 1:
        if _INTERP:  # the float32 bits are bf16 << 16
            return ((v.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
        else:
            return v.to(tl.bfloat16, bitcast=True).to(tl.float32)
    else:
        return v.to(tl.float32)


@triton.jit
def _bf16_rne_bits(v):
    """float32 -> bfloat16 bits (int32 0..0xFFFF), round to nearest even, NaN -> 0x7FC0."""
    u = v.to(tl.int32, bitcast=True)
    mag = u & 0x7FFFFFFF
    mag = tl.where(mag > 0x7F800000, 0x7FC00000, mag)  # any NaN -> the quiet NaN 0x7FC0
    r = (mag + 0x7FFF + ((mag >> 16) & 1)) >> 16  # finite overflow rounds to inf (0x7F80)
    return r | ((u >> 16) & 0x8000)


@triton.jit
def _to16(v, KIND: tl.constexpr):
    """float32 -> the int16 bits of v rounded (RNE) to bfloat16 (KIND 1) or float16 (KIND 2)."""
    if KIND == 1:
        if _INTERP:  # the interpreter's fp32 -> bf16 cast truncates
            return _bf16_rne_bits(v).to(tl.int16)
        else:
            return v.to(tl.bfloat16).to(tl.int16, bitcast=True)  # cvt.rn.bf16x2.f32
    else:
        return v.to(tl.float16).to(tl.int16, bitcast=True)  # cvt.rn.f16.f32 / numpy: RNE


@triton.jit
def _pair16(hi, lo, KIND: tl.constexpr):
    """Two float32 -> one int32 word holding RN(lo) in its low and RN(hi) in its high 16 bits,
    as bfloat16 (KIND 1) or float16 (KIND 2): ``cvt.rn.{bf16,f16}x2.f32`` on the GPU."""
    if _INTERP:
        if KIND == 1:
            return _bf16_rne_bits(lo) | (_bf16_rne_bits(hi) << 16)
        else:
            return (_to16(lo, 2).to(tl.int32) & 0xFFFF) | (_to16(hi, 2).to(tl.int32) << 16)
    else:
        if KIND == 1:
            return tl.inline_asm_elementwise(
                "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f", [hi, lo], dtype=tl.int32, is_pure=True, pack=1
            )
        else:
            return tl.inline_asm_elementwise(
                "cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f", [hi, lo], dtype=tl.int32, is_pure=True, pack=1
            )


@triton.jit
def _store_f32(ptr, offs, v, mask, KIND: tl.constexpr):
    if KIND == 0:
        tl.store(ptr + offs, v, mask=mask)
    elif KIND == 1:  # bfloat16 through an int16 view
        tl.store(ptr + offs, _to16(v, 1), mask=mask)
    else:
        tl.store(ptr + offs, v.to(tl.float16), mask=mask)


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


# ----------------------------------------------------------------------------------------------
# Device helpers with a hardware (GPU) form and an integer (interpreter) form
# ----------------------------------------------------------------------------------------------


@triton.jit
def _e4m3_u8(v):
    """float32 -> float8_e4m3fn byte (uint8): RNE, saturating at 448, E4M3 subnormals kept,
    the sign bit of v kept (-0.0 and negatives that round to zero give 0x80)."""
    if _INTERP:
        vb = v.to(tl.int32, bitcast=True)
        return (_round_mag(vb & 0x7FFFFFFF, 3, -6, 0x7E) | ((vb >> 24) & 0x80)).to(tl.uint8)
    else:
        return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)  # cvt.rn.satfinite.e4m3x2.f32


@triton.jit
def _e4m3_f32(c):
    """float8_e4m3fn byte (uint8) -> float32 (exact; 0x7F/0xFF -> NaN)."""
    if _INTERP:
        return _e4m3_to_f32(c.to(tl.int32))
    else:
        return c.to(tl.float8e4nv, bitcast=True).to(tl.float32)  # cvt.rn.f16x2.e4m3x2 + cvt.f32.f16


@triton.jit
def _e4m3_rt(v):
    """float32 [BR] -> (float8_e4m3fn byte as int32, its float32 value), as _e4m3_u8 /
    _e4m3_f32, for per-block values: one element per thread, which Triton's paired fp8
    casts would first move through shared memory."""
    if _INTERP:
        c = _e4m3_u8(v).to(tl.int32)
        return c, _e4m3_to_f32(c)
    else:
        c = tl.inline_asm_elementwise(
            "{ .reg .b16 h; .reg .f32 z; mov.f32 z, 0f00000000;"
            " cvt.rn.satfinite.e4m3x2.f32 h, z, $1; cvt.u32.u16 $0, h; }",
            "=r,f", [v], dtype=tl.int32, is_pure=True, pack=1,
        )
        return c, _e4m3_dec1(c)


@triton.jit
def _e4m3_dec1(c):
    """float8_e4m3fn byte (int32 0..255) [BR] -> float32, for per-block values (see _e4m3_rt)."""
    if _INTERP:
        return _e4m3_to_f32(c)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; .reg .b32 p; cvt.u16.u32 lo, $1; cvt.rn.f16x2.e4m3x2 p, lo;"
            " mov.b32 {lo, hi}, p; cvt.f32.f16 $0, lo; }",
            "=f,r", [c], dtype=tl.float32, is_pure=True, pack=1,
        )


@triton.jit
def _sel(m, a, b):
    """Bitwise select (a & m) | (b & ~m): one ``lop3.b32`` (LUT 0xE4) on the GPU, written as
    assembly so that the compiler cannot split it into two-constant forms."""
    if _INTERP:
        return (a & m) | (b & ~m)
    else:
        return tl.inline_asm_elementwise(
            "lop3.b32 $0, $1, $2, $3, 0xE4;", "=r,r,r,r", [a, b, m], dtype=tl.int32, is_pure=True, pack=1
        )


@triton.jit
def _max_u16x2(a, b):
    """PTX ``max.u16x2``: the unsigned maximum of each 16-bit half of two int32 words."""
    if _INTERP:
        lo = tl.maximum(a & 0xFFFF, b & 0xFFFF)
        hi = tl.maximum((a >> 16) & 0xFFFF, (b >> 16) & 0xFFFF)
        return lo | (hi << 16)
    else:
        return tl.inline_asm_elementwise(
            "max.u16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1
        )


@triton.jit
def _rz_bits(z):
    """float64 z >= 0 (or +inf) -> the int32 bits of z rounded toward zero to float32
    (PTX ``cvt.rz.f32.f64``; finite values above the float32 range give its max)."""
    if _INTERP:
        f = z.to(tl.float32)  # round to nearest (numpy), then step down where it rounded up
        fb = f.to(tl.int32, bitcast=True)
        return tl.where(f.to(tl.float64) > z, fb - 1, fb)
    else:
        return tl.inline_asm_elementwise(
            "cvt.rz.f32.f64 $0, $1;", "=r,d", [z], dtype=tl.int32, is_pure=True, pack=1
        )


# ----------------------------------------------------------------------------------------------
# Tiles: EVEN (the grid covers n_blocks exactly: no masks) and I64 (64-bit offsets) are
# launch-time constexprs; their defaults (masked, 64-bit) are always correct.
# ----------------------------------------------------------------------------------------------


@triton.jit
def _rows(BR: tl.constexpr, I64: tl.constexpr):
    """The block indices [BR] of this program."""
    if I64:
        return tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    else:
        return tl.program_id(0) * BR + tl.arange(0, BR)


@triton.jit
def _st(ptr, v, mask):
    if mask is None:
        tl.store(ptr, v)
    else:
        tl.store(ptr, v, mask=mask)


@triton.jit
def _scalar_offs(blk):
    """blk, hidden from the alignment analysis (an identity mov), so that per-block loads and
    stores of [BR] vectors keep one element per thread, the layout of the rows they belong
    to, instead of a wider vector layout reached through shared memory."""
    if _INTERP:
        return blk
    elif blk.dtype == tl.int64:
        return tl.inline_asm_elementwise("mov.b64 $0, $1;", "=l,l", [blk], dtype=tl.int64, is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [blk], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _ld(ptr, mask, other):
    if mask is None:
        return tl.load(ptr)
    else:
        return tl.load(ptr, mask=mask, other=other)


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
    EVEN: tl.constexpr = False,
    I64: tl.constexpr = True,
):
    blk = _rows(BR, I64)
    bmask = None if EVEN else blk < n_blocks  # which blocks exist (EVEN: all, no mask)
    mask = None if EVEN else bmask[:, None]
    offs = blk[:, None] * BS + tl.arange(0, BS)[None, :]
    x = _load_f32(x_ptr, offs, mask, IN_KIND)
    amax = tl.max(tl.abs(x), axis=1)  # exact; as bits it is the max of the magnitude bits
    ab = amax.to(tl.int32, bitcast=True)
    be = ab >> 23
    e = be - 135  # floor(log2 amax) - 8
    if not FLOOR:  # rceil: +1 when the mantissa of amax exceeds 1.75
        e += ((ab & 0x7FFFFF) > 0x600000).to(tl.int32)
    e = tl.where(be == 0, -127, e)  # float32-subnormal amax: clamp to the E8M0 minimum
    e = tl.minimum(tl.maximum(e, -127), 127)
    e = tl.where(ab == 0, 0, e)  # all-zero block: scale 1 (byte 127)
    factor = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2^-e, a normal float32
    q = x * factor[:, None]  # exact unless it underflows, and then it rounds to E4M3 zero
    code = _e4m3_u8(q)
    if FAKE:
        scale = tl.where(e == -127, 0x00400000, (e + 127) << 23).to(tl.float32, bitcast=True)
        _store_f32(out_ptr, offs, _e4m3_f32(code) * scale[:, None], mask, OUT_KIND)
    else:
        _st(codes_ptr + offs, code, mask)
        _st(scales_ptr + _scalar_offs(blk), (e + 127).to(tl.uint8), bmask)


@triton.jit
def _mxfp8_dequant_kernel(
    codes_ptr,
    scales_ptr,
    out_ptr,
    n_blocks,
    BS: tl.constexpr,
    BR: tl.constexpr,
    OUT_KIND: tl.constexpr,
    EVEN: tl.constexpr = False,
    I64: tl.constexpr = True,
):
    blk = _rows(BR, I64)
    bmask = None if EVEN else blk < n_blocks  # which blocks exist (EVEN: all, no mask)
    mask = None if EVEN else bmask[:, None]
    offs = blk[:, None] * BS + tl.arange(0, BS)[None, :]
    if OUT_KIND != 0:  # codes per access = the elements of a 16-byte store: one layout, no shuffle
        c = _ld(codes_ptr + tl.max_contiguous(offs, [1, 8]), mask, 0)
    else:
        c = _ld(codes_ptr + tl.max_contiguous(offs, [1, 4]), mask, 0)
    s = _ld(scales_ptr + _scalar_offs(blk), bmask, 127).to(tl.int32)
    _store_f32(out_ptr, offs, _e4m3_f32(c) * _e8m0_to_f32(s)[:, None], mask, OUT_KIND)


# ----------------------------------------------------------------------------------------------
# NVFP4
# ----------------------------------------------------------------------------------------------


@triton.jit
def _recip64(gs):
    """1 / gs in float64 within 1.5 * 2^-52 (relative) for a float32 gs > 0, and 0 for
    gs == 0 (which makes every block scale 0, as the reference).  GPU: the hardware
    approximation and three Newton steps y += y * (1 - gs * y) (fma), each taking the
    relative error e to e^2 + 2^-53, so any start below 2^-6.5 ends there; once per thread.
    Interpreter: a division."""
    g = gs.to(tl.float64)
    if _INTERP:
        r = 1.0 / tl.where(gs == 0, 1.0, g)
    else:
        y = tl.inline_asm_elementwise(
            "rcp.approx.ftz.f64 $0, $1;", "=d,d", [g], dtype=tl.float64, is_pure=True, pack=1
        )
        y = tl.fma(y, tl.fma(-g, y, 1.0), y)
        y = tl.fma(y, tl.fma(-g, y, 1.0), y)
        r = tl.fma(y, tl.fma(-g, y, 1.0), y)
    return tl.where(gs == 0, 0.0, r)


@triton.jit
def _nvfp4_scale(amax, g64, AMAX16: tl.constexpr):
    """Block amax [BR] (float32 >= 0) and g64 = _recip64(global scale) -> (E4M3 block scale
    byte uint8 [BR], block scale float32 [BR]) = RNE_E4M3_sat(RN32(RN32(amax / 6) / gs)).

    Both float32 quotients a / b are computed as RN32(RN64(a * r)) with r within 1.5 * 2^-52
    of 1 / b, so within 2^-51 (relative) of a / b.  In the float32 normal range a / b is
    either a float32 or more than 2^-49 (relative) away from every float32 rounding midpoint
    (|a - m * b| is a nonzero multiple of 2^(e_m + e_b - 24) when the midpoint m has a 25-bit
    significand), so both roundings agree.  u = amax / 6 is done so only for a bfloat16 /
    float16 amax (AMAX16), whose subnormal quotients are exact too: an even multiple of
    2^-149 divided by 6 is never within 1/6 (in units of 2^-149) of an odd multiple of
    2^-150 (the subnormal midpoints); a float32 amax takes div.rn.  t = u / gs below the
    normal range gives block scale 0 either way, above it 448.  amax == 0 or gs == 0
    (g64 == 0) give t = 0."""
    if AMAX16:
        u = (amax.to(tl.float64) * tl.full(amax.shape, 1.0 / 6.0, tl.float64)).to(tl.float32)
    else:
        u = tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32))
    t = (u.to(tl.float64) * g64).to(tl.float32)
    code, bs = _e4m3_rt(t)
    return code.to(tl.uint8), bs


@triton.jit
def _nvfp4_bounds(d):
    """Decode scales d [BR] (float32 >= 0) -> the float32 bits of B_1..B_7 = RZ32(d * MID_i):
    code index >= i  <=>  |x| > B_i.  d == 0 gives +inf bounds (magnitude code 0)."""
    dd = tl.where(d == 0, float("inf"), d).to(tl.float64)
    b1 = _rz_bits(dd * tl.full(dd.shape, _MID1, tl.float64))
    b2 = _rz_bits(dd * tl.full(dd.shape, _MID2, tl.float64))
    b3 = _rz_bits(dd * tl.full(dd.shape, _MID3, tl.float64))
    b4 = _rz_bits(dd * tl.full(dd.shape, _MID4, tl.float64))
    b5 = _rz_bits(dd * tl.full(dd.shape, _MID5, tl.float64))
    b6 = _rz_bits(dd * tl.full(dd.shape, _MID6, tl.float64))
    b7 = _rz_bits(dd * tl.full(dd.shape, _MID7, tl.float64))
    return b1, b2, b3, b4, b5, b6, b7


@triton.jit
def _lane_bound(bits, KIND: tl.constexpr, CMP: tl.constexpr):
    """float32 bits of B >= 0 -> the 16-bit pattern L of the largest bfloat16 (KIND 1) /
    float16 (KIND 2) <= B (float16: 0x7C00 above its range), in both halves of an int32, plus
    0x10001 for the integer comparison (CMP 0).  For |x| on that grid, |x| > B <=> |x| > L."""
    if KIND == 1:
        if CMP == 0:
            return _prmt(bits + 0x10000, 0, 0x3232)  # (bits >> 16) + 1 in both halves
        else:
            return _prmt(bits, 0, 0x3232)
    else:
        f = bits.to(tl.float32, bitcast=True)
        sub = (tl.minimum(f, 6.103515625e-05) * 16777216.0).to(tl.int32)  # B < 2^-14: k * 2^-24
        lane = tl.minimum(tl.where(bits < 0x38800000, sub, (bits >> 13) - (112 << 10)), 0x7C00)
        if CMP == 0:
            return (lane + 1) * 0x10001
        else:
            return lane * 0x10001


@triton.jit
def _nvfp4_operand(w, CMP: tl.constexpr):
    """The word the comparisons take: sign bits forced to 1 (integer, CMP 0) or cleared (|x|)."""
    if CMP == 0:
        return w | _SIGN2
    else:
        return w & 0x7FFF7FFF


@triton.jit
def _hgt16x2(a, p, KIND: tl.constexpr):
    """PTX ``set.gt.u32.{bf16,f16}x2``: 0xFFFF in each half where the half of a is greater than
    the half of p (both non-negative, not NaN: the order of their bit patterns)."""
    if _INTERP:
        lo = tl.where((a & 0xFFFF) > (p & 0xFFFF), 0xFFFF, 0)
        hi = tl.where(((a >> 16) & 0xFFFF) > ((p >> 16) & 0xFFFF), -0x10000, 0)
        return lo | hi
    elif KIND == 1:
        return tl.inline_asm_elementwise(
            "set.gt.u32.bf16x2 $0, $1, $2;", "=r,r,r", [a, p], dtype=tl.int32, is_pure=True, pack=1
        )
    else:
        return tl.inline_asm_elementwise(
            "set.gt.u32.f16x2 $0, $1, $2;", "=r,r,r", [a, p], dtype=tl.int32, is_pure=True, pack=1
        )


@triton.jit
def _nvfp4_gt(ap, p, KIND: tl.constexpr, CMP: tl.constexpr):
    """Half masks (0xFFFF / 0) of |x_h| > L_h.

    CMP 0 (integer): ap = w | 0x80008000, p = (L + 1) in both halves; half h of ap - p is
    0x8000 + |x_h| - L_h - 1, in [0x7E, 0xFFFE] for every |x_h| <= 0x7FFF and L_h <= 0x7F80:
    no borrow crosses the halves and bit 15 of the half is |x_h| > L_h; prmt 0xBB99 spreads
    bits 15 and 31 over their halves.  CMP 1: one set.gt on |x| and L."""
    if CMP == 0:
        return _prmt(ap - p, 0, 0xBB99)
    else:
        return _hgt16x2(ap, p, KIND)


@triton.jit
def _nvfp4_search(ap, p1, p2, p3, p4, p5, p6, p7, KIND: tl.constexpr, CMP: tl.constexpr):
    """Packed 16-bit pairs (_nvfp4_operand) and the packed per-block bounds (_lane_bound) ->
    (m1, m2, b0): the E2M1 index of each half is 4 * b2 + 2 * b1 + b0, b2 and b1 the halves of
    the masks m1 and m2, b0 bit 15 / 31 of the word b0 (CMP 0: ap - bound) or the halves of
    the mask b0 (CMP 1).  A binary search over the seven bounds: b2 = idx >= 4, then b1
    against bound 6 or 2, then b0 against bound 7, 5, 3 or 1."""
    m1 = _nvfp4_gt(ap, p4, KIND, CMP)
    m2 = _nvfp4_gt(ap, _sel(m1, p6, p2), KIND, CMP)
    c3 = _sel(m1, _sel(m2, p7, p5), _sel(m2, p3, p1))
    if CMP == 0:
        return m1, m2, ap - c3
    else:
        return m1, m2, _hgt16x2(ap, c3, KIND)


@triton.jit
def _nvfp4_code_nibbles(w, m1, m2, b0, CMP: tl.constexpr):
    """-> a word with the 4-bit code (sign << 3 | index) of the low half at bits 12-15 and of
    the high half at bits 28-31 (other bits undefined): the sign bits already are there."""
    if CMP == 0:
        b0 = b0 >> 3  # bits 15 / 31 -> 12 / 28
    return _sel(0x60006000, _sel(0x40004000, m1, m2), _sel(_SIGN2, w, b0))


@triton.jit
def _col(x, c: tl.constexpr, N: tl.constexpr = 4):
    """Column c of a [BR, N] tile whose rows are held by one thread (a register pick)."""
    return tl.sum(tl.where((tl.arange(0, N) == c)[None, :], x, 0), axis=1)


@triton.jit
def _nvfp4_pack_half(r):
    """[BR, 4] words of code nibbles (bits 12-15, 28-31) -> [BR] int32 of 8 codes, element 2j
    in the low nibble of byte j: gather bytes 1 and 3 of the four words (prmt), then merge."""
    r0 = _col(r, 0)
    r1 = _col(r, 1)
    r2 = _col(r, 2)
    r3 = _col(r, 3)
    t01 = _prmt(r0, r1, 0x7351)  # [r1.b3, r0.b3, r1.b1, r0.b1]
    t23 = _prmt(r2, r3, 0x7351)
    x = _prmt(t01, t23, 0x5410)  # byte j: low-half code of word j in its high nibble
    y = _prmt(t01, t23, 0x7632)  # byte j: high-half code of word j in its high nibble
    return _sel(0x0F0F0F0F, x >> 4, y)


@triton.jit
def _nvfp4_fake_words(w, m1, m2, b0, v1, v2, v3, v4, v5, v6, v7, CMP: tl.constexpr):
    """-> the dequantized 16-bit pairs: table value v_idx (both halves of v_i hold it; v_0 = 0)
    chosen by the index bits, with the input's sign bit flipped in."""
    if CMP == 0:
        m3 = _prmt(b0, 0, 0xBB99)
    else:
        m3 = b0
    lo = _sel(m2, _sel(m3, v3, v2), v1 & m3)  # v_0 = 0
    hi = _sel(m2, _sel(m3, v7, v6), _sel(m3, v5, v4))
    return _sel(m1, hi, lo) ^ (w & _SIGN2)


@triton.jit
def _nvfp4_gs(gs_ptr, blk, bmask, bpg, GROUPED: tl.constexpr):
    """The decode global scale: one float32 (a scalar), or, GROUPED, the scale of each block's
    group (float32 [BR]: gs_ptr[blk // bpg], bpg blocks per group)."""
    if GROUPED:
        return _ld(gs_ptr + _scalar_offs(blk // bpg), bmask, 1.0)
    else:
        return tl.load(gs_ptr)


@triton.jit
def _nvfp4_quant16_kernel(
    x_ptr,  # int32 view of the bfloat16 / float16 input: 8 words (16 elements) per block
    gs_ptr,
    packed_ptr,  # int64 view of the packed codes: one word per block
    scales_ptr,
    out_ptr,  # int32 view of the 16-bit fake-quantized output
    n_blocks,
    BR: tl.constexpr,
    IN_KIND: tl.constexpr,
    OUT_KIND: tl.constexpr,
    FAKE: tl.constexpr,
    EVEN: tl.constexpr = False,
    I64: tl.constexpr = True,
    CMP: tl.constexpr = 0,  # 0: integer comparisons, 1: set.gt.{bf16,f16}x2 (see _nvfp4_gt)
):
    _nvfp4_quant16(x_ptr, gs_ptr, packed_ptr, scales_ptr, out_ptr, n_blocks, 1,
                   BR, IN_KIND, OUT_KIND, FAKE, EVEN, I64, CMP, False)  # fmt: skip


@triton.jit
def _nvfp4_quant16_grouped_kernel(
    x_ptr,
    gs_ptr,  # float32 [G]: one global scale per group of bpg consecutive blocks
    packed_ptr,
    scales_ptr,
    out_ptr,
    n_blocks,
    bpg,
    BR: tl.constexpr,
    IN_KIND: tl.constexpr,
    OUT_KIND: tl.constexpr,
    FAKE: tl.constexpr,
    EVEN: tl.constexpr = False,
    I64: tl.constexpr = True,
    CMP: tl.constexpr = 0,
):
    _nvfp4_quant16(x_ptr, gs_ptr, packed_ptr, scales_ptr, out_ptr, n_blocks, bpg,
                   BR, IN_KIND, OUT_KIND, FAKE, EVEN, I64, CMP, True)  # fmt: skip


@triton.jit
def _nvfp4_quant16(
    x_ptr, gs_ptr, packed_ptr, scales_ptr, out_ptr, n_blocks, bpg,
    BR: tl.constexpr, IN_KIND: tl.constexpr, OUT_KIND: tl.constexpr, FAKE: tl.constexpr,
    EVEN: tl.constexpr, I64: tl.constexpr, CMP: tl.constexpr, GROUPED: tl.constexpr,
):  # fmt: skip
    blk = _rows(BR, I64)
    bmask = None if EVEN else blk < n_blocks  # which blocks exist (EVEN: all, no mask)
    mask = None if EVEN else bmask[:, None]
    offs = blk[:, None] * 8 + tl.arange(0, 4)[None, :]
    w0 = _ld(x_ptr + offs, mask, 0)
    w1 = _ld(x_ptr + offs + 4, mask, 0)
    ap0 = _nvfp4_operand(w0, CMP)
    ap1 = _nvfp4_operand(w1, CMP)
    m = tl.reduce(_max_u16x2(ap0, ap1), 1, _max_u16x2)  # halves: max |x| (| 0x8000 for CMP 0)
    a16 = tl.maximum(m & 0xFFFF, (m >> 16) & 0xFFFF) & 0x7FFF  # the block amax, 16-bit pattern
    if IN_KIND == 1:
        amax = (a16 << 16).to(tl.float32, bitcast=True)
    else:
        amax = a16.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    gs = _nvfp4_gs(gs_ptr, blk, bmask, bpg, GROUPED)
    bs_code, bs = _nvfp4_scale(amax, _recip64(gs), True)
    b1, b2, b3, b4, b5, b6, b7 = _nvfp4_bounds(bs * gs)
    p1 = _lane_bound(b1, IN_KIND, CMP)[:, None]
    p2 = _lane_bound(b2, IN_KIND, CMP)[:, None]
    p3 = _lane_bound(b3, IN_KIND, CMP)[:, None]
    p4 = _lane_bound(b4, IN_KIND, CMP)[:, None]
    p5 = _lane_bound(b5, IN_KIND, CMP)[:, None]
    p6 = _lane_bound(b6, IN_KIND, CMP)[:, None]
    p7 = _lane_bound(b7, IN_KIND, CMP)[:, None]
    m1a, m2a, b0a = _nvfp4_search(ap0, p1, p2, p3, p4, p5, p6, p7, IN_KIND, CMP)
    m1b, m2b, b0b = _nvfp4_search(ap1, p1, p2, p3, p4, p5, p6, p7, IN_KIND, CMP)
    if FAKE:  # table of RN_out((e2m1_i * bs) * gs), in both halves
        v1 = _pair16((0.5 * bs) * gs, (0.5 * bs) * gs, OUT_KIND)[:, None]
        v2 = _pair16((1.0 * bs) * gs, (1.0 * bs) * gs, OUT_KIND)[:, None]
        v3 = _pair16((1.5 * bs) * gs, (1.5 * bs) * gs, OUT_KIND)[:, None]
        v4 = _pair16((2.0 * bs) * gs, (2.0 * bs) * gs, OUT_KIND)[:, None]
        v5 = _pair16((3.0 * bs) * gs, (3.0 * bs) * gs, OUT_KIND)[:, None]
        v6 = _pair16((4.0 * bs) * gs, (4.0 * bs) * gs, OUT_KIND)[:, None]
        v7 = _pair16((6.0 * bs) * gs, (6.0 * bs) * gs, OUT_KIND)[:, None]
        o0 = _nvfp4_fake_words(w0, m1a, m2a, b0a, v1, v2, v3, v4, v5, v6, v7, CMP)
        _st(out_ptr + offs, o0, mask)
        o1 = _nvfp4_fake_words(w1, m1b, m2b, b0b, v1, v2, v3, v4, v5, v6, v7, CMP)
        _st(out_ptr + offs + 4, o1, mask)
    else:
        h0 = _nvfp4_pack_half(_nvfp4_code_nibbles(w0, m1a, m2a, b0a, CMP))
        h1 = _nvfp4_pack_half(_nvfp4_code_nibbles(w1, m1b, m2b, b0b, CMP))
        word = h0.to(tl.uint32, bitcast=True).to(tl.int64) | (h1.to(tl.int64) << 32)
        bb = _scalar_offs(blk)
        _st(packed_ptr + bb, word, bmask)
        _st(scales_ptr + bb, bs_code, bmask)


@triton.jit
def _nvfp4_quant32_kernel(
    x_ptr,  # float32 input
    gs_ptr,
    packed_ptr,  # int64 view of the packed codes: one word per block
    scales_ptr,
    out_ptr,  # float32 fake-quantized output
    n_blocks,
    BR: tl.constexpr,
    FAKE: tl.constexpr,
    EVEN: tl.constexpr = False,
    I64: tl.constexpr = True,
):
    _nvfp4_quant32(x_ptr, gs_ptr, packed_ptr, scales_ptr, out_ptr, n_blocks, 1,
                   BR, FAKE, EVEN, I64, False, 0)  # fmt: skip


@triton.jit
def _nvfp4_quant32_grouped_kernel(
    x_ptr,  # float32 input
    gs_ptr,  # float32 [G]: one global scale per group of bpg consecutive blocks
    packed_ptr,
    scales_ptr,
    out_ptr,  # fake-quantized output: float32, bfloat16 (an int16 view) or float16 (OUT_KIND)
    n_blocks,
    bpg,
    BR: tl.constexpr,
    FAKE: tl.constexpr,
    EVEN: tl.constexpr = False,
    I64: tl.constexpr = True,
    OUT_KIND: tl.constexpr = 0,
):
    _nvfp4_quant32(x_ptr, gs_ptr, packed_ptr, scales_ptr, out_ptr, n_blocks, bpg,
                   BR, FAKE, EVEN, I64, True, OUT_KIND)  # fmt: skip


@triton.jit
def _nvfp4_quant32(
    x_ptr, gs_ptr, packed_ptr, scales_ptr, out_ptr, n_blocks, bpg,
    BR: tl.constexpr, FAKE: tl.constexpr, EVEN: tl.constexpr, I64: tl.constexpr,
    GROUPED: tl.constexpr, OUT_KIND: tl.constexpr,
):  # fmt: skip
    blk = _rows(BR, I64)
    bmask = None if EVEN else blk < n_blocks  # which blocks exist (EVEN: all, no mask)
    mask = None if EVEN else bmask[:, None]
    offs = blk[:, None] * 16 + tl.arange(0, 4)[None, :]
    x0 = _ld(x_ptr + offs, mask, 0.0)
    x1 = _ld(x_ptr + offs + 4, mask, 0.0)
    x2 = _ld(x_ptr + offs + 8, mask, 0.0)
    x3 = _ld(x_ptr + offs + 12, mask, 0.0)
    amax = tl.maximum(
        tl.maximum(tl.max(tl.abs(x0), axis=1), tl.max(tl.abs(x1), axis=1)),
        tl.maximum(tl.max(tl.abs(x2), axis=1), tl.max(tl.abs(x3), axis=1)),
    )
    gs = _nvfp4_gs(gs_ptr, blk, bmask, bpg, GROUPED)
    bs_code, bs = _nvfp4_scale(amax, _recip64(gs), False)
    b1, b2, b3, b4, b5, b6, b7 = _nvfp4_bounds(bs * gs)
    if FAKE:
        e1 = ((0.5 * bs) * gs).to(tl.int32, bitcast=True)[:, None]
        e2 = ((1.0 * bs) * gs).to(tl.int32, bitcast=True)[:, None]
        e3 = ((1.5 * bs) * gs).to(tl.int32, bitcast=True)[:, None]
        e4 = ((2.0 * bs) * gs).to(tl.int32, bitcast=True)[:, None]
        e5 = ((3.0 * bs) * gs).to(tl.int32, bitcast=True)[:, None]
        e6 = ((4.0 * bs) * gs).to(tl.int32, bitcast=True)[:, None]
        e7 = ((6.0 * bs) * gs).to(tl.int32, bitcast=True)[:, None]
    quarters = (x0, x1, x2, x3)
    word = tl.zeros([BR], dtype=tl.int64)
    for qi in tl.static_range(4):
        xb = quarters[qi].to(tl.int32, bitcast=True)
        a = xb & 0x7FFFFFFF
        m1 = a > b4[:, None]
        m2 = a > tl.where(m1, b6[:, None], b2[:, None])
        m3 = a > tl.where(m1, tl.where(m2, b7[:, None], b5[:, None]), tl.where(m2, b3[:, None], b1[:, None]))
        if FAKE:
            lo = tl.where(m2, tl.where(m3, e3, e2), tl.where(m3, e1, 0))
            hi = tl.where(m2, tl.where(m3, e7, e6), tl.where(m3, e5, e4))
            v = (tl.where(m1, hi, lo) ^ (xb & -0x80000000)).to(tl.float32, bitcast=True)
            if OUT_KIND == 0:
                _st(out_ptr + offs + 4 * qi, v, mask)
            else:  # one rounding of the float32 value (RN is sign-symmetric)
                _st(out_ptr + offs + 4 * qi, _to16(v, OUT_KIND), mask)
        else:
            code = (m1.to(tl.int32) * 4 + m2.to(tl.int32) * 2 + m3.to(tl.int32)) | ((xb >> 28) & 8)
            nib = tl.sum(code << (tl.arange(0, 4) * 4)[None, :], axis=1)
            word = word | (nib.to(tl.int64) << (16 * qi))
    if not FAKE:
        bb = _scalar_offs(blk)
        _st(packed_ptr + bb, word, bmask)
        _st(scales_ptr + bb, bs_code, bmask)


@triton.jit
def _nvfp4_deq_words(p, l0, l1, h0, h1):
    """One packed word p (8 codes, element k in nibble k) and the table bytes (l0, l1: low
    bytes of v_0..v_7; h0, h1: high bytes) -> [BR, 4] output words (16-bit pairs), by the packed
    GEMM's decode (`msakit.ops.packed_gemm.triton.nvfp4_decode_word`: prmt lookups, the sign
    flipped into the high byte)."""
    o0, o1, o2, o3 = _nvfp4_decode_word(p, l0, l1, h0, h1)
    return tl.reshape(tl.join(tl.join(o0, o2), tl.join(o1, o3)), [o0.shape[0], 4])


@triton.jit
def _nvfp4_block_loads(packed_ptr, scales_ptr, blk, bmask):
    """Per block: the packed word (int64, 16 codes) and the decoded E4M3 block scale (float32)."""
    bb = _scalar_offs(blk)
    pw = _ld(packed_ptr + bb, bmask, 0)
    return pw, _e4m3_dec1(_ld(scales_ptr + bb, bmask, 0).to(tl.int32))


@triton.jit
def _nvfp4_dequant16_kernel(
    packed_ptr,  # int64 view: one word (16 codes) per block
    scales_ptr,
    gs_ptr,
    out_ptr,  # int32 view of the bfloat16 / float16 output
    n_blocks,
    BR: tl.constexpr,
    OUT_KIND: tl.constexpr,
    EVEN: tl.constexpr = False,
    I64: tl.constexpr = True,
):
    blk = _rows(BR, I64)
    bmask = None if EVEN else blk < n_blocks  # which blocks exist (EVEN: all, no mask)
    mask = None if EVEN else bmask[:, None]
    pw, bs = _nvfp4_block_loads(packed_ptr, scales_ptr, blk, bmask)
    gs = tl.load(gs_ptr)
    # table v_i = RN_out((e2m1_i * bs) * gs) (v_0 = +-0, or NaN for a NaN scale), as words
    # of pairs, then split into low bytes (l0: v_0..v_3, l1: v_4..v_7) and high bytes
    w01 = _pair16((0.5 * bs) * gs, (0.0 * bs) * gs, OUT_KIND)
    w23 = _pair16((1.5 * bs) * gs, (1.0 * bs) * gs, OUT_KIND)
    w45 = _pair16((3.0 * bs) * gs, (2.0 * bs) * gs, OUT_KIND)
    w67 = _pair16((6.0 * bs) * gs, (4.0 * bs) * gs, OUT_KIND)
    l0 = _prmt(w01, w23, 0x6420)
    h0 = _prmt(w01, w23, 0x7531)
    l1 = _prmt(w45, w67, 0x6420)
    h1 = _prmt(w45, w67, 0x7531)
    offs = blk[:, None] * 8 + tl.arange(0, 4)[None, :]
    _st(out_ptr + offs, _nvfp4_deq_words(pw.to(tl.int32), l0, l1, h0, h1), mask)
    _st(out_ptr + offs + 4, _nvfp4_deq_words((pw >> 32).to(tl.int32), l0, l1, h0, h1), mask)


@triton.jit
def _nvfp4_dequant32_kernel(
    packed_ptr,  # int64 view: one word (16 codes) per block
    scales_ptr,
    gs_ptr,
    out_ptr,  # float32 output
    n_blocks,
    BR: tl.constexpr,
    EVEN: tl.constexpr = False,
    I64: tl.constexpr = True,
):
    blk = _rows(BR, I64)
    bmask = None if EVEN else blk < n_blocks  # which blocks exist (EVEN: all, no mask)
    mask = None if EVEN else bmask[:, None]
    pw, bs = _nvfp4_block_loads(packed_ptr, scales_ptr, blk, bmask)
    bs = bs[:, None]
    gs = tl.load(gs_ptr)
    offs = blk[:, None] * 16 + tl.arange(0, 4)[None, :]
    for qi in tl.static_range(4):
        code = ((pw[:, None] >> (16 * qi + 4 * tl.arange(0, 4)[None, :])) & 15).to(tl.int32)
        _st(out_ptr + offs + 4 * qi, (_e2m1_to_f32(code) * bs) * gs, mask)


# ----------------------------------------------------------------------------------------------
# NVFP4 global scale: amax(|x|) in one read (a drop-in for torch.aminmax in _amax_scale)
# ----------------------------------------------------------------------------------------------


@triton.jit
def _absmax_kernel(x_ptr, part_ptr, n, BLOCK: tl.constexpr, KIND: tl.constexpr, EVEN: tl.constexpr, I64: tl.constexpr):
    """Per-program max of |x| as float32 bits (non-negative floats order like their bits, NaN
    above inf): x_ptr is an int32 view of float32 or an int16 view of bfloat16 / float16."""
    pid = tl.program_id(0)
    if I64:
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    else:
        offs = pid * BLOCK + tl.arange(0, BLOCK)
    if EVEN:
        v = tl.load(x_ptr + offs)
    else:
        v = tl.load(x_ptr + offs, mask=offs < n, other=0)
    if KIND == 0:
        m = tl.max(v & 0x7FFFFFFF, axis=0)
    else:
        m = tl.max(v.to(tl.int32) & 0x7FFF, axis=0)
        if KIND == 1:
            m = m << 16
        else:
            m = m.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32).to(tl.int32, bitcast=True)
    tl.store(part_ptr + pid, m)


@triton.jit
def _absmax_finish_kernel(part_ptr, out_ptr, n_parts, BLOCK: tl.constexpr):
    """out[0] = amax (float32), out[1] = amax / 2688 (div.rn: IEEE, as the reference)."""
    m = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, n_parts, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = tl.maximum(m, tl.load(part_ptr + offs, mask=offs < n_parts, other=0))
    amax = tl.broadcast_to(tl.max(m, axis=0), [1]).to(tl.float32, bitcast=True)
    gs = tl.math.div_rn(amax, tl.full([1], 2688.0, tl.float32))
    tl.store(out_ptr + tl.arange(0, 1), amax)
    tl.store(out_ptr + 1 + tl.arange(0, 1), gs)


def nvfp4_amax_scale_triton(x: torch.Tensor, *, block: int = 16384) -> tuple[torch.Tensor, torch.Tensor]:
    """(amax(|x|) float32 0-d, amax / 2688 float32 0-d) in two launches (one read of x, then a
    reduction of the per-program maxima), bit-exact with nvfp4_global_scale_ref (and with
    msakit.quant.formats._amax_scale); NaN in x gives a NaN amax, inf an inf amax."""
    out = torch.zeros(2, dtype=torch.float32, device=x.device)
    n = x.numel()
    if n:
        x = x.contiguous()
        xv = x.view(torch.int32) if x.dtype == torch.float32 else x.view(torch.int16)
        grid = triton.cdiv(n, block)
        part = torch.empty(grid, dtype=torch.int32, device=x.device)
        _absmax_kernel[(grid,)](
            xv, part, n, BLOCK=block, KIND=_KIND[x.dtype], EVEN=n % block == 0, I64=n + block >= 2**31, num_warps=8
        )
        _absmax_finish_kernel[(1,)](part, out, grid, BLOCK=1024)
    return out[0], out[1]


# ----------------------------------------------------------------------------------------------
# Launchers (arguments are validated by msakit.quant.formats; tensors may be any leading shape)
# ----------------------------------------------------------------------------------------------


# Default elements per program on GPU, per kernel family (the interpreter uses 16K everywhere);
# None: 4K, for kernels built on these helpers elsewhere.
# NVFP4's 2048 comes from a tile sweep on an H200 at 8192 x 8192 (benchmarks/NOTES.md, "Format
# kernels: tile size"): it lifts dequantize from 54% to 82% of the copy ceiling and fake-quantize
# from 79% to 98%; quantize stays at 84-87%.
_DEFAULT_TILE = {"mxfp8": 8192, "nvfp4": 2048, None: 4096}


def default_tile_elems(family: str | None) -> int:
    return 16384 if interpret_mode() else _DEFAULT_TILE[family]


def _tile(n_blocks: int, bs: int, tile_elems: int | None, family: str | None = None) -> int:
    """Blocks per program (a power of two): tile_elems // bs, at most n_blocks rounded up."""
    if tile_elems is None:
        tile_elems = default_tile_elems(family)
    br = max(1, triton.next_power_of_2(max(1, tile_elems // bs)))
    return max(1, min(br, triton.next_power_of_2(max(n_blocks, 1))))


def _as_kernel_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _aligned(t: torch.Tensor, align: int) -> torch.Tensor:
    """t (contiguous), copied when its data pointer is not a multiple of `align` bytes (needed
    for the int32 / int64 views the NVFP4 kernels read and write)."""
    return t if t.data_ptr() % align == 0 else t.clone()


def _out_kind(dtype: torch.dtype) -> int:
    if dtype not in _KIND:
        raise ValueError(f"dtype must be one of float32, bfloat16, float16, got {dtype}")
    return _KIND[dtype]


def _launch_kwargs(num_warps: int | None, n_blocks: int | None = None, br: int = 1, bs: int = 1) -> dict:
    """num_warps (None: Triton's default of 4) and, given the grid, the EVEN (no masks) and I64
    (64-bit offsets: the largest offset a program may form is (n_blocks + br) * bs elements)
    constexprs of the kernels below."""
    kw = {} if num_warps is None else {"num_warps": num_warps}
    if n_blocks is not None:
        kw["EVEN"] = n_blocks % br == 0
        kw["I64"] = (n_blocks + br) * bs >= 2**31
    return kw


def mxfp8_quantize_triton(
    x: torch.Tensor,
    *,
    scale_block_size: int = 32,
    scale_rule: str = "rceil",
    tile_elems: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.contiguous()
    K = x.shape[-1]
    codes = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((*x.shape[:-1], K // scale_block_size), dtype=torch.uint8, device=x.device)
    n_blocks = x.numel() // scale_block_size
    if n_blocks:
        br = _tile(n_blocks, scale_block_size, tile_elems, "mxfp8")
        _mxfp8_quant_kernel[(triton.cdiv(n_blocks, br),)](
            _as_kernel_view(x), codes.view(torch.uint8), scales, codes.view(torch.uint8), n_blocks,
            BS=scale_block_size, BR=br, IN_KIND=_KIND[x.dtype], OUT_KIND=0,
            FLOOR=scale_rule == "floor", FAKE=False, **_launch_kwargs(num_warps, n_blocks, br, scale_block_size),
        )  # fmt: skip
    return codes, scales


def mxfp8_fake_quantize_triton(
    x: torch.Tensor,
    *,
    scale_block_size: int = 32,
    scale_rule: str = "rceil",
    tile_elems: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    n_blocks = x.numel() // scale_block_size
    if n_blocks:
        br = _tile(n_blocks, scale_block_size, tile_elems, "mxfp8")
        xv, ov = _as_kernel_view(x), _as_kernel_view(out)
        _mxfp8_quant_kernel[(triton.cdiv(n_blocks, br),)](
            xv, ov, ov, ov, n_blocks,
            BS=scale_block_size, BR=br, IN_KIND=_KIND[x.dtype], OUT_KIND=_KIND[x.dtype],
            FLOOR=scale_rule == "floor", FAKE=True, **_launch_kwargs(num_warps, n_blocks, br, scale_block_size),
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
        br = _tile(n_blocks, bs, tile_elems, "mxfp8")
        _mxfp8_dequant_kernel[(triton.cdiv(n_blocks, br),)](
            codes.view(torch.uint8), scales, _as_kernel_view(out), n_blocks,
            BS=bs, BR=br, OUT_KIND=kind, **_launch_kwargs(num_warps, n_blocks, br, bs),
        )  # fmt: skip
    return out


_COMPARES = {"int": 0, "hset2": 1}


def _nvfp4_group_scales(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, int]:
    """global_scale -> (float32 scales on x's device, blocks per group; 0: one scale for all).
    One element: a single global scale.  A 1-D tensor of G > 1 entries: the rows of x (x viewed
    as [rows, K]) split into G equal groups of consecutive rows, group g using global_scale[g]
    (for x [G, N, K]: slice g is quantized with global_scale[g])."""
    gs = global_scale.detach().to(device=x.device, dtype=torch.float32)
    G = gs.numel()
    if G == 1:
        return gs.reshape(()), 0
    if gs.dim() != 1:
        raise ValueError(f"global_scale must have one element or be 1-D (one per group), got shape {tuple(gs.shape)}")
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    if G == 0 or rows % G:
        raise ValueError(f"{G} global scales do not split the {rows} rows of x into equal groups")
    return gs.contiguous(), max(1, x.numel() // NVFP4_BLOCK // G)


def _nvfp4_quant_launch(x, global_scale, packed, scales, out, fake, tile_elems, num_warps, packed_compare,
                        out_kind=None):  # fmt: skip
    """out_kind (fake only): the output's kind, x's by default; float32 x may write 16-bit
    output (out an int16 view), 16-bit x another 16-bit kind (out an int32 view)."""
    if packed_compare not in _COMPARES:
        raise ValueError(f"packed_compare must be one of {tuple(_COMPARES)}, got {packed_compare!r}")
    n_blocks = x.numel() // NVFP4_BLOCK
    if not n_blocks:
        return
    gs, bpg = _nvfp4_group_scales(x, global_scale)
    br = _tile(n_blocks, NVFP4_BLOCK, tile_elems, "nvfp4")
    grid = (triton.cdiv(n_blocks, br),)
    kw = _launch_kwargs(num_warps, n_blocks, br, NVFP4_BLOCK)
    kind = _KIND[x.dtype]
    out_kind = kind if out_kind is None else out_kind
    if x.dtype == torch.float32:
        if bpg or out_kind != 0:
            _nvfp4_quant32_grouped_kernel[grid](
                x, gs, packed, scales, out, n_blocks, bpg or n_blocks, BR=br, FAKE=fake, OUT_KIND=out_kind, **kw
            )
        else:
            _nvfp4_quant32_kernel[grid](x, gs, packed, scales, out, n_blocks, BR=br, FAKE=fake, **kw)
    else:
        if out_kind == 0:
            raise ValueError("16-bit input with float32 output: quantize x.float() instead")
        xv = _aligned(x, 4).view(torch.int32)
        if bpg:
            _nvfp4_quant16_grouped_kernel[grid](
                xv, gs, packed, scales, out, n_blocks, bpg,
                BR=br, IN_KIND=kind, OUT_KIND=out_kind, FAKE=fake, CMP=_COMPARES[packed_compare], **kw,
            )  # fmt: skip
        else:
            _nvfp4_quant16_kernel[grid](
                xv, gs, packed, scales, out, n_blocks,
                BR=br, IN_KIND=kind, OUT_KIND=out_kind, FAKE=fake, CMP=_COMPARES[packed_compare], **kw,
            )  # fmt: skip


def nvfp4_quantize_triton(
    x: torch.Tensor,
    global_scale: torch.Tensor,
    *,
    tile_elems: int | None = None,
    num_warps: int | None = None,
    packed_compare: str = "int",
) -> tuple[torch.Tensor, torch.Tensor]:
    """`global_scale`: float32 0-d tensor on x's device (computed by the caller), or a 1-D
    tensor of G scales, one per group of rows (see _nvfp4_group_scales).
    `packed_compare` ("int" or "hset2"): how the bfloat16 / float16 kernel compares packed
    halves with the block bounds (same bits; "hset2" uses set.gt.{bf16,f16}x2)."""
    x = x.contiguous()
    K = x.shape[-1]
    packed = torch.empty((*x.shape[:-1], K // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty((*x.shape[:-1], K // NVFP4_BLOCK), dtype=torch.float8_e4m3fn, device=x.device)
    pv, sv = packed.view(torch.int64), scales.view(torch.uint8)
    _nvfp4_quant_launch(x, global_scale, pv, sv, pv, False, tile_elems, num_warps, packed_compare)
    return packed, scales


def nvfp4_fake_quantize_triton(
    x: torch.Tensor,
    global_scale: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    tile_elems: int | None = None,
    num_warps: int | None = None,
    packed_compare: str = "int",
) -> torch.Tensor:
    """dequantize(quantize(x)) in `out_dtype` (x's dtype by default): the float32 value
    (e2m1 * block_scale) * global_scale rounded once.  `global_scale` as nvfp4_quantize_triton
    (one scale, or a 1-D tensor of one scale per group of rows)."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    out_kind = _out_kind(out_dtype)
    if x.dtype != torch.float32 and out_kind == 0:
        x = x.float()  # exact; the float32 kernel writes float32
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if x.dtype == torch.float32:
        ov = out if out_kind == 0 else out.view(torch.int16)
    else:
        ov = out.view(torch.int32)
    _nvfp4_quant_launch(x, global_scale, ov, ov, ov, True, tile_elems, num_warps, packed_compare, out_kind)
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
    packed, block_scales = _aligned(packed.contiguous(), 8), block_scales.contiguous()
    out = torch.empty((*packed.shape[:-1], packed.shape[-1] * 2), dtype=dtype, device=packed.device)
    n_blocks = block_scales.numel()
    if n_blocks:
        br = _tile(n_blocks, NVFP4_BLOCK, tile_elems, "nvfp4")
        grid = (triton.cdiv(n_blocks, br),)
        pv, sv = packed.view(torch.int64), block_scales.view(torch.uint8)
        kw = _launch_kwargs(num_warps, n_blocks, br, NVFP4_BLOCK)
        if kind == 0:
            _nvfp4_dequant32_kernel[grid](pv, sv, global_scale, out, n_blocks, BR=br, **kw)
        else:
            _nvfp4_dequant16_kernel[grid](
                pv, sv, global_scale, out.view(torch.int32), n_blocks, BR=br, OUT_KIND=kind, **kw
            )
    return out
