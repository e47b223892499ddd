"""The KV-outer Triton sparse attention (forward and backward) against the reference, run on
the CPU through the Triton interpreter (TRITON_INTERPRET=1: `make test` sets it, and
tests/conftest.py does without CUDA)."""

from __future__ import annotations

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from msakit.ops.dispatch import interpret_mode  # noqa: E402
from msakit.ops.dense import dense_attention  # noqa: E402
from msakit.ops.sparse_attention import (  # noqa: E402
    sparse_attention,
    sparse_attention_reference,
)
from tolerances import assert_close_sums  # noqa: E402
from tools.bench import sparse_attention as bench  # noqa: E402
from tools.bench.common import rel_err  # noqa: E402

pytestmark = pytest.mark.skipif(not interpret_mode(), reason="needs TRITON_INTERPRET=1 before triton is imported")


def kernels():
    from msakit.ops.sparse_attention import triton as k

    return k


def make_inputs(B, T, Hq, G, D, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hq, D, generator=g).to(dtype)
    k = torch.randn(B, T, G, D, generator=g).to(dtype)
    v = torch.randn(B, T, G, D, generator=g).to(dtype)
    return q, k, v


def messy_block_idx(B, G, T, bs, topk, seed=0, own=True, empty_rows=0):
    """Random ids in [-1, nblocks): duplicates, ids past the causal limit, -1 anywhere; the own
    block forced into the last slot when `own`; `empty_rows` rows of batch 0 select nothing."""
    g = torch.Generator().manual_seed(seed + 1)
    nb = (T + bs - 1) // bs
    bi = torch.randint(-1, nb, (B, G, T, topk), generator=g, dtype=torch.int32)
    if topk > 1:
        bi[..., 1] = bi[..., 0]  # a duplicate in every row
    if own:
        bi[..., -1] = (torch.arange(T, dtype=torch.int32) // bs).view(1, 1, T)
    if empty_rows:
        rows = torch.randperm(T, generator=g)[:empty_rows]
        bi[0, :, rows] = -1
    return bi


def fwd_bwd(q, k, v, bi, bs, backend, cu=None, lse_grad=True, seed=7):
    qs, ks, vs = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    o, lse = sparse_attention(qs, ks, vs, bi, block_size=bs, return_lse=True, cu_seqlens=cu, backend=backend,
                              validate=False)  # messy selections hold blocks after the query
    g = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=g).to(o.dtype)
    loss = (o * do).sum()
    if lse_grad:
        dl = torch.randn(lse.shape, generator=g)
        loss = loss + (torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)) * dl).sum()
    dq, dk, dv = torch.autograd.grad(loss, (qs, ks, vs))
    return o.detach(), lse.detach(), dq, dk, dv


