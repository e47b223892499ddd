"""`routed_experts` for few (token, slot) pairs in Triton (decoding: a batch of 1-8 tokens).

Meaning: `reference.py`.  At decode a layer's routed experts see a handful of pairs, so each
projection is a matrix-vector product bound by reading the chosen experts' weights.  Instead of
a grouped GEMM over expert-sorted pairs, two kernels read the pairs' expert rows directly:

- `_gate_up_kernel`, one program per (pair, BLOCK_I rows of I): gate and up rows of the pair's
  expert times the token's x (float32 sums over H in BLOCK_H steps), each rounded to x's dtype,
  then SwiGLU-OAI -> h [P, I] in x's dtype.
- `_down_kernel`, one program per (token, BLOCK_O rows of H): for each of the token's k slots in
  order, the down rows of that slot's expert times h, rounded to x's dtype, weighted by w and
  summed in float32 -> y [N, H].  No atomics: the result does not depend on the launch.

Tiles are picked so that a launch has about two programs per SM (`_rows_per_program`) and a
program loads its rows' whole reduction dim in one step where that stays small
(`_reduce_block`; the down kernel's slot loop is unrolled): the latency of dependent weight
reads, not the FLOPs, sets the time at these sizes.  Pairs that share an expert read its rows again
(from L2 when they are close in time), so the launcher is meant for P <= a few dozen pairs.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

__all__ = ["routed_experts_triton"]

TARGET_PROGRAMS = 264  # ~2 per SM of an H200
TILE_ELEMS = 4096  # weight elements one program loads per step (32 per thread at 4 warps)


def _pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _rows_per_program(rows: int, groups: int) -> int:
    """Rows of the output per program (a power of two in [4, 64]) so that groups * rows / r ~ TARGET_PROGRAMS."""
    r = _pow2(max(1, (groups * rows) // TARGET_PROGRAMS))
    return max(4, min(64, r, _pow2(rows)))


def _reduce_block(rows: int, n: int) -> int:
    """Elements of the reduction dim per step: all of n in one step when the tile stays within
    TILE_ELEMS (decode shapes: the loads of a step are all in flight at once)."""
    return max(16, min(_pow2(n), TILE_ELEMS // rows))


@triton.jit
def _vector_chunk(V, base, c0, n, BLOCK: tl.constexpr):
    """Columns c0 .. c0 + BLOCK - 1 of a length-n vector at V + base: (columns, mask, values as
    float32, 0 past n)."""
    c = c0 + tl.arange(0, BLOCK)
    ok = c < n
    return c, ok, tl.load(V + base + c, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _expert_tile(W, e, se, sr, sc, rows, rows_ok, cols, cols_ok, xdt):
    """W[e, rows, cols] (strides se, sr, sc; 0 where masked by rows_ok, cols_ok), each weight
    rounded to xdt, as float32 [len(rows), len(cols)]."""
    m = rows_ok[:, None] & cols_ok[None, :]
    return tl.load(W + e * se + rows[:, None] * sr + cols[None, :] * sc, mask=m, other=0.0).to(xdt).to(tl.float32)


@triton.jit
def _gate_up_kernel(X, IDX, W1, W3, Hout, I, H, K_SLOTS,
                    s1e, s1i, s1h, s3e, s3i, s3h, alpha, limit,
                    BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr):
    p = tl.program_id(0)
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    i_ok = i < I
    e = tl.load(IDX + p).to(tl.int64)
    tok = p // K_SLOTS
    xdt = X.dtype.element_ty
    g = tl.zeros([BLOCK_I], tl.float32)
    u = tl.zeros([BLOCK_I], tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hh, h_ok, x = _vector_chunk(X, tok * H, h0, H, BLOCK_H)
        a = _expert_tile(W1, e, s1e, s1i, s1h, i, i_ok, hh, h_ok, xdt)
        b = _expert_tile(W3, e, s3e, s3i, s3h, i, i_ok, hh, h_ok, xdt)
        g += tl.sum(a * x[None, :], axis=1)
        u += tl.sum(b * x[None, :], axis=1)
    g = tl.minimum(g.to(xdt).to(tl.float32), limit)
    u = tl.minimum(tl.maximum(u.to(xdt).to(tl.float32), -limit), limit)
    out = g * tl.sigmoid(alpha * g) * (u + 1.0)
    tl.store(Hout + p * I + i, out.to(xdt), mask=i_ok)


@triton.jit
def _down_kernel(Hin, IDX, WT, W2, Y, I, H,
                 s2e, s2o, s2i,
                 K_SLOTS: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr):
    n = tl.program_id(0)
    o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    o_ok = o < H
    xdt = Hin.dtype.element_ty
    y = tl.zeros([BLOCK_O], tl.float32)
    for j in tl.static_range(K_SLOTS):  # unrolled: every slot's loads can be in flight together
        p = n * K_SLOTS + j
        e = tl.load(IDX + p).to(tl.int64)
        wt = tl.load(WT + p)
        acc = tl.zeros([BLOCK_O], tl.float32)
        for i0 in range(0, I, BLOCK_I):
            ii, i_ok, hv = _vector_chunk(Hin, p * I, i0, I, BLOCK_I)
            a = _expert_tile(W2, e, s2e, s2o, s2i, o, o_ok, ii, i_ok, xdt)
            acc += tl.sum(a * hv[None, :], axis=1)
        y += acc.to(xdt).to(tl.float32) * wt
    tl.store(Y + n * H + o, y, mask=o_ok)


def routed_experts_triton(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                          w2: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """float32 [N, H]; inputs as in `reference.py`, assumed checked (x, idx, w contiguous)."""
    N, k = idx.shape
    E, I, H = w1.shape
    P = N * k
    xc, ic, wc = x.contiguous(), idx.contiguous(), w.contiguous().float()
    h = torch.empty((P, I), dtype=x.dtype, device=x.device)
    y = torch.empty((N, H), dtype=torch.float32, device=x.device)
    bi = _rows_per_program(I, P)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _gate_up_kernel[(P, triton.cdiv(I, bi))](
            xc, ic, w1, w3, h, I, H, k,
            w1.stride(0), w1.stride(1), w1.stride(2), w3.stride(0), w3.stride(1), w3.stride(2),
            float(alpha), float(limit),
            BLOCK_I=bi, BLOCK_H=_reduce_block(bi, H), num_warps=4,
        )
        bo = _rows_per_program(H, N)
        _down_kernel[(N, triton.cdiv(H, bo))](
            h, ic, wc, w2, y, I, H,
            w2.stride(0), w2.stride(1), w2.stride(2),
            K_SLOTS=k, BLOCK_O=bo, BLOCK_I=_reduce_block(bo, I), num_warps=4,
        )
    return y

