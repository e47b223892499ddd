"""`ops.sparse_attention_with_kl` (one call: the sparse attention output and the index KL from the
forward's lse) against the two-call form `sparse_attention` + `index_kl_loss`: outputs and
gradients of every input, on the reference, the CPU chunked path and the Triton kernels (under
TRITON_INTERPRET=1 on the CPU, or on CUDA).  Also: `index_kl_loss` without lse warns once."""

from __future__ import annotations

import warnings

import pytest
import torch

from msakit import ops
from msakit.ops import dispatch
from msakit.ops.dispatch import interpret_mode, triton_available

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KERNELS = triton_available() and (DEV.type == "cuda" or interpret_mode())
BACKENDS = ["reference", "auto"] + (["triton"] if KERNELS else [])

# (B, T, Hq, G, D, Di, block_size, topk, local_blocks, init_blocks)
SHAPES = {
    # T = 62: a ragged last block (14 of 16), and below the union kernel's 64-query tile at these 2 heads
    # per group (the union plan, ~2 s a call in the interpreter, would reject this selection anyway)
    "batch2": (2, 62, 4, 2, 16, 16, 16, 3, 1, 0),
    "forced_blocks": (1, 90, 6, 2, 16, 24, 16, 4, 2, 1),
    "fewer_blocks_than_topk": (1, 40, 4, 1, 16, 16, 16, 5, 1, 0),
}


def dtype_for(backend: str) -> torch.dtype:
    """The kernels on CUDA take 16-bit inputs only; float32 elsewhere (the interpreter, the references)."""
    return torch.float16 if backend == "triton" and DEV.type == "cuda" else torch.float32


def tol(backend: str) -> dict:
    return dict(rtol=2e-2, atol=2e-3) if dtype_for(backend) == torch.float16 else {}


def make(shape, seed, dtype=torch.float32, cu_seqlens=None):
    B, T, Hq, G, D, Di, bs, K, loc, ini = shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hq, D, generator=gen)
    k = torch.randn(B, T, G, D, generator=gen)
    v = torch.randn(B, T, G, D, generator=gen)
    qi = torch.randn(B, T, G, Di, generator=gen)
    ki = torch.randn(B, T, Di, generator=gen)
    q, k, v, qi, ki = (x.to(DEV, dtype) for x in (q, k, v, qi, ki))
    bi = ops.index_topk(qi, ki, block_size=bs, topk=K, local_blocks=loc, init_blocks=ini, cu_seqlens=cu_seqlens,
                        backend="reference")
    return (q, k, v, qi, ki), bi


def run(fn, inputs, gen_seed=1):
    """fn(q, k, v, q_idx, k_idx) -> (o, kl); returns (o, kl, grads of q, k, v, q_idx, k_idx) for the
    loss sum(o * w) + 3 * kl (w a fixed random cotangent)."""
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    o, kl = fn(*leaves)
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(gen_seed)).to(o.device, o.dtype)
    ((o * w).sum() + 3.0 * kl).backward()
    return o.detach(), kl.detach(), [x.grad for x in leaves]