def assert_match(a, b, atol=3e-5, rtol=1e-4):
    names = ("o", "lse", "dq", "dk", "dv")
    for name, x, y in zip(names, a, b):
        assert x.shape == y.shape and x.dtype == y.dtype, name
        assert torch.equal(torch.isneginf(x), torch.isneginf(y)), name
        assert not torch.isnan(x).any(), name
        fx = torch.where(torch.isfinite(y), x, torch.zeros_like(x))
        fy = torch.where(torch.isfinite(y), y, torch.zeros_like(y))
        torch.testing.assert_close(fx, fy, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


# B, T, Hq, G, D, bs, topk
CASES = {
    "basic": (1, 100, 4, 2, 16, 16, 4),
    "partial_last_block": (1, 75, 4, 2, 32, 16, 3),
    "T_below_block_size": (1, 10, 4, 2, 16, 16, 2),
    "T_1": (1, 1, 4, 2, 16, 16, 2),
    "fewer_blocks_than_topk": (1, 40, 4, 2, 16, 16, 6),
    "groups4_batch2": (2, 64, 8, 4, 16, 16, 3),
    "one_group_4_heads": (1, 50, 4, 1, 16, 16, 3),
    "odd_sizes": (2, 45, 6, 2, 24, 12, 3),  # 3 heads per group, D = 24, block_size = 12
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case):
    B, T, Hq, G, D, bs, topk = CASES[case]
    q, k, v = make_inputs(B, T, Hq, G, D, seed=len(case))
    bi = messy_block_idx(B, G, T, bs, topk, seed=T)
    got = fwd_bwd(q, k, v, bi, bs, "triton")
    want = fwd_bwd(q, k, v, bi, bs, "reference")
    assert_match(got, want)


def test_empty_rows():
    """Rows selecting nothing (all -1, or only future blocks): o = 0, lse = -inf, zero grads."""
    B, T, Hq, G, D, bs = 1, 48, 4, 2, 16, 16
    q, k, v = make_inputs(B, T, Hq, G, D, seed=3)
    bi = messy_block_idx(B, G, T, bs, 3, own=False, empty_rows=6)
    bi[0, 1, 5] = torch.tensor([2, 1, -1], dtype=torch.int32)  # only future blocks
    got = fwd_bwd(q, k, v, bi, bs, "triton", lse_grad=False)
    want = fwd_bwd(q, k, v, bi, bs, "reference", lse_grad=False)
    assert_match(got, want)
    o, lse = got[0], got[1]
    assert torch.isneginf(lse[0, 2:4, 5]).all() and (o[0, 5, 2:4] == 0).all()


def test_all_blocks_equals_dense():
    B, T, Hq, G, D, bs = 2, 40, 4, 2, 16, 16
    q, k, v = make_inputs(B, T, Hq, G, D, seed=5)
    nb = (T + bs - 1) // bs
    bi = torch.arange(nb, dtype=torch.int32).expand(B, G, T, nb).contiguous()
    o = sparse_attention(q, k, v, bi, block_size=bs, backend="triton", validate=False)  # later blocks add nothing
    torch.testing.assert_close(o, dense_attention(q, k, v), atol=2e-5, rtol=1e-4)


def test_varlen_documents():
    # documents of 5, 0 (empty), 32, 43 and 1 tokens; ids relative to each document's start
    cu = torch.tensor([0, 5, 5, 37, 80, 81], dtype=torch.int32)
    total, Hq, G, D, bs = 81, 4, 2, 16, 16
    q, k, v = make_inputs(1, total, Hq, G, D, seed=11)
    g = torch.Generator().manual_seed(12)
    bi = torch.randint(-1, 3, (1, G, total, 3), generator=g, dtype=torch.int32)
    starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1])
    bi[..., -1] = ((torch.arange(total) - starts) // bs).to(torch.int32)  # own block, doc-relative
    got = fwd_bwd(q, k, v, bi, bs, "triton", cu=cu)
    want = fwd_bwd(q, k, v, bi, bs, "reference", cu=cu)
    assert_match(got, want)
    # a document alone gives the same rows (its ids >= 2 lie past its end: dropped either way)
    bd = bi[:, :, 5:37].masked_fill(bi[:, :, 5:37] >= 2, -1)
    o_doc = sparse_attention(q[:, 5:37], k[:, 5:37], v[:, 5:37], bd, block_size=bs, backend="triton", validate=False)
    assert_close_sums(got[0][:, 5:37], o_doc, n=D + bs + bi.shape[-1], msg="o")  # other work lists: other tiles


def test_varlen_reference_is_a_loop_over_documents():
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)
    q, k, v = make_inputs(1, 20, 2, 1, 8, seed=2)
    bi = messy_block_idx(1, 1, 20, 4, 3, seed=2)
    bi = bi.clamp(max=3)
    o, lse = sparse_attention_reference(q, k, v, bi, cu_seqlens=cu, block_size=4, return_lse=True)
    for s, e in ((0, 7), (7, 20)):
        ro, rl = sparse_attention_reference(q[:, s:e], k[:, s:e], v[:, s:e], bi[:, :, s:e], block_size=4, return_lse=True)
        torch.testing.assert_close(o[:, s:e], ro)
        torch.testing.assert_close(lse[:, :, s:e], rl)


