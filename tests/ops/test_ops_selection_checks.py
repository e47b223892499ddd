"""The sparse ops at the edges of their selections and inputs: a selection that is all padding
(-1) gives o = 0 and lse = -inf with zero gradients on every backend (the union-tile and
KV-outer kernels under TRITON_INTERPRET=1 included); `validate` refuses blocks after the
query (per document with cu_seqlens) with a ValueError naming block_idx; `check_finite`
refuses NaN / inf inputs with a ValueError naming the argument."""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch

from msakit import ops
from msakit.ops.dispatch import interpret_mode, triton_available
from msakit.ops.index_kl import selected_lse
from msakit.ops.sparse_attention.chunked import sparse_attention_chunked
from msakit.ops.sparse_attention.reference import sparse_attention_reference

KERNELS = triton_available() and interpret_mode()
BACKENDS = ["reference", "auto"] + (["triton"] if KERNELS else [])
CU = [0, 10, 10, 32]  # documents of 10, 0 and 22 tokens


def qkv(B, T, Hq, G, D, seed, Di=8):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return mk(B, T, Hq, D), mk(B, T, G, D), mk(B, T, G, D), mk(B, T, G, Di), mk(B, T, Di)


def grads(fn, leaves, seed=1):
    """fn(*leaves) -> (o, lse); the gradients of leaves for random cotangents of o and of lse
    (taken as 0 where lse is -inf, where no finite cotangent has a meaning)."""
    leaves = [x.detach().clone().requires_grad_(True) for x in leaves]
    o, lse = fn(*leaves)
    g = torch.Generator().manual_seed(seed)
    do, dlse = torch.randn(o.shape, generator=g), torch.randn(lse.shape, generator=g)
    return o, lse, torch.autograd.grad((o, lse), leaves, (do, dlse))


# ------------------------------------------------------------------------------ all padding
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cu", [None, CU], ids=["batch", "varlen"])
def test_all_padding_selection_gives_zeros_and_neg_inf(backend, cu):
    B, T, Hq, G, D, bs, K = 1, 32, 4, 2, 16, 16, 2
    q, k, v, _, _ = qkv(B, T, Hq, G, D, seed=1)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    bi = torch.full((B, G, T, K), -1, dtype=torch.int32)
    o, lse, (dq, dk, dv) = grads(
        lambda a, b, c: ops.sparse_attention(a, b, c, bi, block_size=bs, return_lse=True, cu_seqlens=cu_t,
                                             backend=backend), (q, k, v))
    assert o.shape == q.shape and lse.shape == (B, Hq, T) and lse.dtype == torch.float32
    assert torch.equal(o, torch.zeros_like(o)) and bool(torch.isneginf(lse).all())
    for g in (dq, dk, dv):
        assert torch.equal(g, torch.zeros_like(g))


