"""Packed-weight GEMMs in Triton (meaning: `reference.py`).

`_grouped_kernel`: y = x @ dequant(w[g]).T per group, the weight dequantized in registers
(weight-only: W4A16 for NVFP4, W8A16 for MXFP8; Hopper has no block-scaled MMA).  A program
owns one BLOCK_M-row tile of one group, BLOCK_N output columns and one K split:

* tile slots: the grid's first axis enumerates the groups' row tiles in order, found in the
  kernel from the counts (each program loads the G counts, a cumulative sum over their tile
  counts gives its group and first row): no host sync, so the launch is CUDA-graph safe.  The
  grid has cdiv(M, BLOCK_M) + min(G, M) slots (an upper bound of the tiles); the rest return.
* NVFP4 K step: BLOCK_K/2 code bytes per weight row; the low and high nibbles are the even and
  odd columns, multiplied by x's even and odd columns (two dots, no interleave of the weight
  tile).  Each code is decoded to its E2M1 magnitude with integer ops, times its block's E4M3
  scale (exact in float32), times the group's global scale (one float32 rounding), rounded to
  x's dtype: the `unpack_weight` value, bit for bit.
* MXFP8 K step (float32 / float16 x, and the fallback of `_mxfp8_grouped_kernel`): E4M3 codes
  times 2^(E8M0 - 127), rounded to x's dtype.  bfloat16 (`_mxfp8_tile`): the codes converted
  to bfloat16 four at a time (exact), then one `mul.rn.bf16x2` by the scale in bfloat16: the
  single rounding the reference makes.
* split-K (decode: a few groups of a few rows cannot fill the GPU otherwise) writes float32
  partials [S, M, N] that the launcher sums; without split the tile is stored in x's dtype.

`_nvfp4_grouped_kernel`: the NVFP4 path for bfloat16 / float16 x (same tile slots and split-K).
The codes are read as int32 words; per 16-weight block a table of the 8 dequantized magnitudes
(low bytes and high bytes, two registers each) is built once, and each word of 8 codes becomes
4 pairs of 16-bit weights by `prmt` lookups (15 instructions per 8 weights, inline PTX with a
pure-`tl` twin under the interpreter).  Bit-exact with `reference.py`; docs/packed.md has the
argument and the instruction counts.  The weight tile is the MMA's first operand (y.T = w @ x.T).

`_mxfp8_grouped_kernel`: MXFP8 with bfloat16 x at <= 32 rows per tile, on float16 tensor cores
(same tile slots and split-K).  `_x_f16_kernel` first writes x16 = RN_f16(x * 2^-e) per row, e
chosen so that the row's largest finite |x| lies in [2^14, 2^15) (exact but for values below
2^-38 of the row's largest; inf / NaN kept).  Per 32-wide K chunk the codes become float16 (two
`cvt.rn.f16x2.e4m3x2` per 4 codes: exact, NaN kept), one float16 MMA of K = 32 (the weight tile
the first operand, mma.sync at 2 warps) gives a float32 partial, and the partial times its
column's scale 2^(E8M0 - 127) (built as float32 bits, exact) is added to the accumulator; the
result times 2^e per row.  No weight is rounded: the result is the exact product up to the
float32 accumulation (not bit-identical to `reference.py`, which rounds code * scale to
bfloat16 and sums in another order).  This path runs when every scale of the program's columns
and K split lies in [MX_F16_LO, MX_F16_HI] = [11, 200] (a scan before the K loop): there the
reference's weights are exact in bfloat16, no scaled partial needs a float32 subnormal and the
accumulator cannot overflow; otherwise (scale 0, 255 = NaN, or weights beyond bfloat16's range)
the program runs the bfloat16 dequantization, the reference's weights bit for bit.

`_scaled_kernel` (MXFP8 activations and weights, FP8 tensor cores): per 32-wide K chunk one
E4M3 x E4M3 dot, its float32 partial times 2^(ex + ew) (the two E8M0 scales) added to the
accumulator.

Under TRITON_INTERPRET=1 (the CPU tests) the dots run in float32 on values rounded to x's
dtype by integer round-to-nearest-even (the interpreter's float32 -> bfloat16 cast truncates).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..dispatch import interpret_mode

__all__ = ["e2m1_to_f32", "nvfp4_decode_word", "prmt", "e4m3_bits_to_f32", "e8m0_to_f32", "GemmConfig", "grouped_config", "grouped_mm_triton",
           "scaled_config", "scaled_mm_triton"]

_INTERP = tl.constexpr(interpret_mode())
_DT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
NVFP4, MXFP8 = 0, 1
_FMT = {"nvfp4": NVFP4, "mxfp8": MXFP8}

# the byte tables' packing: 8 values (f32) rounded to 16-bit pairs, then low bytes / high bytes
# gathered into four words (`_nvfp4_tables`); {0} is the pair type, bf16x2 or f16x2
_TABLE_ASM = ("{{ .reg .b32 p01, p23, p45, p67;"
              " cvt.rn.{0}.f32 p01, $5, $4; cvt.rn.{0}.f32 p23, $7, $6;"
              " cvt.rn.{0}.f32 p45, $9, $8; cvt.rn.{0}.f32 p67, $11, $10;"
              " prmt.b32 $0, p01, p23, 0x6420; prmt.b32 $2, p01, p23, 0x7531;"
              " prmt.b32 $1, p45, p67, 0x6420; prmt.b32 $3, p45, p67, 0x7531; }}")
_TABLE_ASM_BF16 = tl.constexpr(_TABLE_ASM.format("bf16x2"))
_TABLE_ASM_F16 = tl.constexpr(_TABLE_ASM.format("f16x2"))


@dataclass(frozen=True)
class GemmConfig:
    """Tile sizes and launch settings of one GEMM launch."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _round_to(v, DT: tl.constexpr):
    """float32 -> x's dtype (DT 0 float32, 1 bfloat16, 2 float16), round to nearest even.
    Interpreted: the rounded value kept in float32 (the dots then run in float32)."""
    if DT == 0:
        return v
    elif _INTERP:
        if DT == 1:
            u = v.to(tl.int32, bitcast=True)
            r = (u + 0x7FFF + ((u >> 16) & 1)) & -65536  # finite values (no NaN reaches here)
            return r.to(tl.float32, bitcast=True)
        else:
            return v.to(tl.float16).to(tl.float32)
    elif DT == 1:
        return v.to(tl.bfloat16)
    else:
        return v.to(tl.float16)