def test_chunks_poison_and_configs():
    """Query chunking, NaN-poisoned outputs and partial buffers, other tile / item sizes and the
    GPU default configs (run under the interpreter) all give the unchunked result, up to the
    summation order of the length-D, length-block_size and length-topk reductions (forward) and
    of the dK / dV sums over every query of a key (backward)."""
    K = kernels()
    B, T, Hq, G, D, bs, topk = 2, 70, 4, 2, 16, 16, 4
    q, k, v = make_inputs(B, T, Hq, G, D, seed=21)
    bi = messy_block_idx(B, G, T, bs, topk, seed=21)
    scale = 1.0 / math.sqrt(D)
    o0, l0 = K.sparse_attention_fwd_triton(q, k, v, bi, None, bs, scale)
    g = torch.Generator().manual_seed(0)
    do, dl = torch.randn(o0.shape, generator=g), torch.randn(l0.shape, generator=g)
    g0 = K.sparse_attention_bwd_triton(do, q, k, v, o0, l0, dl, bi, None, bs, scale)
    n_fwd, n_bwd = D + bs + topk, D + T * (Hq // G) * topk
    variants = [
        dict(config=K.KernelConfig(16, 8, 4, 1), chunk_rows=50),
        dict(config=K.FWD_CONFIG, bwd_config=K.BWD_CONFIG, chunk_rows=17),  # the GPU tiles and item lengths
    ]
    for kw in variants:
        bwd_cfg = kw.pop("bwd_config", kw.get("config"))
        o = torch.full_like(q, float("nan"))
        lse = torch.full_like(l0, float("nan"))
        K.sparse_attention_fwd_triton(q, k, v, bi, None, bs, scale, out=o, lse_out=lse, poison=True, **kw)
        assert_close_sums(o, o0, n=n_fwd, msg=f"o {kw}")
        assert_close_sums(lse, l0, n=n_fwd, msg=f"lse {kw}")
        kw["config"] = bwd_cfg
        outs = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
        K.sparse_attention_bwd_triton(do, q, k, v, o0, l0, dl, bi, None, bs, scale,
                                      dq_out=outs[0], dk_out=outs[1], dv_out=outs[2], poison=True, **kw)
        for name, a, b in zip(("dq", "dk", "dv"), outs, g0):
            assert_close_sums(a, b, n=n_bwd, msg=f"{name} {kw}")


def test_bfloat16():
    B, T, Hq, G, D, bs, topk = 1, 64, 4, 2, 32, 16, 3
    q, k, v = make_inputs(B, T, Hq, G, D, seed=31, dtype=torch.bfloat16)
    bi = messy_block_idx(B, G, T, bs, topk, seed=31)
    got = fwd_bwd(q, k, v, bi, bs, "triton")
    want = fwd_bwd(q.float(), k.float(), v.float(), bi, bs, "reference")
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), got, want):
        assert rel_err(a, b) < 2e-2, name


