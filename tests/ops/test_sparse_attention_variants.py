"""The performance variants of the Triton sparse attention (slot-merge kernels, work-list
builders, TMA-store forward configs, overlapped merge) give the baseline's results bit for bit,
and the reference's within tolerance; run on the CPU through the Triton interpreter."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from msakit.ops._dispatch import interpret_mode  # noqa: E402
from msakit.ops.sparse_attention import sparse_attention_reference, sparse_attention_varlen_reference  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not interpret_mode(), reason="needs TRITON_INTERPRET=1 before triton is imported"),
    pytest.mark.usefixtures("one_thread"),
]


def kernels():
    from msakit.ops.sparse_attention import triton as k

    return k


def inputs(B, T, Hq, G, D, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, h, D, generator=g).to(dtype) for h in (Hq, G, G))
    return q, k, v


def messy(B, G, T, bs, topk, seed=0, dtype=torch.int32, empty_rows=0):
    """Ids in [-1, nblocks): duplicates, future blocks, -1 anywhere, the own block last."""
    g = torch.Generator().manual_seed(seed + 1)
    nb = (T + bs - 1) // bs
    bi = torch.randint(-1, nb, (B, G, T, topk), generator=g, dtype=torch.int64)
    if topk > 1:
        bi[..., 1] = bi[..., 0]
    bi[..., -1] = (torch.arange(T) // bs).view(1, 1, T)
    if empty_rows:
        bi[0, :, torch.randperm(T, generator=g)[:empty_rows]] = -1
    return bi.to(dtype)


def varlen_case(seed=11, G=2, topk=3, bs=16):
    cu = torch.tensor([0, 5, 5, 37, 80, 81], dtype=torch.int32)  # an empty and a 1-token document
    total = 81
    g = torch.Generator().manual_seed(seed)
    bi = torch.randint(-1, 3, (1, G, total, topk), generator=g, dtype=torch.int32)
    starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1])
    bi[..., -1] = ((torch.arange(total) - starts) // bs).to(torch.int32)
    return cu, bi


# B, T, Hq, G, D, bs, topk
CASES = {
    "partial_last_block": (1, 75, 4, 2, 32, 16, 3),
    "groups4_batch2": (2, 64, 8, 4, 16, 16, 3),
    "odd_heads_dims": (2, 45, 6, 2, 24, 12, 5),  # 3 heads per group, D = 24, odd topk
    "hpg16": (1, 40, 16, 1, 16, 8, 4),  # M3's 16 heads per group
}


def _check_ref(o, lse, q, k, v, bi, bs, cu=None):
    if cu is None:
        ro, rl = sparse_attention_reference(q, k, v, bi, block_size=bs, return_lse=True)
    else:
        ro, rl = sparse_attention_varlen_reference(q, k, v, bi, cu, block_size=bs, return_lse=True)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rl))
    fin = torch.isfinite(rl)
    torch.testing.assert_close(torch.where(fin, lse, 0.0), torch.where(fin, rl, 0.0), atol=3e-5, rtol=1e-4)
    torch.testing.assert_close(o, ro, atol=3e-5, rtol=1e-4)


@pytest.mark.parametrize("case", list(CASES))
def test_merge_kernels_bitwise(case):
    """The merge / reduce kernels alone on synthetic partials (NaN in every entry no valid slot
    names): every MERGE_CONFIGS entry equals v1 bit for bit, weighted (forward: o and lse) and
    not (backward: dq), at several chunk offsets."""
    K = kernels()
    B, T, Hq, G, D, bs, topk = CASES[case]
    N = B * T
    bi = messy(B, G, T, bs, topk, seed=T, empty_rows=3)
    geo = K._Geom(B, T, N, Hq, G, D, topk, Hq // G, bs, G * (N // bs + B + 1))
    sel = K._selection_rows(bi, geo)
    gen = torch.Generator().manual_seed(len(case))
    for n0, c in ((0, N), (5, min(29, N - 5))):
        it = K._items(sel, n0, c, geo, None, bs, 4, "cpu", "torch")
        M = G * c * topk
        used = torch.zeros(M, dtype=torch.bool)
        for g in range(G):
            for t in range(c):
                nv = int(it.nvalid[g, t])
                used[it.inv[(g * c + t) * topk : (g * c + t) * topk + nv].long()] = True
        P = torch.randn(M, geo.hpg, D, generator=gen)
        LP = torch.randn(M, geo.hpg, generator=gen) * 3
        P[~used], LP[~used] = float("nan"), float("nan")
        res = {}
        for name, mc in K.MERGE_CONFIGS.items():
            o = torch.full((B, T, Hq, D), float("nan"))
            lse = torch.full((B, Hq, T), float("nan"))
            K._merge(mc, P, LP, it, o, lse, n0, c, geo, True)
            dq = torch.full((B, T, Hq, D), float("nan"))
            K._merge(mc, P, P, it, dq, dq, n0, c, geo, False)
            res[name] = (o, lse, dq)
        rows = slice(n0, n0 + c)
        o1, l1, d1 = (x.reshape(N, Hq, -1)[rows] if x.dim() == 4 else x.permute(0, 2, 1).reshape(N, Hq)[rows] for x in res["v1"])
        assert not torch.isnan(o1).any() and not torch.isnan(d1).any() and not torch.isnan(l1).any()
        for name, r in res.items():
            for a, b in zip(r, res["v1"]):
                assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), name


@pytest.mark.parametrize("case", ["odd_heads_dims", "hpg16", "varlen"])
def test_merge_variants_end_to_end(case):
    """Forward with every MERGE_CONFIGS entry (NaN-poisoned partials and outputs, small chunks)
    equals v1 bit for bit and the reference within tolerance; the backward with a v2 dq reduce
    equals v1's dq bit for bit."""
    K = kernels()
    cu = None
    if case == "varlen":
        cu, bi = varlen_case()
        B, T, Hq, G, D, bs = 1, 81, 4, 2, 16, 16
    else:
        B, T, Hq, G, D, bs, topk = CASES[case]
        bi = messy(B, G, T, bs, topk, seed=T, empty_rows=3)
    q, k, v = inputs(B, T, Hq, G, D, seed=len(case))
    scale = 1.0 / math.sqrt(D)
    kw = dict(chunk_rows=29)
    o0, l0 = K.sparse_attention_fwd_triton(q, k, v, bi, cu, bs, scale, merge="v1", worklist="torch", **kw)
    _check_ref(o0, l0, q, k, v, bi, bs, cu)
    for name in K.MERGE_CONFIGS:
        o = torch.full_like(o0, float("nan"))
        lse = torch.full_like(l0, float("nan"))
        K.sparse_attention_fwd_triton(q, k, v, bi, cu, bs, scale, out=o, lse_out=lse, merge=name, poison=True, **kw)
        assert torch.equal(o, o0) and torch.equal(lse, l0), name
    do = torch.randn(o0.shape, generator=torch.Generator().manual_seed(3))
    dq0 = K.sparse_attention_bwd_triton(do, q, k, v, o0, l0, None, bi, cu, bs, scale, reduce="v1", worklist="torch", **kw)[0]
    dq = torch.full_like(q, float("nan"))
    K.sparse_attention_bwd_triton(do, q, k, v, o0, l0, None, bi, cu, bs, scale, dq_out=dq, reduce="v2s3t1", poison=True, **kw)
    assert torch.equal(dq, dq0)


