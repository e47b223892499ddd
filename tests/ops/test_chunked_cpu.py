"""The chunked matmul paths (`sparse_attention/chunked.py`, `index_kl/chunked.py`) against the
references, values and gradients, and index_kl_loss(over="all") against a dense computation."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from msakit import ops
from msakit.ops.index_kl import index_kl_loss_reference, selected_lse_reference
from msakit.ops.index_kl.chunked import index_kl_loss_chunked
from msakit.ops.sparse_attention import sparse_attention_reference
from msakit.ops.sparse_attention.chunked import sparse_attention_chunked


def chunked_attention(q, k, v, bi, block_size, softmax_scale=None, cu_seqlens=None, chunk=None):
    """(o, lse) of `sparse_attention_chunked` with the public op's default scale 1/sqrt(D)."""
    scale = 1 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    return sparse_attention_chunked(q, k, v, bi, block_size, scale, cu_seqlens=cu_seqlens, chunk=chunk)


def chunked_kl(q, k, qi, ki, bi, block_size, softmax_scale=None, index_softmax_scale=None, **kw):
    """`index_kl_loss_chunked` with the public op's default scales 1/sqrt(D) and 1/sqrt(Di)."""
    scale = 1 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    iscale = 1 / math.sqrt(qi.shape[-1]) if index_softmax_scale is None else index_softmax_scale
    return index_kl_loss_chunked(q, k, qi, ki, bi, block_size, scale, iscale, **kw)


def tol(dtype: torch.dtype, n: int) -> dict:
    """rtol = atol = a few rounding errors of a reduction of n terms in `dtype` (worst case ~ n * eps)."""
    eps = torch.finfo(dtype).eps
    return dict(rtol=4 * eps * n, atol=4 * eps * n)