def test_work_list():
    """Every valid (group, query, slot) of the canonical selection is in exactly one item; an
    item's entries share its key; items of one key are adjacent; counts <= item size."""
    from msakit.ops.k2q import canonical_selection

    K = kernels()
    B, T, G, bs, topk, E = 1, 90, 2, 8, 5, 4
    bi = messy_block_idx(B, G, T, bs, topk, seed=9)
    n0, C, N = 20, 50, T
    ds, pos = K._row_docs(n0, C, T, None, "cpu")
    it = K._build_items(bi[0][:, n0 : n0 + C], ds, pos, n0, N, bs, E, G * (N // bs + 2))
    canon = canonical_selection(bi, T, bs)[0]  # [G, T, K]
    want = {(g, n, s) for g in range(G) for n in range(n0, n0 + C) for s in range(topk) if canon[g, n, s] >= 0}
    assert it.nvalid.tolist() == (canon[:, n0 : n0 + C] >= 0).sum(-1).tolist()
    key_of, keys = {}, []
    for i in range(it.max_items):
        c = int(it.it_count[i])
        if c == 0:
            continue
        assert c <= E
        key = int(it.it_key[i])
        keys.append(key)
        for e in range(int(it.it_start[i]), int(it.it_start[i]) + c):
            assert e not in key_of  # each entry in one item
            key_of[e] = key
    # inv names each valid (group, query, slot)'s entry: its query and its item's key agree
    K_ = canon.shape[-1]
    ents = []
    for g, n, s in sorted(want):
        e = int(it.inv[(g * C + n - n0) * K_ + s])
        assert int(it.ent_q[e]) == n
        assert key_of[e] == g * N + int(canon[g, n, s]) * bs
        ents.append(e)
    assert len(set(ents)) == len(ents) == len(key_of)
    assert all(keys[i] <= keys[i + 1] for i in range(len(keys) - 1))


def test_random_block_idx_contract():
    g = torch.Generator().manual_seed(0)
    B, G, T, bs, topk = 2, 2, 200, 16, 5
    bi = bench.random_block_idx(B, G, T, bs, topk, g)
    assert bi.dtype == torch.int32 and bi.shape == (B, G, T, topk)
    for row, i in ((bi[b, r, i], i) for b in range(B) for r in range(G) for i in range(0, T, 7)):
        ids = [int(x) for x in row]
        nv = sum(x >= 0 for x in ids)
        assert all(x >= 0 for x in ids[:nv]) and all(x == -1 for x in ids[nv:])
        assert ids[nv - 1] == i // bs and len(set(ids[:nv])) == nv == min(topk, i // bs + 1)
        assert all(x < i // bs for x in ids[: nv - 1])
    rows = torch.tensor([0, 17, 199])
    q, k, v = make_inputs(1, T, 4, G, 8, seed=1)
    o, lse = bench.reference_rows(q, k, v, bi[:1], rows, block_size=bs)
    ro, rl = sparse_attention_reference(q, k, v, bi[:1], block_size=bs, return_lse=True)
    torch.testing.assert_close(o, ro[0, rows])
    torch.testing.assert_close(lse, rl[0][:, rows])


def test_custom_op_and_fake():
    B, T, Hq, G, D, bs = 1, 20, 4, 2, 16, 16
    q, k, v = make_inputs(B, T, Hq, G, D, seed=41)
    bi = messy_block_idx(B, G, T, bs, 2, seed=41)
    op = torch.ops.msakit.sparse_attention_fwd
    o, lse = op(q, k, v, bi, None, bs, 0.25)
    ro, rl = sparse_attention_reference(q, k, v, bi, block_size=bs, softmax_scale=0.25, return_lse=True)
    torch.testing.assert_close(o, ro, atol=3e-5, rtol=1e-4)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fq, fk, fv, fb = (mode.from_tensor(t) for t in (q, k, v, bi))
        fo, fl = op(fq, fk, fv, fb, None, bs, 0.25)
        assert fo.shape == q.shape and fo.dtype == q.dtype and fl.shape == (B, Hq, T) and fl.dtype == torch.float32
        dq, dk, dv = torch.ops.msakit.sparse_attention_bwd(fo, fq, fk, fv, fo, fl, None, fb, None, bs, 0.25)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def test_backend_handling():
    B, T, Hq, G, D, bs = 1, 20, 4, 2, 16, 16
    q, k, v = make_inputs(B, T, Hq, G, D, seed=51)
    bi = messy_block_idx(B, G, T, bs, 2, seed=51)
    ref = sparse_attention_reference(q, k, v, bi, block_size=bs)
    assert torch.equal(sparse_attention(q, k, v, bi, block_size=bs, backend="reference", validate=False), ref)
    torch.testing.assert_close(sparse_attention(q, k, v, bi, block_size=bs, validate=False), ref)  # auto on CPU: the chunked path
    with pytest.raises(ValueError, match="backend"):
        sparse_attention(q, k, v, bi, block_size=bs, backend="cuda", validate=False)
    with pytest.raises(ValueError, match="float64"):
        sparse_attention(q.double(), k.double(), v.double(), bi, block_size=bs, backend="triton", validate=False)
    o64 = sparse_attention(q.double(), k.double(), v.double(), bi, block_size=bs, validate=False)  # auto: the PyTorch (chunked) path
    assert o64.dtype == torch.float64
    with pytest.raises(ValueError, match="block_size"):
        sparse_attention(q, k, v, torch.zeros_like(bi), block_size=512, backend="triton")
    cu = torch.tensor([0, 8, T], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens"):
        sparse_attention(q, k, v, bi, block_size=bs, cu_seqlens=torch.tensor([0, 8, T - 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens"):
        sparse_attention(q, k, v, bi, block_size=bs, cu_seqlens=cu.float())
    with pytest.raises(ValueError, match="cu_seqlens"):
        q2, k2, v2 = (torch.cat([t, t]) for t in (q, k, v))
        sparse_attention(q2, k2, v2, torch.cat([bi, bi]), block_size=bs, cu_seqlens=cu)
    o = sparse_attention(q, k, v, bi, block_size=bs, cu_seqlens=cu, validate=False)  # auto on CPU: varlen reference
    torch.testing.assert_close(o, sparse_attention_reference(q, k, v, bi, cu_seqlens=cu, block_size=bs))


def test_opcheck_and_autograd_function():
    """torch.library.opcheck (schema, fake tensors, autograd registration, AOT dispatch) and
    the plain autograd.Function fallback."""
    from msakit.ops.sparse_attention import SparseAttentionFunction

    B, T, Hq, G, D, bs = 1, 20, 4, 2, 16, 16
    q, k, v = (t.requires_grad_(True) for t in make_inputs(B, T, Hq, G, D, seed=61))
    bi = messy_block_idx(B, G, T, bs, 2, seed=61)
    torch.library.opcheck(torch.ops.msakit.sparse_attention_fwd.default, (q, k, v, bi, None, bs, 0.25))
    o, lse = SparseAttentionFunction.apply(q, k, v, bi, None, bs, 0.25)
    grads = torch.autograd.grad(o.square().sum() + lse.sum(), (q, k, v))
    ro, rl = sparse_attention_reference(q, k, v, bi, block_size=bs, softmax_scale=0.25, return_lse=True)
    want = torch.autograd.grad(ro.square().sum() + rl.sum(), (q, k, v))
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b, atol=3e-5, rtol=1e-4)