def _same_items(a, b):
    assert a.max_items == b.max_items
    for f in ("ent_q", "inv", "nvalid", "it_count"):
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and torch.equal(x, y), f
    real = a.it_count > 0
    for f in ("it_key", "it_start"):
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and torch.equal(x[real], y[real]), f


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("topk", [1, 3, 4, 6])
def test_work_list_triton_equals_torch(dtype, topk):
    """`_build_items_tl` (Triton kernels) builds `_build_items`'s work list: same entries,
    inverse map, valid counts and items, for chunk offsets, item sizes, batch > 1 (a strided
    selection view), documents of unaligned start, int32 / int64 ids."""
    K = kernels()
    for B, T, G, bs in ((1, 90, 2, 8), (3, 37, 2, 8), (2, 20, 4, 16)):
        N = B * T
        bi = messy(B, G, T, bs, topk, seed=B * T + topk, dtype=dtype, empty_rows=2)
        geo = K._Geom(B, T, N, 2 * G, G, 16, topk, 2, bs, G * (N // bs + B + 1))
        sel = K._selection_rows(bi, geo)
        for n0, C in ((0, N), (7, min(33, N - 7)), (N - 5, 5)):
            for item_q in (1, 3, 4, 64):
                ds, pos = K._row_docs(n0, C, T, None, "cpu")
                want = K._build_items(sel[:, n0 : n0 + C], ds, pos, n0, N, bs, item_q, geo.nkeys_bound)
                got = K._build_items_tl(sel[:, n0 : n0 + C], None, None, n0, N, bs, item_q, geo.nkeys_bound, T)
                _same_items(got, want)
                got = K._build_items_tl(sel[:, n0 : n0 + C], ds, pos, n0, N, bs, item_q, geo.nkeys_bound)
                _same_items(got, want)


def test_work_list_triton_varlen():
    K = kernels()
    cu, bi = varlen_case(G=2, topk=4)
    N, G, bs = 81, 2, 16
    sel = bi[0]
    for n0, C in ((0, N), (3, 40)):
        ds, pos = K._row_docs(n0, C, N, cu, "cpu")
        want = K._build_items(sel[:, n0 : n0 + C], ds, pos, n0, N, bs, 4, G * (N // bs + 7))
        got = K._build_items_tl(sel[:, n0 : n0 + C], ds, pos, n0, N, bs, 4, G * (N // bs + 7))
        _same_items(got, want)


def test_worklists_give_same_results():
    K = kernels()
    B, T, Hq, G, D, bs, topk = 2, 70, 4, 2, 16, 16, 4
    q, k, v = inputs(B, T, Hq, G, D, seed=21)
    bi = messy(B, G, T, bs, topk, seed=21)
    scale = 1.0 / math.sqrt(D)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(0))
    res = {}
    for wl in ("torch", "triton"):
        o, lse = K.sparse_attention_fwd_triton(q, k, v, bi, None, bs, scale, worklist=wl, chunk_rows=40)
        dq = K.sparse_attention_bwd_triton(do, q, k, v, o, lse, None, bi, None, bs, scale, worklist=wl, chunk_rows=40)[0]
        res[wl] = (o, lse, dq)
    for a, b in zip(res["torch"], res["triton"]):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="worklist"):
        K.sparse_attention_fwd_triton(q, k, v, bi, None, bs, scale, worklist="numpy")


def test_tma_store_configs(monkeypatch):
    """Forward configs with tma_store: full sub-tiles go through the descriptor store (taken
    where a sub-tile is exactly BLOCK_M x D), the item's last partial sub-tile through the
    masked store; the result equals the plain store's bit for bit, and the descriptor path is
    skipped (same results) where D is not a power of two."""
    K = kernels()
    from triton.tools.tensor_descriptor import TensorDescriptor

    calls = []
    orig = TensorDescriptor.from_tensor

    def spy(*a, **kw):
        calls.append(a[1] if len(a) > 1 else kw.get("block_shape"))
        return orig(*a, **kw)

    monkeypatch.setattr(TensorDescriptor, "from_tensor", staticmethod(spy))
    for (B, T, Hq, G, D, bs, topk), tma_taken in (((2, 70, 4, 2, 16, 16, 4), True), ((1, 45, 6, 2, 24, 12, 3), False)):
        q, k, v = inputs(B, T, Hq, G, D, seed=T)
        bi = messy(B, G, T, bs, topk, seed=T)
        scale = 1.0 / math.sqrt(D)
        o0, l0 = K.sparse_attention_fwd_triton(q, k, v, bi, None, bs, scale)
        for cfg in (K.KernelConfig(16, 16, 4, 1, True, tma_store=True), K.KernelConfig(16, 8, 4, 1, False, tma_store=True),
                    K.KernelConfig(16, 24, 4, 1, True, True, tma_store=True)):
            calls.clear()
            o = torch.full_like(o0, float("nan"))
            lse = torch.full_like(l0, float("nan"))
            K.sparse_attention_fwd_triton(q, k, v, bi, None, bs, scale, out=o, lse_out=lse, config=cfg, poison=True, chunk_rows=31)
            assert torch.equal(o, o0) and torch.equal(lse, l0), cfg
            assert bool(calls) == tma_taken, (cfg, calls)


@pytest.mark.parametrize("case", ["partial_last_block", "odd_heads_dims", "hpg16", "varlen"])
def test_scalar_diag_bitwise(case):
    """scalar_diag (the diagonal-mask test from a sub-tile's first entry) gives the CTA-wide
    test's result bit for bit: partial blocks, block_size below the tile (12 of 16), varlen."""
    K = kernels()
    cu = None
    if case == "varlen":
        cu, bi = varlen_case()
        B, T, Hq, G, D, bs = 1, 81, 4, 2, 16, 16
    else:
        B, T, Hq, G, D, bs, topk = CASES[case]
        bi = messy(B, G, T, bs, topk, seed=T + 1, empty_rows=2)
    q, k, v = inputs(B, T, Hq, G, D, seed=len(case) + 1)
    for pre in (True, False):
        for qreg in (False, True):
            base = K.KernelConfig(16, 8, 4, 1, pre, qreg)
            diag = K.KernelConfig(16, 8, 4, 1, pre, qreg, scalar_diag=True)
            o0, l0 = K.sparse_attention_fwd_triton(q, k, v, bi, cu, bs, 1.0 / math.sqrt(D), config=base, chunk_rows=37)
            o, lse = K.sparse_attention_fwd_triton(q, k, v, bi, cu, bs, 1.0 / math.sqrt(D), config=diag, chunk_rows=37)
            assert torch.equal(o, o0) and torch.equal(lse, l0), (pre, qreg)
    _check_ref(o, lse, q, k, v, bi, bs, cu)


def test_scalar_diag_every_offset():
    """Sub-tiles whose first row sits at every offset 0 .. 15 of the diagonal block (rows before
    it select nothing), so an off-by-one in the scalar test shows."""
    K = kernels()
    T, Hq, G, D, bs = 48, 2, 1, 16, 16
    q, k, v = inputs(1, T, Hq, G, D, seed=4)
    own = (torch.arange(T) // bs).to(torch.int32)
    for drop in range(0, 9):
        bi = torch.stack([own, own - 1], -1).clamp(min=-1).view(1, 1, T, 2).clone()
        for b0 in range(0, T, bs):
            bi[0, 0, b0 : b0 + drop] = -1
        for pre in (True, False):
            cfg = K.KernelConfig(16, 8, 4, 1, pre, scalar_diag=True)  # 8 queries x 2 heads per sub-tile
            o, lse = K.sparse_attention_fwd_triton(q, k, v, bi, None, bs, 0.25, config=cfg)
            o0, l0 = K.sparse_attention_fwd_triton(q, k, v, bi, None, bs, 0.25, config=K.KernelConfig(16, 8, 4, 1, pre))
            assert torch.equal(o, o0) and torch.equal(lse, l0), (drop, pre)


def test_fwd_config_table_runs():
    """Every FWD_CONFIGS entry (the GPU sweep) runs and gives the default config's result (a
    small shape: its tiles are the GPU ones, e.g. 64 rows)."""
    K = kernels()
    B, T, Hq, G, D, bs, topk = 1, 40, 4, 2, 16, 16, 3
    q, k, v = inputs(B, T, Hq, G, D, seed=5)
    bi = messy(B, G, T, bs, topk, seed=5)
    scale = 1.0 / math.sqrt(D)
    o0, l0 = K.sparse_attention_fwd_triton(q, k, v, bi, None, bs, scale)
    for name in K.FWD_CONFIGS:
        o, lse = K.sparse_attention_fwd_triton(q, k, v, bi, None, bs, scale, config=name)
        torch.testing.assert_close(o, o0, atol=1e-6, rtol=1e-6, msg=name)
        torch.testing.assert_close(lse, l0, atol=1e-6, rtol=1e-6, msg=name)


def test_overlap_double_buffer():
    """overlap=True: two partial buffers used in turn (on the CPU without the side stream):
    the same o / lse as one buffer for the same chunks, poisoned buffers fully masked."""
    K = kernels()
    B, T, Hq, G, D, bs, topk = 2, 70, 4, 2, 16, 16, 4
    q, k, v = inputs(B, T, Hq, G, D, seed=9)
    bi = messy(B, G, T, bs, topk, seed=9, empty_rows=2)
    scale = 1.0 / math.sqrt(D)
    for cr in (17, 50, None):
        o0, l0 = K.sparse_attention_fwd_triton(q, k, v, bi, None, bs, scale, chunk_rows=cr, overlap=False)
        o = torch.full_like(o0, float("nan"))
        lse = torch.full_like(l0, float("nan"))
        K.sparse_attention_fwd_triton(q, k, v, bi, None, bs, scale, out=o, lse_out=lse, chunk_rows=cr, overlap=True, poison=True)
        assert torch.equal(o, o0) and torch.equal(lse, l0), cr
    cu, bv = varlen_case()
    q, k, v = inputs(1, 81, 4, 2, 16, seed=10)
    o0, l0 = K.sparse_attention_fwd_triton(q, k, v, bv, cu, 16, 0.25, chunk_rows=20, merge="v1", worklist="torch")
    o, lse = K.sparse_attention_fwd_triton(q, k, v, bv, cu, 16, 0.25, chunk_rows=20, overlap=True)
    assert torch.equal(o, o0) and torch.equal(lse, l0)
    _check_ref(o, lse, q, k, v, bv, 16, cu)


def test_bfloat16_variants():
    """bf16 partials through the new merge and work list: equal to v1 / torch bit for bit."""
    K = kernels()
    B, T, Hq, G, D, bs, topk = 1, 64, 4, 2, 32, 16, 3
    q, k, v = inputs(B, T, Hq, G, D, seed=31, dtype=torch.bfloat16)
    bi = messy(B, G, T, bs, topk, seed=31)
    o0, l0 = K.sparse_attention_fwd_triton(q, k, v, bi, None, bs, 0.2, merge="v1", worklist="torch")
    for name in ("v2", "v2s3t1", "v2s2t4w4"):
        o, lse = K.sparse_attention_fwd_triton(q, k, v, bi, None, bs, 0.2, merge=name, worklist="triton", overlap=True, chunk_rows=24)
        o1, l1 = K.sparse_attention_fwd_triton(q, k, v, bi, None, bs, 0.2, merge="v1", worklist="torch", chunk_rows=24)
        assert torch.equal(o, o1) and torch.equal(lse, l1), name
    assert (o0.float() - o.float()).abs().max() < 2e-2


def test_ab_run_smoke(monkeypatch, capsys):
    """`bench.ab_run` (the GPU A/B) end to end on a toy shape on the CPU (timings faked): every
    variant runs, is checked, equals the baseline, and the table prints."""
    from msakit.ops.sparse_attention import bench

    K = kernels()
    monkeypatch.setattr(bench, "M3_SHAPE", dict(Hq=4, G=2, D=16, block_size=16, topk=4))
    make = bench._m3_inputs
    monkeypatch.setattr(bench, "_m3_inputs", lambda T, device="cpu", seed=1, dtype=torch.float32: make(T, "cpu", seed, dtype))
    monkeypatch.setattr(bench, "_time_quick", lambda fn, reps=2: (fn(), 1.0)[1])
    monkeypatch.setattr(K, "CHUNK_BYTES", 20000)  # several chunks
    for name in ("FWD_DEFAULT", "MERGE_DEFAULT", "WORKLIST", "OVERLAP"):
        monkeypatch.setattr(K, name, getattr(K, name))  # restored after apply=True
    res = bench.ab_run(T_list=(100,), merges=["v1", "v2s3t1"], fwd_configs=["m64w4pd"], apply=True)
    rows = res[100]
    assert not any("error" in r for r in rows), rows
    assert {r["part"] for r in rows} == {"worklist", "merge", "bwd reduce", "forward"}
    assert all(r["same_as_base"] in ("", True) for r in rows)
    assert all(r["all_written"] and r["o_rel_err"] < 1e-5 for r in rows if r["part"] == "forward")
    assert "same_as_base" in capsys.readouterr().out
    assert res["best"]["merge"] in K.MERGE_CONFIGS and K.MERGE_DEFAULT == res["best"]["merge"]
