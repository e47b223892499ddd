"""msa_decode's bitonic helpers (`_bitonic_merge`, `_topk_of_sorted_chunks`, `_top_of_two` in
msakit/ops/decode/triton.py) against torch's sort / top-k, in small test kernels (the
interpreter on the CPU, or CUDA)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from msakit.ops.decode.triton import _bitonic_merge, _log2, _top_of_two, _topk_of_sorted_chunks
from msakit.ops.dispatch import interpret_mode

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or interpret_mode()),
                                reason="needs CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _merge_kernel(X, OUT, N: tl.constexpr, RUN: tl.constexpr, ORDER: tl.constexpr):
    i = tl.arange(0, N)
    h = tl.reshape(tl.load(X + i), [2] * _log2(N))
    h = _bitonic_merge(h, _log2(RUN), ORDER)
    tl.store(OUT + i, tl.reshape(h, [N]))


@triton.jit
def _topk_kernel(X, OUT, R: tl.constexpr, W: tl.constexpr, K: tl.constexpr):
    r = tl.arange(0, R)
    top = _topk_of_sorted_chunks(tl.load(X + r[:, None] * W + tl.arange(0, W)[None, :]), K)
    tl.store(OUT + r[:, None] * K + tl.arange(0, K)[None, :], top)


@triton.jit
def _two_kernel(A, B, OUT, R: tl.constexpr, K: tl.constexpr):
    off = tl.arange(0, R)[:, None] * K + tl.arange(0, K)[None, :]
    tl.store(OUT + off, _top_of_two(tl.load(A + off), tl.load(B + off), K))


def keys(shape, seed, lo=-(2**62), hi=2**62):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64)


def alternately_sorted(x: torch.Tensor, run: int) -> torch.Tensor:
    """Each run of `run` keys along the last dim sorted, ascending for even runs, descending for odd ones."""
    y = x.reshape(*x.shape[:-1], -1, run).sort(dim=-1).values
    y[..., 1::2, :] = y[..., 1::2, :].flip(-1)
    return y.reshape(x.shape)


@pytest.mark.parametrize("n,run", [(16, 16), (64, 16), (64, 8), (32, 2), (128, 64)])
@pytest.mark.parametrize("order", [0, 1, 2])
def test_bitonic_merge_sorts_bitonic_runs(n, run, order):
    if order == 2 and run == n:
        pytest.skip("alternating order needs several runs")
    # bitonic runs: an ascending half then a descending half (ties included: few distinct keys)
    x = alternately_sorted(keys((n,), seed=n + run + order, lo=-5, hi=5), run // 2).to(DEV)
    out = torch.empty_like(x)
    _merge_kernel[(1,)](x, out, N=n, RUN=run, ORDER=order)
    want = x.cpu().reshape(-1, run).sort(dim=-1).values
    if order == 1:
        want = want.flip(-1)
    elif order == 2:
        want[1::2] = want[1::2].flip(-1)
    assert torch.equal(out.cpu().reshape(-1, run), want)


@pytest.mark.parametrize("rows,width,k", [(4, 16, 16), (4, 256, 16), (8, 64, 8), (2, 128, 4), (16, 32, 16)])
def test_topk_of_sorted_chunks(rows, width, k):
    x = keys((rows, width), seed=rows * width + k)
    x[:, :3] = x[:, 5:6]  # equal keys in a row
    x = alternately_sorted(x, k).to(DEV)
    out = torch.empty(rows, k, dtype=torch.int64, device=DEV)
    _topk_kernel[(1,)](x, out, R=rows, W=width, K=k)
    assert torch.equal(out.cpu(), x.cpu().topk(k, dim=-1).values)  # descending


@pytest.mark.parametrize("rows,k", [(4, 16), (8, 4), (32, 8)])
def test_top_of_two_descending_lists(rows, k):
    a = keys((rows, k), seed=k).sort(dim=-1, descending=True).values
    b = keys((rows, k), seed=k + 1, lo=-(2**40), hi=2**40).sort(dim=-1, descending=True).values
    b[0] = a[0]  # a row where both lists hold the same keys
    out = torch.empty(rows, k, dtype=torch.int64, device=DEV)
    _two_kernel[(1,)](a.to(DEV), b.to(DEV), out, R=rows, K=k)
    assert torch.equal(out.cpu(), torch.cat([a, b], dim=-1).topk(k, dim=-1).values)