def messy_selection(B, G, T, K, bs, seed):
    """Random ids in [-1, nblk): -1 padding, repeats, blocks after the query's own block; the own
    block on most rows; a few rows that select nothing."""
    g = torch.Generator().manual_seed(seed)
    nblk = -(-T // bs)
    bi = torch.randint(-1, nblk, (B, G, T, K), generator=g, dtype=torch.int32)
    own = (torch.arange(T, dtype=torch.int32) // bs).view(1, 1, T)
    keep = torch.rand(B, G, T, generator=g) < 0.8
    bi[..., 0] = torch.where(keep, own, bi[..., 0])
    bi[:, 0, 3] = -1  # query 3 of group 0 selects nothing
    return bi


def qkv(B, T, Hq, G, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype).requires_grad_()  # noqa: E731
    return mk(B, T, Hq, D), mk(B, T, G, D), mk(B, T, G, D)


def attn_fwd_bwd(fn, q, k, v, seed):
    o, lse = fn(q, k, v)
    g = torch.Generator().manual_seed(seed)
    go = torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.device, o.dtype)
    gl = torch.randn(lse.shape, generator=g, dtype=torch.float64).to(lse.device, lse.dtype)
    fin = torch.isfinite(lse)
    loss = (o.float() * go.float()).sum() + (torch.where(fin, lse, torch.zeros_like(lse)) * gl).sum()
    grads = torch.autograd.grad(loss, (q, k, v))
    return (o.detach(), lse.detach()) + grads


GRID = [  # (Hq, G, D, bs, T, K, chunk): GQA 1, 2, 7; T not a multiple of bs; chunks not block-aligned
    (2, 2, 16, 16, 45, 3, 13),
    (4, 2, 32, 16, 70, 2, 24),
    (7, 1, 16, 32, 77, 3, 20),
    (14, 2, 32, 32, 100, 2, None),
    (4, 2, 16, 16, 33, 5, 1),
]


@pytest.mark.parametrize("Hq,G,D,bs,T,K,chunk", GRID)
def test_sparse_attention_chunked_equals_reference(Hq, G, D, bs, T, K, chunk):
    B = 2
    q, k, v = qkv(B, T, Hq, G, D, torch.float64, seed=T)
    bi = messy_selection(B, G, T, K, bs, seed=T + 1)
    want = attn_fwd_bwd(lambda a, b, c: sparse_attention_reference(a, b, c, bi, block_size=bs, return_lse=True), q, k, v, 1)
    got = attn_fwd_bwd(
        lambda a, b, c: chunked_attention(a, b, c, bi, bs, chunk=chunk), q, k, v, 1
    )
    # the reference returns lse in float32 (also for float64 inputs): compare it at float32's precision
    assert torch.equal(torch.isinf(want[1]), torch.isinf(got[1]))
    assert bool(torch.isinf(got[1][0, : Hq // G, 3]).all())  # the empty row of group 0
    assert torch.equal(got[0][0, 3, : Hq // G], torch.zeros_like(got[0][0, 3, : Hq // G]))
    fin = torch.isfinite(want[1])
    torch.testing.assert_close(got[1][fin], want[1][fin], **tol(torch.float32, D + K * bs))
    for name, a, b in zip(("o", "dq", "dk", "dv"), (got[0],) + got[2:], (want[0],) + want[2:]):
        torch.testing.assert_close(a, b, **tol(torch.float64, D + K * bs * T), msg=name)


def test_sparse_attention_chunked_float32_and_scale():
    B, T, Hq, G, D, bs, K = 1, 90, 6, 3, 32, 16, 4
    q, k, v = qkv(B, T, Hq, G, D, torch.float32, seed=5)
    bi = messy_selection(B, G, T, K, bs, seed=6)
    kw = dict(block_size=bs, return_lse=True, softmax_scale=0.3)
    want = attn_fwd_bwd(lambda a, b, c: sparse_attention_reference(a, b, c, bi, **kw), q, k, v, 2)
    got = attn_fwd_bwd(lambda a, b, c: chunked_attention(a, b, c, bi, bs, softmax_scale=0.3, chunk=17), q, k, v, 2)
    fin = torch.isfinite(want[1])
    torch.testing.assert_close(got[1][fin], want[1][fin], **tol(torch.float32, D + K * bs))
    for a, b in zip((got[0],) + got[2:], (want[0],) + want[2:]):
        torch.testing.assert_close(a, b, **tol(torch.float32, D + K * bs * 4))


def test_sparse_attention_chunked_bfloat16_output_rounding():
    B, T, Hq, G, D, bs, K = 1, 64, 4, 2, 16, 16, 2
    q, k, v = qkv(B, T, Hq, G, D, torch.bfloat16, seed=9)
    bi = messy_selection(B, G, T, K, bs, seed=10)
    want = sparse_attention_reference(q, k, v, bi, block_size=bs)
    got, _ = chunked_attention(q, k, v, bi, bs, chunk=24)
    assert got.dtype == torch.bfloat16
    # both compute in float32 and round once to bfloat16: at most one bfloat16 ulp apart
    torch.testing.assert_close(got.float(), want.float(), rtol=2 * torch.finfo(torch.bfloat16).eps, atol=1e-2)


def test_sparse_attention_chunked_varlen_equals_reference():
    T, Hq, G, D, bs, K = 75, 4, 2, 16, 16, 3
    q, k, v = qkv(1, T, Hq, G, D, torch.float64, seed=11)
    cu = torch.tensor([0, 20, 20, 51, 75], dtype=torch.int32)
    bi = torch.cat([messy_selection(1, G, e - s, K, bs, seed=s) for s, e in ((0, 20), (20, 51), (51, 75))], dim=2)
    want = attn_fwd_bwd(
        lambda a, b, c: sparse_attention_reference(a, b, c, bi, cu_seqlens=cu, block_size=bs, return_lse=True), q, k, v, 3
    )
    got = attn_fwd_bwd(
        lambda a, b, c: chunked_attention(a, b, c, bi, bs, cu_seqlens=cu, chunk=7),
        q, k, v, 3,
    )
    fin = torch.isfinite(want[1])
    torch.testing.assert_close(got[1][fin], want[1][fin], **tol(torch.float32, D + K * bs))
    for a, b in zip((got[0],) + got[2:], (want[0],) + want[2:]):
        torch.testing.assert_close(a, b, **tol(torch.float64, D + K * bs * T))


def test_public_sparse_attention_routes_cpu_auto_to_chunked():
    B, T, Hq, G, D, bs, K = 1, 40, 4, 2, 16, 16, 2
    q, k, v = qkv(B, T, Hq, G, D, torch.float64, seed=12)
    bi = messy_selection(B, G, T, K, bs, seed=13)
    auto = ops.sparse_attention(q, k, v, bi, block_size=bs, validate=False)  # messy: blocks after the query
    assert torch.equal(auto, chunked_attention(q, k, v, bi, bs)[0])
    ref = ops.sparse_attention(q, k, v, bi, block_size=bs, backend="reference", validate=False)
    assert torch.equal(ref, sparse_attention_reference(q, k, v, bi, block_size=bs))
    torch.testing.assert_close(auto, ref, **tol(torch.float64, D + K * bs))


# ------------------------------------------------------------------------------ index_kl_loss
def kl_inputs(B, T, Hq, G, D, Di, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    return mk(B, T, Hq, D), mk(B, T, G, D), mk(B, T, G, Di).requires_grad_(), mk(B, T, Di).requires_grad_()


def kl_and_grads(fn, q_idx, k_idx):
    loss = fn()
    return (loss.detach(),) + torch.autograd.grad(loss, (q_idx, k_idx))


KL_GRID = [  # (Hq, G, D, Di, bs, T, K, chunk)
    (2, 2, 16, 8, 16, 45, 3, 13),
    (4, 2, 32, 16, 16, 70, 2, 24),
    (7, 1, 16, 8, 32, 77, 3, 20),
    (14, 2, 32, 16, 32, 100, 2, None),
]


@pytest.mark.parametrize("Hq,G,D,Di,bs,T,K,chunk", KL_GRID)
def test_index_kl_chunked_equals_reference(Hq, G, D, Di, bs, T, K, chunk):
    B = 2
    q, k, qi, ki = kl_inputs(B, T, Hq, G, D, Di, torch.float64, seed=T)
    bi = messy_selection(B, G, T, K, bs, seed=T + 2)
    want = kl_and_grads(lambda: index_kl_loss_reference(q, k, qi, ki, bi, block_size=bs), qi, ki)
    got = kl_and_grads(lambda: chunked_kl(q, k, qi, ki, bi, bs, chunk=chunk), qi, ki)
    lse = selected_lse_reference(q, k, bi, block_size=bs)
    with_lse = kl_and_grads(lambda: chunked_kl(q, k, qi, ki, bi, bs, chunk=chunk, lse=lse), qi, ki)
    t = tol(torch.float64, max(D, Di) + K * bs * T)
    for a, b, c in zip(got, with_lse, want):
        torch.testing.assert_close(a, c, **t)
        torch.testing.assert_close(b, c, **t)


def test_index_kl_chunked_float32_and_scales():
    B, T, Hq, G, D, Di, bs, K = 1, 90, 6, 3, 32, 16, 16, 4
    q, k, qi, ki = kl_inputs(B, T, Hq, G, D, Di, torch.float32, seed=21)
    bi = messy_selection(B, G, T, K, bs, seed=22)
    kw = dict(block_size=bs, softmax_scale=0.2, index_softmax_scale=0.5)
    want = kl_and_grads(lambda: index_kl_loss_reference(q, k, qi, ki, bi, **kw), qi, ki)
    got = kl_and_grads(lambda: chunked_kl(q, k, qi, ki, bi, chunk=29, **kw), qi, ki)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol(torch.float32, max(D, Di) + K * bs * 4))


@pytest.mark.parametrize("over", ["selected", "all"])
def test_index_kl_chunked_varlen_equals_reference(over):
    T, Hq, G, D, Di, bs, K = 75, 4, 2, 16, 8, 16, 3
    q, k, qi, ki = kl_inputs(1, T, Hq, G, D, Di, torch.float64, seed=31)
    cu = torch.tensor([0, 20, 20, 51, 75], dtype=torch.int32)
    bi = torch.cat([messy_selection(1, G, e - s, K, bs, seed=s) for s, e in ((0, 20), (20, 51), (51, 75))], dim=2)
    kw = dict(block_size=bs, over=over)
    want = kl_and_grads(lambda: index_kl_loss_reference(q, k, qi, ki, bi, cu_seqlens=cu, **kw), qi, ki)
    got = kl_and_grads(lambda: chunked_kl(q, k, qi, ki, bi, cu_seqlens=cu, chunk=9, **kw), qi, ki)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol(torch.float64, max(D, Di) + T * T))


def dense_kl_all(q, k, q_idx, k_idx, scale, iscale):
    """KL over every token j <= i, from full [T, T] matrices (float64): the meaning of over="all"."""
    B, T, Hq, D = q.shape
    G = k.shape[2]
    hpg = Hq // G
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    total = 0.0
    for r in range(G):
        s = torch.einsum("bihd,bjd->bhij", q[:, :, r * hpg:(r + 1) * hpg].double(), k[:, :, r].double()) * scale
        P = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1).mean(dim=1)  # [B, T, T]
        z = torch.einsum("bid,bjd->bij", q_idx[:, :, r].double(), k_idx.double()) * iscale
        logq = torch.log_softmax(z.masked_fill(~causal, float("-inf")), dim=-1)
        total = total + torch.where(causal, P * (torch.log(P.clamp_min(1e-300)) - logq), torch.zeros_like(P)).sum()
    return total / (B * G * T)


@pytest.mark.parametrize("Hq,G,bs,T,chunk", [(2, 2, 16, 45, 13), (7, 1, 32, 70, None), (4, 2, 16, 33, 5)])
def test_index_kl_all_equals_dense(Hq, G, bs, T, chunk):
    B, D, Di = 2, 16, 8
    q, k, qi, ki = kl_inputs(B, T, Hq, G, D, Di, torch.float64, seed=T + 7)
    scale, iscale = 1 / math.sqrt(D), 1 / math.sqrt(Di)
    want = kl_and_grads(lambda: dense_kl_all(q, k, qi, ki, scale, iscale), qi, ki)
    ref = kl_and_grads(lambda: index_kl_loss_reference(q, k, qi, ki, None, block_size=bs, over="all"), qi, ki)
    got = kl_and_grads(lambda: chunked_kl(q, k, qi, ki, None, bs, over="all", chunk=chunk), qi, ki)
    public = kl_and_grads(lambda: ops.index_kl_loss(q, k, qi, ki, None, block_size=bs, over="all"), qi, ki)
    t = tol(torch.float64, max(D, Di) + T * T)
    for w, r, c, p in zip(want, ref, got, public):
        torch.testing.assert_close(r, w, **t)
        torch.testing.assert_close(c, w, **t)
        torch.testing.assert_close(p, w, **t)
    assert float(want[0]) > 0


def test_index_kl_all_differs_from_selected_and_ignores_block_idx():
    B, T, Hq, G, D, Di, bs = 1, 64, 4, 2, 16, 8, 16
    q, k, qi, ki = kl_inputs(B, T, Hq, G, D, Di, torch.float64, seed=41)
    bi = messy_selection(B, G, T, 1, bs, seed=42)
    sel = ops.index_kl_loss(q, k, qi, ki, bi, block_size=bs, validate=False)  # messy: blocks after the query
    a = ops.index_kl_loss(q, k, qi, ki, bi, block_size=bs, over="all", validate=False)
    b = ops.index_kl_loss(q, k, qi, ki, None, block_size=bs, over="all")
    assert torch.equal(a, b)
    assert abs(float(a.detach()) - float(sel.detach())) > 1e-3


def test_public_index_kl_routes_and_validates_over():
    B, T, Hq, G, D, Di, bs, K = 1, 40, 4, 2, 16, 8, 16, 2
    q, k, qi, ki = kl_inputs(B, T, Hq, G, D, Di, torch.float64, seed=51)
    bi = messy_selection(B, G, T, K, bs, seed=52)
    auto = ops.index_kl_loss(q, k, qi, ki, bi, block_size=bs, validate=False)  # messy: blocks after the query
    assert torch.equal(auto, chunked_kl(q, k, qi, ki, bi, bs))
    ref = ops.index_kl_loss(q, k, qi, ki, bi, block_size=bs, backend="reference", validate=False)
    torch.testing.assert_close(auto, ref, **tol(torch.float64, D + K * bs * T))
    with pytest.raises(ValueError, match="over"):
        ops.index_kl_loss(q, k, qi, ki, bi, block_size=bs, over="dense")
    with pytest.raises(ValueError, match="lse"):
        ops.index_kl_loss(q, k, qi, ki, bi, block_size=bs, over="all", lse=torch.zeros(B, Hq, T))
    with pytest.raises(ValueError, match="block_idx"):
        ops.index_kl_loss(q, k, qi, ki, None, block_size=bs)


def test_index_kl_chunked_no_grad_and_detached_teacher():
    B, T, Hq, G, D, Di, bs, K = 1, 40, 4, 2, 16, 8, 16, 2
    q, k, qi, ki = kl_inputs(B, T, Hq, G, D, Di, torch.float64, seed=61)
    q.requires_grad_()
    k.requires_grad_()
    bi = messy_selection(B, G, T, K, bs, seed=62)
    with torch.no_grad():
        v0 = chunked_kl(q, k, qi, ki, bi, bs)
    loss = chunked_kl(q, k, qi, ki, bi, bs)
    assert torch.equal(v0, loss.detach())
    loss.backward()
    assert q.grad is None and k.grad is None  # P is the teacher: no gradient reaches q, k
    assert qi.grad is not None and ki.grad is not None


def test_chunked_under_cpu_autocast_and_strided_inputs():
    # under autocast the chunked paths still compute in float32 (as the references' own math does)
    B, T, Hq, G, D, Di, bs, K = 1, 48, 4, 2, 16, 8, 16, 2
    q, k, v = qkv(B, T, Hq, G, D, torch.float32, seed=71)
    qs = q.detach().transpose(1, 2).contiguous().transpose(1, 2)  # same values, strided layout
    bi = messy_selection(B, G, T, K, bs, seed=72)
    want = sparse_attention_reference(q.detach(), k.detach(), v.detach(), bi, block_size=bs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = chunked_attention(qs, k.detach(), v.detach(), bi, bs, chunk=20)
        _, _, qi, ki = kl_inputs(B, T, Hq, G, D, Di, torch.float32, seed=73)
        kl = chunked_kl(q.detach(), k.detach(), qi, ki, bi, bs)
    assert got.dtype == torch.float32 and kl.dtype == torch.float32
    torch.testing.assert_close(got, want, **tol(torch.float32, D + K * bs))
    torch.testing.assert_close(kl, index_kl_loss_reference(q.detach(), k.detach(), qi, ki, bi, block_size=bs),
                               **tol(torch.float32, D + K * bs * T))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_chunked_on_cuda_equals_cpu_reference():
    B, T, Hq, G, D, Di, bs, K = 1, 300, 8, 2, 64, 32, 64, 3
    q, k, v = qkv(B, T, Hq, G, D, torch.float32, seed=81)
    bi = messy_selection(B, G, T, K, bs, seed=82)
    want = attn_fwd_bwd(lambda a, b, c: sparse_attention_reference(a, b, c, bi, block_size=bs, return_lse=True), q, k, v, 4)
    qc, kc, vc = (t.detach().cuda().requires_grad_() for t in (q, k, v))
    got = attn_fwd_bwd(
        lambda a, b, c: chunked_attention(a, b, c, bi.cuda(), bs, chunk=100), qc, kc, vc, 4
    )
    fin = torch.isfinite(want[1])
    torch.testing.assert_close(got[1].cpu()[fin], want[1][fin], rtol=1e-4, atol=1e-4)  # TF32 may be on
    for a, b in zip((got[0],) + got[2:], (want[0],) + want[2:]):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-2, atol=1e-2)
    _, _, qi, ki = kl_inputs(B, T, Hq, G, D, Di, torch.float32, seed=83)
    with warnings.catch_warnings():  # over="all" on CUDA warns once that it runs the chunked path
        warnings.simplefilter("ignore", RuntimeWarning)
        kl = ops.index_kl_loss(q.detach().cuda(), k.detach().cuda(), qi.detach().cuda(), ki.detach().cuda(), None,
                               block_size=bs, over="all")
    ref = index_kl_loss_reference(q.detach(), k.detach(), qi.detach(), ki.detach(), None, block_size=bs, over="all")
    torch.testing.assert_close(kl.cpu(), ref, rtol=1e-3, atol=1e-4)
