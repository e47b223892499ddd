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
* MXFP8 K step: E4M3 codes times 2^(E8M0 - 127) (exact), rounded to x's dtype.
* split-K (decode: a few groups of a few rows cannot fill the GPU otherwise) writes float32
  partials [S, M, N] that the launcher sums; without split the tile is stored in x's dtype.

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

__all__ = ["e2m1_to_f32", "e4m3_bits_to_f32", "e8m0_to_f32", "GemmConfig", "grouped_config", "grouped_mm_triton",
           "scaled_config", "scaled_mm_triton"]

_INTERP = tl.constexpr(interpret_mode())
_DT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
NVFP4, MXFP8 = 0, 1
_FMT = {"nvfp4": NVFP4, "mxfp8": MXFP8}


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
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr):
    g, m0, m_end, ok = _group_tile(COUNTS, G, tl.program_id(0), BLOCK_M, BLOCK_G)
    if not ok:
        return
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
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < k_hi
            c = _e4m3(tl.load(wrow + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0))
            b = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            sc = tl.load(srow + b[None, :], mask=n_ok[:, None] & (b < k_hi // 32)[None, :], other=127).to(tl.int32)
            w = _round_to(c * _expand(e8m0_to_f32(sc), BLOCK_N, BLOCK_K // 32, 32), DT)
            x = _operand(tl.load(xrow + k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0), DT)
            acc = _dot(x, w, acc, DT)
    out = Y + pid_k.to(tl.int64) * sys + rows.to(tl.int64)[:, None] * sym + n[None, :]
    m = r_ok[:, None] & n_ok[None, :]
    if OUT_F32:
        tl.store(out, acc, mask=m)
    else:
        tl.store(out, acc.to(Y.dtype.element_ty), mask=m)


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


def grouped_config(M: int, N: int, K: int, G: int, fmt: str, device: torch.device) -> GemmConfig:
    """Tiles for `grouped_mm_triton`: BLOCK_M from the mean rows per group (16 at decode); at
    decode sizes split-K so that about two programs per SM stream the weight."""
    active = max(1, min(G, M))
    rows = max(1, M // active)
    bm = 16 if rows <= 16 else 32 if rows <= 32 else 64 if rows <= 64 else 128
    bn = 64 if bm <= 32 else 128
    bk = 256 if bm <= 32 else 64
    bk = min(bk, max(32, _pow2(K)))
    programs = (triton.cdiv(M, bm) + active if bm > 16 else active) * triton.cdiv(N, bn)
    split = 1
    steps = triton.cdiv(K, bk)
    while programs * split * 2 <= 2 * _sm_count(device) and split * 4 <= steps:
        split *= 2
    warps = 4 if bm <= 32 else 8
    return GemmConfig(bm, bn, bk, split, warps, 3 if bm <= 32 else 2)


def grouped_mm_triton(x: torch.Tensor, counts: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                      global_scale: torch.Tensor | None, fmt: str, config: GemmConfig | None = None) -> torch.Tensor:
    """`reference.grouped_mm_reference` (inputs assumed checked; x [M, K] with unit K stride)."""
    M, K = x.shape
    G, N = weight.shape[0], weight.shape[1]
    interp = interpret_mode()
    if M == 0:
        return x.new_empty(0, N)
    cfg = config or grouped_config(M, N, K, G, fmt, x.device)
    bk = cfg.block_k
    k_per_split = triton.cdiv(triton.cdiv(K, cfg.split_k), bk) * bk
    split = triton.cdiv(K, k_per_split)
    out_f32 = split > 1 or interp or x.dtype == torch.float32
    y = torch.empty((split, M, N) if out_f32 else (1, M, N), dtype=torch.float32 if out_f32 else x.dtype,
                    device=x.device)
    gs = global_scale if global_scale is not None else counts  # unused by MXFP8
    slots = triton.cdiv(M, cfg.block_m) + min(G, M)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _grouped_kernel[(slots, triton.cdiv(N, cfg.block_n), split)](
            x, _u8(weight), _u8(scales), gs, counts, y, G, M, N, K, k_per_split,
            x.stride(0), weight.stride(0), weight.stride(1), scales.stride(0), scales.stride(1), y.stride(0), y.stride(1),
            FMT=_FMT[fmt], DT=_DT[x.dtype], OUT_F32=out_f32, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk,
            BLOCK_G=max(2, _pow2(G)), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
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