def two_calls(bi, bs, backend, **kw):
    def fn(q, k, v, qi, ki):
        o = ops.sparse_attention(q, k, v, bi, block_size=bs, backend=backend, cu_seqlens=kw.get("cu_seqlens"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the lse-recompute notice
            kl = ops.index_kl_loss(q, k, qi, ki, bi, block_size=bs, backend=backend, **kw)
        return o, kl

    return fn


def one_call(bi, bs, backend, **kw):
    def fn(q, k, v, qi, ki):
        return ops.sparse_attention_with_kl(q, k, v, qi, ki, bi, block_size=bs, backend=backend, **kw)

    return fn


def assert_same(a, b, rtol=2e-5, atol=2e-6):
    o1, kl1, g1 = a
    o2, kl2, g2 = b
    torch.testing.assert_close(o1, o2, rtol=rtol, atol=atol)
    torch.testing.assert_close(kl1, kl2, rtol=rtol, atol=atol)
    for name, x, y in zip(("q", "k", "v", "q_idx", "k_idx"), g1, g2):
        assert (x is None) == (y is None), name
        # the KL's gradients are differences of two distributions (P_idx - P): compare them against
        # the gradient's own scale, where an lse that differs in its last bits moves P by ~1e-7
        scale = max(float(y.abs().max()), 1e-6)
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol * 10 * scale, msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(SHAPES))
def test_one_call_equals_two_calls(case, backend):
    shape = SHAPES[case]
    inputs, bi = make(shape, seed=list(SHAPES).index(case), dtype=dtype_for(backend))
    bs = shape[6]
    a = run(one_call(bi, bs, backend), inputs)
    b = run(two_calls(bi, bs, backend), inputs)
    assert a[2][0] is not None and a[2][3] is not None  # o reaches q, k, v; kl reaches q_idx, k_idx
    assert_same(a, b, **tol(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_documents(backend):
    shape = (1, 75, 4, 2, 16, 16, 16, 3, 1, 0)
    cu = torch.tensor([0, 20, 21, 75], dtype=torch.int32, device=DEV)
    inputs, bi = make(shape, seed=7, cu_seqlens=cu, dtype=dtype_for(backend))
    a = run(one_call(bi, 16, backend, cu_seqlens=cu), inputs)
    b = run(two_calls(bi, 16, backend, cu_seqlens=cu), inputs)
    assert_same(a, b, **tol(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_over_all_and_scales(backend):
    shape = SHAPES["batch2"]
    inputs, bi = make(shape, seed=3, dtype=dtype_for(backend))
    kw = dict(over="all", softmax_scale=0.3, index_softmax_scale=0.2)

    def one(q, k, v, qi, ki):
        return ops.sparse_attention_with_kl(q, k, v, qi, ki, bi, block_size=16, backend=backend, **kw)

    def two(q, k, v, qi, ki):
        o = ops.sparse_attention(q, k, v, bi, block_size=16, softmax_scale=0.3, backend=backend)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # over="all" on the kernel path runs the chunked one
            return o, ops.index_kl_loss(q, k, qi, ki, bi, block_size=16, backend=backend, **kw)

    assert_same(run(one, inputs), run(two, inputs), **tol(backend))


def test_return_lse_and_its_gradient():
    shape = SHAPES["forced_blocks"]
    backend = "triton" if KERNELS else "auto"
    inputs, bi = make(shape, seed=5, dtype=dtype_for(backend))
    t = tol(backend) or dict(rtol=2e-5, atol=2e-6)
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    o, kl, lse = ops.sparse_attention_with_kl(*leaves, bi, block_size=16, return_lse=True, backend=backend)
    o2, lse2 = ops.sparse_attention(*inputs[:3], bi, block_size=16, return_lse=True, backend=backend)
    torch.testing.assert_close(lse, lse2)
    torch.testing.assert_close(o, o2)
    lse.sum().backward()  # the lse stays differentiable in q and k, as sparse_attention's
    ref = [x.detach().clone().requires_grad_(True) for x in inputs[:3]]
    ops.sparse_attention(*ref, bi, block_size=16, return_lse=True, backend=backend)[1].sum().backward()
    torch.testing.assert_close(leaves[0].grad, ref[0].grad, **t)
    torch.testing.assert_close(leaves[1].grad, ref[1].grad, **t)
    assert leaves[3].grad is None and leaves[4].grad is None


@pytest.mark.skipif(not KERNELS, reason="needs triton on CUDA, or TRITON_INTERPRET=1")
def test_half_precision_kernels():
    # bf16 on CUDA; fp16 under the interpreter (whose bf16 tl.dot is wrong in triton 3.6)
    dtype = torch.bfloat16 if DEV.type == "cuda" else torch.float16
    shape = (1, 64, 4, 2, 32, 32, 16, 3, 1, 0)
    inputs, bi = make(shape, seed=9, dtype=dtype)
    a = run(one_call(bi, 16, "triton"), inputs)
    b = run(two_calls(bi, 16, "triton"), inputs)
    assert_same(a, b, rtol=2e-2, atol=2e-3)


def test_two_call_form_warns_once_and_one_call_does_not():
    inputs, bi = make(SHAPES["batch2"], seed=11)
    q, k, v, qi, ki = inputs
    dispatch._warned.discard("index_kl_loss:lse")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        ops.sparse_attention_with_kl(q, k, v, qi, ki, bi, block_size=16)
        _, lse = ops.sparse_attention(q, k, v, bi, block_size=16, return_lse=True)
        ops.index_kl_loss(q, k, qi, ki, bi, block_size=16, lse=lse)
        ops.index_kl_loss(q, k, qi, ki, bi, block_size=16, backend="reference")  # the reference never uses lse
    assert not [w for w in rec if "index_kl_loss" in str(w.message)]
    with warnings.catch_warnings(record=True) as rec:  # the kernel path recomputes the lse: warned once
        warnings.simplefilter("always")
        ops.index_kl_loss(q, k, qi, ki, bi, block_size=16)  # CPU tensors, "auto": the reference, no warning
        ops.index_kl_loss(q, k, qi, ki, bi, block_size=16, backend="triton")
        ops.index_kl_loss(q, k, qi, ki, bi, block_size=16, backend="triton")
    hits = [w for w in rec if "without lse" in str(w.message)]
    assert len(hits) == 1 and hits[0].category is RuntimeWarning
    assert "sparse_attention_with_kl" in str(hits[0].message)


def test_argument_checks():
    inputs, bi = make(SHAPES["batch2"], seed=13)
    q, k, v, qi, ki = inputs
    with pytest.raises(ValueError, match="over"):
        ops.sparse_attention_with_kl(q, k, v, qi, ki, bi, block_size=16, over="some")
    with pytest.raises(ValueError, match="block_idx"):
        ops.sparse_attention_with_kl(q, k, v, qi, ki, bi[:, :, :-1], block_size=16)
    bad = bi.clone()
    bad[0, 0, 0, 0] = 99
    with pytest.raises(ValueError, match="block_idx"):
        ops.sparse_attention_with_kl(q, k, v, qi, ki, bad, block_size=16)
    with pytest.raises(ValueError, match="q_idx"):
        ops.sparse_attention_with_kl(q, k, v, qi[:, :, :1], ki, bi, block_size=16)
    with pytest.raises(ValueError, match="v"):
        ops.sparse_attention_with_kl(q, k, v[..., :-1], qi, ki, bi, block_size=16)
    with pytest.raises(ValueError, match="backend"):
        ops.sparse_attention_with_kl(q, k, v, qi, ki, bi, block_size=16, backend="cuda")