@triton.jit
def e2m1_to_f32(c):
    """E2M1 codes (int32 0..15) -> float32 (code 8 -> -0.0): the magnitude bits built directly."""
    i = c & 7
    bits = (((i >> 1) + 126) << 23) | ((i & 1) << 22)  # 1, 1.5, 2, 3, 4, 6 for i = 2..7
    bits = tl.where(i < 2, i * 0x3F000000, bits)  # 0 and 0.5
    return (bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_bits_to_f32(c):
    """float8_e4m3fn bits (int32 0..255) -> float32 with integer ops (0x7F / 0xFF -> NaN, 0x80 -> -0.0)."""
    ef = (c >> 3) & 15
    mt = c & 7
    normal = ((ef + 120) << 23) | (mt << 20)
    sub = (mt.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)  # mt * 2^-9, exact
    mag = tl.where(ef == 0, sub, normal)
    mag = tl.where((c & 0x7F) == 0x7F, 0x7FC00000, mag)
    return (mag | ((c & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3(c):
    """float8_e4m3fn bytes (uint8) -> float32 (exact).  Interpreted: integer decoding (the
    interpreter's float8 type cannot take masked loads)."""
    if _INTERP:
        return e4m3_bits_to_f32(c.to(tl.int32))
    else:
        return c.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def e8m0_to_f32(b):
    """E8M0 bytes (int32 0..255) -> 2^(b - 127) as float32 (0 -> 2^-127, 255 -> NaN)."""
    bits = tl.where(b == 0, 0x00400000, b << 23)
    return tl.where(b == 255, 0x7FC00000, bits).to(tl.float32, bitcast=True)


@triton.jit
def _expand(s, BN: tl.constexpr, NB: tl.constexpr, R: tl.constexpr):
    """Per-block scales [BN, NB] -> [BN, NB * R], each repeated over its R columns."""
    return tl.reshape(tl.broadcast_to(s[:, :, None], [BN, NB, R]), [BN, NB * R])


@triton.jit
def _operand(x, DT: tl.constexpr):
    """An x tile as a dot operand: float32 when interpreted, else as loaded (x's dtype)."""
    if _INTERP:
        return x.to(tl.float32)
    else:
        return x


@triton.jit
def _dot(a, b, acc, DT: tl.constexpr):
    if _INTERP or DT == 0:
        return tl.dot(a, tl.trans(b), acc, input_precision="ieee")
    else:
        return tl.dot(a, tl.trans(b), acc)


@triton.jit
def prmt(a, b, sel):
    """PTX ``prmt.b32 d, a, b, sel`` (default mode) on int32 tensors: byte k of d is byte
    (sel >> 4k) & 7 of the 8-byte value b:a, or, when bit 3 of that selector nibble is set,
    that byte's top bit replicated into all 8 bits.  Only the low 16 bits of sel count.  One
    instruction on the GPU; an integer emulation under TRITON_INTERPRET=1."""
    if _INTERP:
        s_all = sel + (a & 0) + (b & 0)  # broadcast to the common shape
        r = s_all & 0
        for k in tl.static_range(4):
            s = (s_all >> (4 * k)) & 15
            i = s & 7
            byte = (tl.where(i < 4, a, b) >> ((i & 3) * 8)) & 0xFF
            byte = tl.where(s >= 8, tl.where(byte >= 128, 0xFF, 0), byte)
            r = r | (byte << (8 * k))
        return r
    else:
        return tl.inline_asm_elementwise(
            "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, sel], dtype=tl.int32, is_pure=True, pack=1
        )


@triton.jit
def _bits16(v, DT: tl.constexpr):
    """float32 -> the 16-bit pattern (int32 0..65535) of RN_DT(v) (DT 1 bfloat16, 2 float16)."""
    if DT == 1:
        u = v.to(tl.int32, bitcast=True)
        keep = (u & 0x7FFFFFFF) > 0x7F800000  # NaN: keep it quiet, no rounding carry
        r = tl.where(keep, u | 0x00400000, u + 0x7FFF + ((u >> 16) & 1))
        return (r >> 16) & 0xFFFF
    else:
        return v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _nvfp4_tables(bs, gs, DT: tl.constexpr, FAST: tl.constexpr):
    """Per-block dequantization tables of NVFP4: bs float32 block scales (any shape), gs the
    group's float32 global scale -> (tl0, tl1, th0, th1) int32: the low bytes (tl) and high
    bytes (th) of the 16-bit values v_i = RN_DT(RN_f32((e2m1_i * bs) * gs)) of the 8 E2M1
    magnitudes e2m1_i = 0, .5, 1, 1.5, 2, 3, 4, 6 (i = 0..3 in tl0 / th0, 4..7 in tl1 / th1,
    byte i & 3).  These are the weights `reference.py` defines, sign aside.

    FAST (bfloat16 only; used when 2^-110 <= |gs| <= 2^110): A = RN(bs * gs) and
    B = RN(RN(1.5 bs) * gs) are multiplied in float32, then 0 * A and A / 2 (float32), and 2A,
    2B, 4A, 4B in bfloat16 (one packed FMA each).  This is exact: in that range every
    bs * gs * e2m1 is a normal float32 (|bs| in {0} u [2^-9, 448]), and scaling a normal value
    by a power of two commutes with rounding to float32 and to bfloat16."""
    if FAST:
        e2 = bs * gs
        e0 = e2 * 0.0  # = RN((0 * bs) * gs): +-0, or NaN for a NaN scale
        e1 = e2 * 0.5  # = RN((0.5 * bs) * gs) in the fast range
        e3 = (bs * 1.5) * gs
        if _INTERP:
            t = _tables_from_bits(_bits16(e0, DT), _bits16(e1, DT), _bits16(e2, DT), _bits16(e3, DT),
                                  _bits16(e2 * 2.0, DT), _bits16(e3 * 2.0, DT), _bits16(e2 * 4.0, DT),
                                  _bits16(e3 * 4.0, DT))
        else:
            t = tl.inline_asm_elementwise(
                "{ .reg .b32 ab, x, ab2, ab4, c2, c4, nz;"
                " cvt.rn.bf16x2.f32 ab, $7, $6; cvt.rn.bf16x2.f32 x, $4, $5;"
                " mov.b32 c2, 0x40004000; mov.b32 c4, 0x40804080; mov.b32 nz, 0x80008000;"
                " fma.rn.bf16x2 ab2, ab, c2, nz; fma.rn.bf16x2 ab4, ab, c4, nz;"
                " prmt.b32 $0, x, ab, 0x6402; prmt.b32 $2, x, ab, 0x7513;"
                " prmt.b32 $1, ab2, ab4, 0x6420; prmt.b32 $3, ab2, ab4, 0x7531; }",
                "=r,=r,=r,=r,f,f,f,f", [e0, e1, e2, e3], dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                is_pure=True, pack=1)
    else:
        e0 = bs * 0.0 * gs
        e1 = (bs * 0.5) * gs
        e2 = bs * gs
        e3 = (bs * 1.5) * gs
        e4 = (bs * 2.0) * gs
        e5 = (bs * 3.0) * gs
        e6 = (bs * 4.0) * gs
        e7 = (bs * 6.0) * gs
        if _INTERP:
            t = _tables_from_bits(_bits16(e0, DT), _bits16(e1, DT), _bits16(e2, DT), _bits16(e3, DT),
                                  _bits16(e4, DT), _bits16(e5, DT), _bits16(e6, DT), _bits16(e7, DT))
        else:
            t = tl.inline_asm_elementwise(
                _TABLE_ASM_BF16 if DT == 1 else _TABLE_ASM_F16,
                "=r,=r,=r,=r,f,f,f,f,f,f,f,f", [e0, e1, e2, e3, e4, e5, e6, e7],
                dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    return t


@triton.jit
def _tables_from_bits(e0, e1, e2, e3, e4, e5, e6, e7):
    """Eight 16-bit patterns (int32 0..65535) -> (tl0, tl1, th0, th1) byte tables (interpreted)."""
    tl0 = (e0 & 0xFF) | ((e1 & 0xFF) << 8) | ((e2 & 0xFF) << 16) | ((e3 & 0xFF) << 24)
    tl1 = (e4 & 0xFF) | ((e5 & 0xFF) << 8) | ((e6 & 0xFF) << 16) | ((e7 & 0xFF) << 24)
    th0 = (e0 >> 8) | ((e1 >> 8) << 8) | ((e2 >> 8) << 16) | ((e3 >> 8) << 24)
    th1 = (e4 >> 8) | ((e5 >> 8) << 8) | ((e6 >> 8) << 16) | ((e7 >> 8) << 24)
    return tl0, tl1, th0, th1


@triton.jit
def nvfp4_decode_word(w, tl0, tl1, th0, th1):
    """Eight NVFP4 codes (int32 word, code j in bits 4j..4j+3) and their block's tables ->
    (p0, p1, p2, p3) int32: p_i holds the 16-bit weights of codes 2i (low half) and 2i + 1.

    Four `prmt` look up the low and high bytes of the magnitudes (selector: the codes without
    their sign bits; a prmt reads 4 selector nibbles, so codes 0-3 and 4-7 take one each), two
    `prmt` gather each code's sign bit (bit 3 of its nibble, found as the top bit of a byte of w
    or of w << 4) to the top bit of its high byte, two `lop3` flip the sign there, and four
    `prmt` interleave low and high bytes into pairs: 15 instructions per 8 weights.
    Interpreted: the same steps on the integer emulation of prmt."""
    if _INTERP:
        m = w & 0x77777777
        mh = (m >> 16) & 0xFFFF
        l0 = prmt(tl0, tl1, m)
        h0 = prmt(th0, th1, m)
        l1 = prmt(tl0, tl1, mh)
        h1 = prmt(th0, th1, mh)
        w4 = w << 4
        h0 = h0 ^ (prmt(w, w4, 0x1504) & -0x7F7F7F80)  # 0x80808080
        h1 = h1 ^ (prmt(w, w4, 0x3726) & -0x7F7F7F80)
        p = (prmt(l0, h0, 0x5140), prmt(l0, h0, 0x7362), prmt(l1, h1, 0x5140), prmt(l1, h1, 0x7362))
    else:
        p = tl.inline_asm_elementwise(
            "{ .reg .b32 m, mh, l0, h0, l1, h1, w4, s0, s1;"
            " and.b32 m, $4, 0x77777777; shr.u32 mh, m, 16;"
            " prmt.b32 l0, $5, $6, m; prmt.b32 h0, $7, $8, m;"
            " prmt.b32 l1, $5, $6, mh; prmt.b32 h1, $7, $8, mh;"
            " shl.b32 w4, $4, 4; prmt.b32 s0, $4, w4, 0x1504; prmt.b32 s1, $4, w4, 0x3726;"
            " lop3.b32 h0, h0, s0, 0x80808080, 0x78; lop3.b32 h1, h1, s1, 0x80808080, 0x78;"
            " prmt.b32 $0, l0, h0, 0x5140; prmt.b32 $1, l0, h0, 0x7362;"
            " prmt.b32 $2, l1, h1, 0x5140; prmt.b32 $3, l1, h1, 0x7362; }",
            "=r,=r,=r,=r,r,r,r,r,r", [w, tl0, tl1, th0, th1], dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
            is_pure=True, pack=1)
    return p


@triton.jit
def _halves(p, DT: tl.constexpr):
    """int32 pairs -> (low, high) 16-bit halves as DT values (float32 when interpreted)."""
    lo = p & 0xFFFF
    hi = (p >> 16) & 0xFFFF
    if _INTERP:
        if DT == 1:
            a, b = (lo << 16).to(tl.float32, bitcast=True), (hi << 16).to(tl.float32, bitcast=True)
        else:
            a = lo.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            b = hi.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    elif DT == 1:
        a, b = lo.to(tl.int16).to(tl.bfloat16, bitcast=True), hi.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        a, b = lo.to(tl.int16).to(tl.float16, bitcast=True), hi.to(tl.int16).to(tl.float16, bitcast=True)
    return a, b


@triton.jit
def _nvfp4_tile(words, sc, gs, BN: tl.constexpr, NB: tl.constexpr, DT: tl.constexpr, FAST: tl.constexpr):
    """Code words [BN, 2 * NB] (int32, 8 codes each) and block scales [BN, NB] (float32) -> the
    dequantized weight tile [BN, 16 * NB] in DT (column 8j + e: code e of word j)."""
    t0, t1, t2, t3 = _nvfp4_tables(sc, gs, DT, FAST)
    w3 = tl.reshape(words, [BN, NB, 2])
    p0, p1, p2, p3 = nvfp4_decode_word(w3, t0[:, :, None], t1[:, :, None], t2[:, :, None], t3[:, :, None])
    v0, v1 = _halves(p0, DT)
    v2, v3 = _halves(p1, DT)
    v4, v5 = _halves(p2, DT)
    v6, v7 = _halves(p3, DT)
    # element e = 4 * b2 + 2 * b1 + b0: join over b2, then b1, then b0 (the last dim fastest)
    u00, u01, u10, u11 = tl.join(v0, v4), tl.join(v1, v5), tl.join(v2, v6), tl.join(v3, v7)
    s0, s1 = tl.join(u00, u10), tl.join(u01, u11)
    return tl.reshape(tl.join(s0, s1), [BN, 16 * NB])


@triton.jit
def e8m0_bf16_bits(b):
    """E8M0 bytes (int32 0..255) -> the bfloat16 bits (int32 0..65535) of 2^(b - 127): b << 7,
    with 0x40 added for b = 0 (the subnormal 2^-127) and b = 255 (0x7FC0, NaN)."""
    return (b << 7) | tl.where(((b + 1) & 255) < 2, 0x40, 0)


@triton.jit
def _mxfp8_tile(c, sc, BN: tl.constexpr, NB: tl.constexpr, DT: tl.constexpr):
    """E4M3 code bytes [BN, 32 * NB] (uint8) and E8M0 scale bytes [BN, NB] (int32) -> the weight
    tile RN_DT(code * 2^(scale - 127)) [BN, 32 * NB] (float32 when interpreted).

    bfloat16: per 4 codes (one 32-bit register) two ``cvt.rn.f16x2.e4m3x2``, four
    ``cvt.f32.f16`` and two ``cvt.rn.bf16x2.f32`` give the codes' values in bfloat16 (exact: an
    E4M3 value has at most 4 significant bits and lies in [2^-9, 448]; NaN stays NaN), then two
    ``mul.rn.bf16x2`` by the scale 2^(scale - 127) in bfloat16 (exact too, 2^-127 a bfloat16
    subnormal, 255 NaN): one rounding of the exact product, as the reference's (its float32
    product is exact, down to 2^-136).  10 instructions per 4 weights, no range check.
    float32 / float16: the float32 product rounded to x's dtype."""
    if DT == 1:
        s = _expand(e8m0_bf16_bits(sc), BN, NB, 32)
        if _INTERP:
            v = e4m3_bits_to_f32(c.to(tl.int32))
            return _round_to(v * (s << 16).to(tl.float32, bitcast=True), DT)
        else:
            return tl.inline_asm_elementwise(
                "{ .reg .b16 c01, c23, h0, h1, h2, h3; .reg .b32 p01, p23; .reg .f32 f0, f1, f2, f3;"
                " mov.b32 {c01, c23}, $2;"
                " cvt.rn.f16x2.e4m3x2 p01, c01; cvt.rn.f16x2.e4m3x2 p23, c23;"
                " mov.b32 {h0, h1}, p01; mov.b32 {h2, h3}, p23;"
                " cvt.f32.f16 f0, h0; cvt.f32.f16 f1, h1; cvt.f32.f16 f2, h2; cvt.f32.f16 f3, h3;"
                " cvt.rn.bf16x2.f32 p01, f1, f0; cvt.rn.bf16x2.f32 p23, f3, f2;"
                " mul.rn.bf16x2 $0, p01, $3; mul.rn.bf16x2 $1, p23, $4; }",
                "=r,=r,r,r,r", [c, s.to(tl.int16).to(tl.bfloat16, bitcast=True)], dtype=tl.bfloat16,
                is_pure=True, pack=4)
    else:
        return _round_to(_e4m3(c) * _expand(e8m0_to_f32(sc), BN, NB, 32), DT)


@triton.jit
def _mxfp8_kloop(acc, xrow, r_ok, wrow, srow, n_ok, k_lo, k_hi, DT: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] += x[:, k_lo:k_hi] @ w_DT[:, k_lo:k_hi].T, the weight tile
    RN_DT(code * 2^(scale - 127)) (`_mxfp8_tile`) the MMA's second operand."""
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < k_hi
        b = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        if EVEN:
            c = tl.load(wrow + k[None, :])
            sc = tl.load(srow + b[None, :]).to(tl.int32)
            w = _mxfp8_tile(c, sc, BLOCK_N, BLOCK_K // 32, DT)
            x = _operand(tl.load(xrow + k[None, :], mask=r_ok[:, None], other=0.0), DT)
        else:
            c = tl.load(wrow + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
            sc = tl.load(srow + b[None, :], mask=n_ok[:, None] & (b < k_hi // 32)[None, :], other=127)
            w = _mxfp8_tile(c, sc.to(tl.int32), BLOCK_N, BLOCK_K // 32, DT)
            x = _operand(tl.load(xrow + k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0), DT)
        acc = _dot(x, w, acc, DT)
    return acc


@triton.jit
def _e4m3_f16(c):
    """E4M3 code bytes (uint8) -> their values in float16, exact (an E4M3 value has at most 4
    significant bits in [2^-9, 448]; the NaN codes 0x7F / 0xFF give NaN): per 4 codes two
    ``cvt.rn.f16x2.e4m3x2``.  Interpreted: the values in float32 (integer decoding)."""
    if _INTERP:
        return e4m3_bits_to_f32(c.to(tl.int32))
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 c01, c23; mov.b32 {c01, c23}, $2;"
            " cvt.rn.f16x2.e4m3x2 $0, c01; cvt.rn.f16x2.e4m3x2 $1, c23; }",
            "=r,=r,r", [c], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def _scales_within(srow, n_ok, b_lo, b_hi, LO: tl.constexpr, HI: tl.constexpr, BLOCK_N: tl.constexpr):
    """Whether every E8M0 scale byte of the rows srow [BLOCK_N, 1] (n_ok) in the blocks
    b_lo .. b_hi - 1 lies in [LO, HI] (one block-wide reduction at the end)."""
    bad = tl.zeros([BLOCK_N, 32], dtype=tl.int32)
    for b0 in range(b_lo, b_hi, 32):
        b = b0 + tl.arange(0, 32)
        e = tl.load(srow + b[None, :], mask=n_ok[:, None] & (b < b_hi)[None, :], other=LO).to(tl.int32)
        bad = bad | (e < LO).to(tl.int32) | (e > HI).to(tl.int32)
    return tl.max(tl.max(bad, 1), 0) == 0


@triton.jit
def _mxfp8_f16_kloop(acc, x16row, r_ok, wrow, srow, n_ok, k_lo, k_hi, BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] += sum over the 32-wide K chunks of (w16 @ x16.T) * 2^(scale - 127):
    the codes in float16 (`_e4m3_f16`), x16 the float16 rows (pre-scaled, `_x_f16_kernel`), one
    float16 MMA of K = 32 per chunk (float32 partial, the weight tile the first operand), the
    partial times its column's scale (an exact power of two in the range the caller checked)
    added to the accumulator."""
    for k0 in range(k_lo, k_hi, BLOCK_K):
        for c in tl.static_range(BLOCK_K // 32):
            kc = k0 + c * 32
            k = kc + tl.arange(0, 32)
            if EVEN:
                codes = tl.load(wrow + k[None, :])
                e = tl.load(srow + kc // 32)
                x = tl.load(x16row + k[None, :], mask=r_ok[:, None], other=0.0)
            else:
                k_ok = k < k_hi
                codes = tl.load(wrow + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
                e = tl.load(srow + kc // 32, mask=n_ok[:, None] & (kc < k_hi), other=127)
                x = tl.load(x16row + k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            w = _e4m3_f16(codes)
            if _INTERP:
                p = tl.dot(w, tl.trans(x.to(tl.float32)), input_precision="ieee")
            else:
                p = tl.dot(w, tl.trans(x))
            acc += p * (e.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    return acc


@triton.jit
def _exp2i(e):
    """2^e (int32 e, -252 <= e <= 254) as two float32 factors (each a normal float32)."""
    h = e >> 1
    return ((h + 127) << 23).to(tl.float32, bitcast=True), ((e - h + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _x_f16_kernel(X, X16, XE, K, sxm, s16m, BLOCK: tl.constexpr):
    """One row of bfloat16 x -> x16 = RN_f16(x * 2^-e) and e (int32): e = E - 14 with E the
    exponent of the row's largest finite |x| (at least -126), so the row's largest finite
    value lands in [2^14, 2^15) (lower for a row of bfloat16 subnormals).  Exact for every value whose scaled last significant bit is
    at least 2^-24 (f16's subnormal step): all but values below 2^-24 x 2^(E+1-15) = 2^(E-38)
    (less than 2^-38 of the row's largest), which round to multiples of 2^-24; inf and NaN
    stay inf and NaN.  x is read as its bits (exact on the GPU and under the interpreter)."""
    row = tl.program_id(0)
    xr = X + row.to(tl.int64) * sxm
    top = tl.zeros([BLOCK], dtype=tl.int32)
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        u = tl.load(xr + k, mask=k < K, other=0.0).to(tl.int16, bitcast=True).to(tl.int32) & 0x7FFF
        top = tl.maximum(top, tl.where(u < 0x7F80, u, 0))  # |x| bits, inf / NaN as 0
    e = tl.maximum((tl.max(top, 0) >> 7) - 127, -126) - 14
    f1, f2 = _exp2i(-e)
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        u = tl.load(xr + k, mask=k < K, other=0.0).to(tl.int16, bitcast=True).to(tl.int32)
        v = (u << 16).to(tl.float32, bitcast=True)  # exact, subnormals too
        tl.store(X16 + row.to(tl.int64) * s16m + k, ((v * f1) * f2).to(tl.float16), mask=k < K)
    tl.store(XE + row, e)


# the E8M0 scale bytes of the float16 path: the reference's weights code * 2^(s - 127) are exact
# in bfloat16 from s = 3 up to s = 246; from 11 every chunk partial times its scale is a float32
# multiple of 2^-149 (no rounding beyond the accumulation's); up to 200 the accumulator stays far
# below float32's overflow (|partial| < 32 * 2^15 * 448 < 2^29, so |acc| < 2^(s - 98) x K / 32)
MX_F16_LO, MX_F16_HI = tl.constexpr(11), tl.constexpr(200)


@triton.jit
def _mxfp8_grouped_kernel(X, X16, XE, W, S, COUNTS, Y, G, M, N, K, k_per_split,
                          sxm, s16m, swg, swn, ssg, ssn, sys, sym,
                          OUT_F32: tl.constexpr, EVEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr):
    """MXFP8 weight-only grouped GEMM for bfloat16 x: the float16 path (`_mxfp8_f16_kloop` on
    X16 = x * 2^-XE per row) when every scale of the program's columns and K split lies in
    [MX_F16_LO, MX_F16_HI], else the bfloat16 dequantization (`_mxfp8_kloop`: the reference's
    weights, bit for bit)."""
    g, m0, m_end, ok = _group_tile(COUNTS, G, tl.program_id(0), BLOCK_M, BLOCK_G)
    if not ok:
        return
    pid_k, rows, r_ok, xrow, n, n_ok, wrow, srow, k_lo, k_hi = _tile_operands(
        X, W, S, g, m0, m_end, N, K, k_per_split, sxm, swg, swn, ssg, ssn, BLOCK_M, BLOCK_N)
    if _scales_within(srow, n_ok, k_lo // 32, k_hi // 32, MX_F16_LO, MX_F16_HI, BLOCK_N):
        x16row = X16 + rows.to(tl.int64)[:, None] * s16m
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc = _mxfp8_f16_kloop(acc, x16row, r_ok, wrow, srow, n_ok, k_lo, k_hi, BLOCK_K, EVEN)
        f1, f2 = _exp2i(tl.load(XE + rows, mask=r_ok, other=0))
        out = (tl.trans(acc) * f1[:, None]) * f2[:, None]
    else:
        out = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        out = _mxfp8_kloop(out, xrow, r_ok, wrow, srow, n_ok, k_lo, k_hi, 1, BLOCK_N, 32, EVEN)
    _store_tile(Y, out, pid_k, rows, r_ok, n, n_ok, sys, sym, OUT_F32)


@triton.jit
def _nvfp4_kloop(acc, xrow, r_ok, wrow, srow, n_ok, gs, k_lo, k_hi, j_lo, b_lo, DT: tl.constexpr, FAST: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] += dequant(w[:, k_lo:k_hi]) @ x[:, k_lo:k_hi].T (NVFP4 through the
    byte tables; the weight tile is the MMA's first operand, the fewest instructions per weight).
    j_lo = k_lo / 8 (the first code word), b_lo = k_lo / 16 (the first scale), passed from
    arguments so that the compiler sees their alignment and vectorizes the loads (16 bytes).
    EVEN_K: every K step is whole (no K masks); EVEN_N: every weight row exists (no N masks)."""
    for it in range(tl.cdiv(k_hi - k_lo, BLOCK_K)):
        j = j_lo + it * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)  # int32 code words: columns 8j .. 8j + 7
        b = b_lo + it * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
        k = k_lo + it * BLOCK_K + tl.arange(0, BLOCK_K)
        if EVEN_K and EVEN_N:
            words = tl.load(wrow + j[None, :])
            bs = _e4m3(tl.load(srow + b[None, :]))
        else:
            words = tl.load(wrow + j[None, :], mask=n_ok[:, None] & (j < k_hi // 8)[None, :], other=0)
            bs = _e4m3(tl.load(srow + b[None, :], mask=n_ok[:, None] & (b < k_hi // 16)[None, :], other=0))
        if EVEN_K:
            x = tl.load(xrow + k[None, :], mask=r_ok[:, None], other=0.0)
        else:
            x = tl.load(xrow + k[None, :], mask=r_ok[:, None] & (k < k_hi)[None, :], other=0.0)
        w = _nvfp4_tile(words, bs, gs, BLOCK_N, BLOCK_K // 16, DT, FAST)
        acc = _dot(w, _operand(x, DT), acc, DT)
    return acc


@triton.jit
def _nvfp4_grouped_kernel(X, W, S, GS, COUNTS, Y, G, M, N, K, k_per_split, kw_per_split, kb_per_split,
                          sxm, swg, swn, ssg, ssn, sys, sym,
                          DT: tl.constexpr, OUT_F32: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr):
    """NVFP4 weight-only grouped GEMM for 16-bit x (bfloat16 / float16): W is the code bytes
    viewed as int32 words (swg, swn in words), dequantized through per-block byte tables."""
    g, m0, m_end, ok = _group_tile(COUNTS, G, tl.program_id(0), BLOCK_M, BLOCK_G)
    if not ok:
        return
    pid_k, rows, r_ok, xrow, n, n_ok, wrow, srow, k_lo, k_hi = _tile_operands(
        X, W, S, g, m0, m_end, N, K, k_per_split, sxm, swg, swn, ssg, ssn, BLOCK_M, BLOCK_N)
    j_lo = pid_k * kw_per_split
    b_lo = pid_k * kb_per_split
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    gs = tl.load(GS + g)
    ga = tl.abs(gs)
    if DT == 1 and (ga >= 7.703719777548943e-34) and (ga <= 1.298074214633707e33):  # 2^-110 .. 2^110
        acc = _nvfp4_kloop(acc, xrow, r_ok, wrow, srow, n_ok, gs, k_lo, k_hi, j_lo, b_lo, DT, True, BLOCK_N, BLOCK_K,
                           EVEN_K, EVEN_N)
    else:
        acc = _nvfp4_kloop(acc, xrow, r_ok, wrow, srow, n_ok, gs, k_lo, k_hi, j_lo, b_lo, DT, False, BLOCK_N, BLOCK_K,
                           EVEN_K, EVEN_N)
    acc = tl.trans(acc)
    _store_tile(Y, acc, pid_k, rows, r_ok, n, n_ok, sys, sym, OUT_F32)


@triton.jit
def _store_tile(Y, acc, pid_k, rows, r_ok, n, n_ok, sys, sym, OUT_F32: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] (fp32) to split pid_k's slice of Y at (rows, n), in float32 or Y's dtype."""
    out = Y + pid_k.to(tl.int64) * sys + rows.to(tl.int64)[:, None] * sym + n[None, :]
    m = r_ok[:, None] & n_ok[None, :]
    if OUT_F32:
        tl.store(out, acc, mask=m)
    else:
        tl.store(out, acc.to(Y.dtype.element_ty), mask=m)


@triton.jit
def _tile_operands(X, W, S, g, m0, m_end, N, K, k_per_split, sxm, swg, swn, ssg, ssn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A program's rows of group g from m0 (< m_end), its BLOCK_N output columns and its K split:
    (pid_k, rows, row mask, x row pointers, columns, column mask, weight row pointers, scale row
    pointers, k_lo, k_hi); W's and S's strides are in their own elements."""
    pid_k = tl.program_id(2)
    rows = m0 + tl.arange(0, BLOCK_M)
    r_ok = rows < m_end
    xrow = X + rows.to(tl.int64)[:, None] * sxm
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    wrow = W + g.to(tl.int64) * swg + n.to(tl.int64)[:, None] * swn
    srow = S + g.to(tl.int64) * ssg + n.to(tl.int64)[:, None] * ssn
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    return pid_k, rows, r_ok, xrow, n, n_ok, wrow, srow, k_lo, k_hi


@triton.jit
def _group_tile(COUNTS, G, t, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr):
    """Tile slot t -> (group, first row of the tile, end row of the group, t is a tile)."""
    gi = tl.arange(0, BLOCK_G)
    cnt = tl.load(COUNTS + gi, mask=gi < G, other=0).to(tl.int32)
    tiles = (cnt + BLOCK_M - 1) // BLOCK_M
    cum = tl.cumsum(tiles, 0)
    g = tl.sum((cum <= t).to(tl.int32))
    before = gi < g
    row0 = tl.sum(tl.where(before, cnt, 0))
    m0 = row0 + (t - tl.sum(tl.where(before, tiles, 0))) * BLOCK_M
    end = row0 + tl.sum(tl.where(gi == g, cnt, 0))
    return g, m0, end, t < tl.sum(tiles)


@triton.jit
def _grouped_kernel(X, W, S, GS, COUNTS, Y, G, M, N, K, k_per_split,
                    sxm, swg, swn, ssg, ssn, sys, sym,
                    FMT: tl.constexpr, DT: tl.constexpr, OUT_F32: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr,
                    EVEN: tl.constexpr = False):
    """FMT 0 NVFP4, 1 MXFP8.  EVEN (MXFP8): every K step is whole and every weight row exists, so
    the weight and scale loads take no masks (fewer instructions and registers in the K loop)."""
    g, m0, m_end, ok = _group_tile(COUNTS, G, tl.program_id(0), BLOCK_M, BLOCK_G)
    if not ok:
        return
    pid_k, rows, r_ok, xrow, n, n_ok, wrow, srow, k_lo, k_hi = _tile_operands(
        X, W, S, g, m0, m_end, N, K, k_per_split, sxm, swg, swn, ssg, ssn, BLOCK_M, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if FMT == 0:
        gs = tl.load(GS + g)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            j = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # code bytes: columns 2j, 2j + 1
            j_ok = j < k_hi // 2
            byte = tl.load(wrow + j[None, :], mask=n_ok[:, None] & j_ok[None, :], other=0).to(tl.int32)
            b = k0 // 16 + tl.arange(0, BLOCK_K // 16)
            bs = tl.load(srow + b[None, :], mask=n_ok[:, None] & (b < k_hi // 16)[None, :], other=0)
            bs = _expand(_e4m3(bs), BLOCK_N, BLOCK_K // 16, 8)
            w_lo = _round_to((e2m1_to_f32(byte & 15) * bs) * gs, DT)
            w_hi = _round_to((e2m1_to_f32(byte >> 4) * bs) * gs, DT)
            xm = r_ok[:, None] & j_ok[None, :]
            x_even = _operand(tl.load(xrow + 2 * j[None, :], mask=xm, other=0.0), DT)
            x_odd = _operand(tl.load(xrow + 2 * j[None, :] + 1, mask=xm, other=0.0), DT)
            acc = _dot(x_even, w_lo, acc, DT)
            acc = _dot(x_odd, w_hi, acc, DT)
    else:
        acc = _mxfp8_kloop(acc, xrow, r_ok, wrow, srow, n_ok, k_lo, k_hi, DT, BLOCK_N, BLOCK_K, EVEN)
    _store_tile(Y, acc, pid_k, rows, r_ok, n, n_ok, sys, sym, OUT_F32)


@triton.jit
def _scaled_kernel(XC, XS, WC, WS, Y, M, N, K, sxm, sxs, swn, sws, sym,
                   OUT_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr):
    # grouped ordering of the output tiles (GROUP_M row tiles share the weight columns in L2)
    pid = tl.program_id(0)
    n_m, n_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    width = GROUP_M * n_n
    first = (pid // width) * GROUP_M
    rows_in = tl.minimum(n_m - first, GROUP_M)
    pm = first + (pid % width) % rows_in
    pn = (pid % width) // rows_in
    rows = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok, n_ok = rows < M, n < N
    r64, n64 = rows.to(tl.int64), n.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        for c in tl.static_range(BLOCK_K // 32):
            k = k0 + c * 32 + tl.arange(0, 32)
            k_ok = k < K
            a = tl.load(XC + r64[:, None] * sxm + k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0)
            b = tl.load(WC + n64[:, None] * swn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
            ch = k0 // 32 + c
            sa = e8m0_to_f32(tl.load(XS + r64 * sxs + ch, mask=r_ok & (ch * 32 < K), other=127).to(tl.int32))
            sb = e8m0_to_f32(tl.load(WS + n64 * sws + ch, mask=n_ok & (ch * 32 < K), other=127).to(tl.int32))
            if _INTERP:
                p = tl.dot(_e4m3(a), tl.trans(_e4m3(b)), input_precision="ieee")
            else:
                p = tl.dot(a.to(tl.float8e4nv, bitcast=True), tl.trans(b.to(tl.float8e4nv, bitcast=True)))
            acc += p * (sa[:, None] * sb[None, :])
    out = Y + r64[:, None] * sym + n[None, :]
    m = r_ok[:, None] & n_ok[None, :]
    if OUT_F32:
        tl.store(out, acc, mask=m)
    else:
        tl.store(out, acc.to(Y.dtype.element_ty), mask=m)


def _u8(t: torch.Tensor) -> torch.Tensor:
    """A float8 tensor as its bytes (the kernels decode them)."""
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def _words(weight: torch.Tensor) -> torch.Tensor:
    """NVFP4 code bytes [G, N, K/2] (unit last stride) as int32 words [G, N, K/8] (a copy only
    when the bytes are not 4-byte aligned)."""
    if weight.storage_offset() % 4 or any(st % 4 for st in weight.stride()[:-1]) or weight.data_ptr() % 4:
        weight = weight.contiguous().clone()
    return weight.view(torch.int32)


def _pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


_SMS: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SMS:
        _SMS[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SMS[i]


def _mx_f16(fmt: str, dtype: torch.dtype, block_m: int) -> bool:
    """MXFP8 with bfloat16 x at <= 32 rows per tile: the float16 kernel (`_mxfp8_grouped_kernel`;
    at 64-row tiles its per-chunk accumulator updates cost more than the bfloat16 dequantization)."""
    return fmt == "mxfp8" and dtype == torch.bfloat16 and block_m <= 32


def grouped_config(M: int, N: int, K: int, G: int, fmt: str, device: torch.device,
                   dtype: torch.dtype = torch.bfloat16) -> GemmConfig:
    """Tiles for `grouped_mm_triton`: BLOCK_M from the mean rows per group (16 at decode); at
    decode sizes split-K so that about two programs per SM stream the weight.  NVFP4 with 16-bit
    x (the byte-table kernel): 128 x 256 weight tiles, the weight as the MMA's first operand
    (the fewest instructions per weight of the compiled variants: docs/packed.md)."""
    active = max(1, min(G, M))
    rows = max(1, M // active)
    bm = 16 if rows <= 16 else 32 if rows <= 32 else 64 if rows <= 64 else 128
    byte_table = fmt == "nvfp4" and dtype != torch.float32
    if _mx_f16(fmt, dtype, bm):
        # the float16 MXFP8 kernel: the weight tile the mma.sync's first operand needs fewer than 4
        # warps (4 take the wgmma path and its operand shuffles: docs/packed.md); small CTAs, so
        # split-K aims at about four per SM
        bn, bk, warps, stages = 64, 256, 2, 3
    elif byte_table:
        # decode (<= 16 rows per group): 64 x 256 weight tiles, 3 stages (the fastest of the sweep in
        # benchmarks/packed_gemm.py --decode-ab); larger: 128-wide tiles at 2 stages (3 stages of
        # 128 x 256 need 233 KB of shared memory, over the H100's 227 KB)
        bn, bk, warps, stages = (64, 256, 4, 3) if bm <= 16 else (128, 256 if bm <= 32 else 128, 4, 2)
    else:
        bn = 64 if bm <= 32 else 128
        bk = 256 if bm <= 32 else 64
        warps, stages = (4 if bm <= 32 else 8), (3 if bm <= 32 else 2)
    bk = min(bk, max(32, _pow2(K)))
    programs = (triton.cdiv(M, bm) + active if bm > 16 else active) * triton.cdiv(N, bn)
    split = 1
    steps = triton.cdiv(K, bk)
    while programs * split <= _sm_count(device) * (2 if _mx_f16(fmt, dtype, bm) else 1) and split * 4 <= steps:
        split *= 2
    return GemmConfig(bm, bn, bk, split, warps, stages)


def grouped_mm_triton(x: torch.Tensor, counts: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                      global_scale: torch.Tensor | None, fmt: str, config: GemmConfig | None = None) -> torch.Tensor:
    """`reference.grouped_mm_reference` (inputs assumed checked; x [M, K] with unit K stride)."""
    M, K = x.shape
    G, N = weight.shape[0], weight.shape[1]
    interp = interpret_mode()
    if M == 0:
        return x.new_empty(0, N)
    cfg = config or grouped_config(M, N, K, G, fmt, x.device, x.dtype)
    bk = cfg.block_k
    k_per_split = triton.cdiv(triton.cdiv(K, cfg.split_k), bk) * bk
    split = triton.cdiv(K, k_per_split)
    out_f32 = split > 1 or interp or x.dtype == torch.float32
    y = torch.empty((split, M, N) if out_f32 else (1, M, N), dtype=torch.float32 if out_f32 else x.dtype,
                    device=x.device)
    gs = global_scale if global_scale is not None else counts  # unused by MXFP8
    slots = triton.cdiv(M, cfg.block_m) + min(G, M)
    grid = (slots, triton.cdiv(N, cfg.block_n), split)
    if fmt == "nvfp4" and x.dtype != torch.float32:
        wd = _words(weight)
        with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
            _nvfp4_grouped_kernel[grid](
                x, wd, _u8(scales), gs, counts, y, G, M, N, K, k_per_split, k_per_split // 8, k_per_split // 16,
                x.stride(0), wd.stride(0), wd.stride(1), scales.stride(0), scales.stride(1), y.stride(0),
                y.stride(1), DT=_DT[x.dtype], OUT_F32=out_f32, EVEN_K=K % k_per_split == 0 and k_per_split % bk == 0,
                EVEN_N=N % cfg.block_n == 0, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                BLOCK_K=bk, BLOCK_G=max(2, _pow2(G)), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )
        if not out_f32:
            return y[0]
        return (y.sum(0) if split > 1 else y[0]).to(x.dtype)
    if _mx_f16(fmt, x.dtype, cfg.block_m):
        x16 = torch.empty((M, K), dtype=torch.float16, device=x.device)
        xe = torch.empty(M, dtype=torch.int32, device=x.device)
        with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
            _x_f16_kernel[(M,)](x, x16, xe, K, x.stride(0), x16.stride(0), BLOCK=min(2048, _pow2(K)), num_warps=4)
            _mxfp8_grouped_kernel[grid](
                x, x16, xe, _u8(weight), _u8(scales), counts, y, G, M, N, K, k_per_split,
                x.stride(0), x16.stride(0), weight.stride(0), weight.stride(1), scales.stride(0), scales.stride(1),
                y.stride(0), y.stride(1), OUT_F32=out_f32, EVEN=K % k_per_split == 0 and N % cfg.block_n == 0,
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk, BLOCK_G=max(2, _pow2(G)),
                num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )
        if not out_f32:
            return y[0]
        return (y.sum(0) if split > 1 else y[0]).to(x.dtype)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _grouped_kernel[grid](
            x, _u8(weight), _u8(scales), gs, counts, y, G, M, N, K, k_per_split,
            x.stride(0), weight.stride(0), weight.stride(1), scales.stride(0), scales.stride(1), y.stride(0), y.stride(1),
            FMT=_FMT[fmt], DT=_DT[x.dtype], OUT_F32=out_f32, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk,
            BLOCK_G=max(2, _pow2(G)), EVEN=fmt == "mxfp8" and K % k_per_split == 0 and N % cfg.block_n == 0,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    if not out_f32:
        return y[0]
    return (y.sum(0) if split > 1 else y[0]).to(x.dtype)


def scaled_config(M: int, N: int, K: int) -> GemmConfig:
    """Tiles for `scaled_mm_triton` (prefill-sized M)."""
    bm = 128 if M > 64 else 64
    return GemmConfig(bm, 128, 128, 1, 8, 3)


def scaled_mm_triton(x_codes: torch.Tensor, x_scales: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                     out_dtype: torch.dtype, config: GemmConfig | None = None) -> torch.Tensor:
    """`reference.scaled_mm_reference` (inputs assumed checked; unit K strides)."""
    M, K = x_codes.shape
    N = weight.shape[0]
    if M == 0:
        return torch.empty(0, N, dtype=out_dtype, device=x_codes.device)
    cfg = config or scaled_config(M, N, K)
    out_f32 = interpret_mode() or out_dtype == torch.float32
    y = torch.empty((M, N), dtype=torch.float32 if out_f32 else out_dtype, device=x_codes.device)
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n),)
    with torch.cuda.device(x_codes.device) if x_codes.is_cuda else contextlib.nullcontext():
        _scaled_kernel[grid](
            _u8(x_codes), x_scales, _u8(weight), scales, y, M, N, K,
            x_codes.stride(0), x_scales.stride(0), weight.stride(0), scales.stride(0), y.stride(0),
            OUT_F32=out_f32, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=8,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return y.to(out_dtype)