@pytest.mark.skipif(not KERNELS, reason="needs triton under TRITON_INTERPRET=1")
def test_all_padding_runs_the_union_kernel(monkeypatch):
    # 8 heads per group: a union tile of 16 queries, which T = 32 fills; an empty union has ratio 0
    union = importlib.import_module("msakit.ops.sparse_attention.union")
    calls = []
    real = union.sparse_attention_fwd_union
    monkeypatch.setattr(union, "sparse_attention_fwd_union", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    B, T, Hq, G, D, bs, K = 1, 32, 16, 2, 16, 16, 2
    q, k, v, _, _ = qkv(B, T, Hq, G, D, seed=2)
    bi = torch.full((B, G, T, K), -1, dtype=torch.int32)
    o, lse, (dq, dk, dv) = grads(
        lambda a, b, c: ops.sparse_attention(a, b, c, bi, block_size=bs, return_lse=True, backend="triton"), (q, k, v))
    assert calls, "the union-tile kernel did not take the call"
    assert torch.equal(o, torch.zeros_like(o)) and bool(torch.isneginf(lse).all())
    assert all(torch.equal(g, torch.zeros_like(g)) for g in (dq, dk, dv))


def test_chunked_path_with_a_chunk_that_selects_nothing():
    # rows 0..7 (one whole chunk of 8) select nothing; the others their own block
    B, T, Hq, G, D, bs = 1, 24, 4, 2, 16, 8
    q, k, v, _, _ = qkv(B, T, Hq, G, D, seed=3)
    q, k, v = q.double(), k.double(), v.double()
    own = (torch.arange(T, dtype=torch.int32) // bs).view(1, 1, T, 1).expand(B, G, T, 1).clone()
    bi = torch.cat([own, torch.full_like(own, -1)], dim=-1)
    bi[:, :, :8] = -1
    o, lse, gr = grads(lambda a, b, c: sparse_attention_chunked(a, b, c, bi, bs, 0.25, chunk=8), (q, k, v))
    ro, rlse, rgr = grads(lambda a, b, c: sparse_attention_reference(a, b, c, bi, block_size=bs, softmax_scale=0.25,
                                                                     return_lse=True), (q, k, v))
    assert bool(torch.isneginf(lse[:, :, :8]).all()) and torch.equal(o[:, :8], torch.zeros_like(o[:, :8]))
    torch.testing.assert_close(o, ro)
    torch.testing.assert_close(lse, rlse.to(lse.dtype))
    for a, b in zip(gr, rgr):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_padding_index_kl_and_selected_lse(backend):
    B, T, Hq, G, D, bs, K = 1, 32, 4, 2, 16, 16, 2
    q, k, v, qi, ki = qkv(B, T, Hq, G, D, seed=4)
    bi = torch.full((B, G, T, K), -1, dtype=torch.int32)
    qi, ki = qi.requires_grad_(True), ki.requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the kernel's lse-recompute notice
        loss = ops.index_kl_loss(q, k, qi, ki, bi, block_size=bs, backend=backend)
    gq, gk = torch.autograd.grad(loss, (qi, ki))
    assert float(loss.detach()) == 0.0 and torch.equal(gq, torch.zeros_like(gq)) and torch.equal(gk, torch.zeros_like(gk))
    assert bool(torch.isneginf(selected_lse(q, k, bi, block_size=bs, backend=backend)).all())
    o, kl = ops.sparse_attention_with_kl(q, k, v, qi, ki, bi, block_size=bs, backend=backend)
    assert torch.equal(o, torch.zeros_like(o)) and float(kl.detach()) == 0.0


# ------------------------------------------------------------------------------ causality
def test_blocks_after_the_query_are_refused_under_validate():
    B, T, Hq, G, D, bs, K = 1, 32, 4, 2, 16, 8, 2
    q, k, v, qi, ki = qkv(B, T, Hq, G, D, seed=5)
    own = (torch.arange(T, dtype=torch.int32) // bs).view(1, 1, T, 1).expand(B, G, T, 1)
    good = torch.cat([own, torch.full_like(own, -1)], dim=-1).contiguous()
    bad = good.clone()
    bad[0, 1, 9, 1] = 2  # query 9 is in block 1: block 2 lies after it
    calls = {
        "sparse_attention": lambda b, **kw: ops.sparse_attention(q, k, v, b, block_size=bs, **kw),
        "index_kl_loss": lambda b, **kw: ops.index_kl_loss(q, k, qi, ki, b, block_size=bs, **kw),
        "selected_lse": lambda b, **kw: selected_lse(q, k, b, block_size=bs, **kw),
        "sparse_attention_with_kl": lambda b, **kw: ops.sparse_attention_with_kl(q, k, v, qi, ki, b, block_size=bs,
                                                                                 **kw),
    }
    for name, call in calls.items():
        call(good)  # own block and -1 padding: valid
        with pytest.raises(ValueError, match=r"block_idx selects 1 block\(s\) after .*block_idx\[0, 1, 9, 1\] = 2 > 1"):
            call(bad)
        call(bad, validate=False)  # unvalidated: the later block adds nothing
    # the later block changes nothing when not validated: same as the causal selection
    torch.testing.assert_close(calls["sparse_attention"](bad, validate=False), calls["sparse_attention"](good),
                               rtol=0, atol=0)


def test_causality_is_per_document_with_cu_seqlens():
    T, Hq, G, D, bs = 32, 4, 2, 16, 8
    q, k, v, _, _ = qkv(1, T, Hq, G, D, seed=6)
    cu = torch.tensor(CU, dtype=torch.int32)
    rel = torch.arange(T) - torch.tensor(CU)[torch.searchsorted(cu.long(), torch.arange(T), right=True) - 1]
    bi = (rel // bs).to(torch.int32).view(1, 1, T, 1).expand(1, G, T, 1).contiguous()
    ops.sparse_attention(q, k, v, bi, block_size=bs, cu_seqlens=cu)  # document-relative own blocks: valid
    bad = bi.clone()
    bad[0, 0, 12, 0] = 1  # query 12 is token 2 of the document starting at 10: its block is 0, not 1 (= 12 // 8)
    with pytest.raises(ValueError, match=r"block_idx\[0, 0, 12, 0\] = 1 > 0.*in its document"):
        ops.sparse_attention(q, k, v, bad, block_size=bs, cu_seqlens=cu)


def test_msakit_selections_pass_the_check():
    # index_topk with forced init and local blocks, and -1 padding where fewer blocks are valid
    B, T, Hq, G, D, bs = 1, 40, 4, 2, 16, 8
    q, k, v, qi, ki = qkv(B, T, Hq, G, D, seed=7)
    bi = ops.index_topk(qi, ki, block_size=bs, topk=4, local_blocks=2, init_blocks=2)
    assert bool((bi == -1).any())
    ref = ops.sparse_attention(q, k, v, bi, block_size=bs, validate=True)
    o = ops.msa_attention(q, k, v, qi, ki, block_size=bs, topk=4, local_blocks=2, init_blocks=2)
    torch.testing.assert_close(o, ref, rtol=0, atol=0)


# ------------------------------------------------------------------------------ check_finite
def _poison(x: torch.Tensor, value: float) -> torch.Tensor:
    x = x.clone()
    x.view(-1)[x.numel() // 2] = value
    return x


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_check_finite_names_the_argument(value):
    B, T, Hq, G, D, bs = 1, 24, 4, 2, 16, 8
    q, k, v, qi, ki = qkv(B, T, Hq, G, D, seed=8)
    bi = ops.index_topk(qi, ki, block_size=bs, topk=2)
    args = dict(q=q, k=k, v=v, q_idx=qi, k_idx=ki)
    ops_ = {
        "sparse_attention": (("q", "k", "v"), lambda a: ops.sparse_attention(a["q"], a["k"], a["v"], bi, block_size=bs,
                                                                             **a["kw"])),
        "index_kl_loss": (("q", "k", "q_idx", "k_idx"), lambda a: ops.index_kl_loss(
            a["q"], a["k"], a["q_idx"], a["k_idx"], bi, block_size=bs, **a["kw"])),
        "msa_attention": (("q", "k", "v", "q_idx", "k_idx"), lambda a: ops.msa_attention(
            a["q"], a["k"], a["v"], a["q_idx"], a["k_idx"], block_size=bs, topk=2, **a["kw"])),
        "sparse_attention_with_kl": (("q", "k", "v", "q_idx", "k_idx"), lambda a: ops.sparse_attention_with_kl(
            a["q"], a["k"], a["v"], a["q_idx"], a["k_idx"], bi, block_size=bs, **a["kw"])),
    }
    for op, (names, call) in ops_.items():
        call({**args, "kw": {"check_finite": True}})  # finite inputs pass
        for name in names:
            bad = {**args, name: _poison(args[name], value), "kw": {"check_finite": True}}
            with pytest.raises(ValueError, match=rf"^{name} holds NaN or inf"):
                call(bad)
            res = call({**bad, "kw": {}})  # off by default: the value reaches the result ...
            res = res if isinstance(res, tuple) else (res,)
            if not (op == "msa_attention" and name in ("q_idx", "k_idx")):  # ... but a NaN score never wins a slot
                assert any(not bool(torch.isfinite(r).all()) for r in res), (op, name)


def test_index_kl_check_finite_takes_the_neg_inf_of_an_empty_row():
    B, T, Hq, G, D, bs = 1, 24, 4, 2, 16, 8
    q, k, v, qi, ki = qkv(B, T, Hq, G, D, seed=9)
    bi = ops.index_topk(qi, ki, block_size=bs, topk=2)
    bi[:, :, 3] = -1  # a row selecting nothing: lse = -inf there
    _, lse = ops.sparse_attention(q, k, v, bi, block_size=bs, return_lse=True)
    assert bool(torch.isneginf(lse).any())
    ops.index_kl_loss(q, k, qi, ki, bi, block_size=bs, lse=lse, check_finite=True)
    with pytest.raises(ValueError, match="^lse holds NaN"):
        ops.index_kl_loss(q, k, qi, ki, bi, block_size=bs, lse=_poison(lse, float("nan")), check_finite=True)
