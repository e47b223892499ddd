"""The sm_90 CuTe DSL sparse-attention forward: its host side on the CPU (work lists against a
list-based definition, the union-tile algorithm emulated in torch against the naive reference,
argument checks, dispatch), its compile for sm_90a where CUTLASS's DSL imports, and the kernel
itself against the reference on an sm_90 GPU with the DSL (skipped elsewhere)."""

from __future__ import annotations

import math

import pytest
import torch
from naive import naive_sparse_attention

from msakit.ops.sparse_attention import sm90
from msakit.ops.sparse_attention.sm90.consts import QBITS
from msakit.ops.sparse_attention.sm90.worklist import tile_count, union_worklist, union_worklist_reference

pytestmark = pytest.mark.usefixtures("one_thread")


def _selection(B, G, T, K, bs, gen, *, forced=True, pad=0.3, dup=True):
    """A valid selection with -1 padding, repeated ids, the own block forced (optionally) and rows
    that select nothing."""
    own = (torch.arange(T) // bs).view(1, 1, T, 1)
    bi = (torch.rand(B, G, T, K, generator=gen) * (own + 1)).long()
    if forced:
        bi[..., -1:] = own[..., 0:1]
    bi = torch.where(torch.rand(B, G, T, K, generator=gen) < pad, torch.full_like(bi, -1), bi)
    if dup:
        bi[..., 0] = bi[..., 1]
    bi[:, :, T // 3] = -1  # a query that selects nothing
    return bi.int()


def _check_worklist(bi, queries, nb):
    work, count = union_worklist(bi, queries, nb)
    ref = union_worklist_reference(bi, queries)
    B, G = bi.shape[:2]
    assert work.dtype == torch.int32 and count.dtype == torch.int32
    assert work.shape[:3] == count.shape == (B, G, tile_count(bi.shape[2], queries))
    for b in range(B):
        for g in range(G):
            for t, want in enumerate(ref[b][g]):
                n = int(count[b, g, t])
                got = [(int(e) >> QBITS, int(e) & ((1 << QBITS) - 1)) for e in work[b, g, t, :n]]
                assert got == want
                assert bool((work[b, g, t, n:] == -1).all())


@pytest.mark.parametrize("T,K,queries,bs", [(37, 4, 8, 8), (100, 6, 4, 16), (5, 3, 8, 4), (64, 8, 8, 8)])
def test_union_worklist_matches_definition(T, K, queries, bs):
    gen = torch.Generator().manual_seed(T * 7 + K)
    bi = _selection(2, 3, T, K, bs, gen)
    _check_worklist(bi, queries, tile_count(T, bs))


def test_union_worklist_identical_rows_and_empty_tiles():
    bi = torch.full((1, 1, 16, 4), -1, dtype=torch.int32)
    bi[0, 0, :8] = torch.tensor([3, 1, 3, -1], dtype=torch.int32)  # all 8 queries agree
    work, count = union_worklist(bi, 8, 4)
    assert count.tolist() == [[[2, 0]]]
    assert [(int(e) >> QBITS, int(e) & 255) for e in work[0, 0, 0, :2]] == [(1, 255), (3, 255)]
    assert bool((work[0, 0, 1] == -1).all())


def test_union_worklist_checks_arguments():
    bi = torch.zeros(1, 1, 4, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="queries"):
        union_worklist(bi, QBITS + 1, 4)
    with pytest.raises(ValueError, match="block_idx"):
        union_worklist(bi.float(), 8, 4)
    with pytest.raises(ValueError, match="nblocks"):
        union_worklist(bi, 8, 0)


def emulate_union_tile(q, k, v, work, count, queries, bs, scale):
    """The kernel's algorithm in float64 torch: per (b, g, tile) the union's blocks in order, a
    per-row mask from the entry's bits, the causal mask on blocks at or past the tile's block,
    online softmax; o = acc / sum (0 without keys), lse = m + log(sum) (-inf without keys).  The
    kernel computes the same values (P V of entry i is added before the rescale of entry i + 1),
    only with the next entry's S issued before this entry's P V."""
    B, T, Hq, D = q.shape
    G = k.shape[2]
    hpg = Hq // G
    o = torch.zeros(B, T, Hq, D, dtype=torch.float64)
    lse = torch.full((B, Hq, T), float("-inf"), dtype=torch.float64)
    for b in range(B):
        for g in range(G):
            for tile in range(work.shape[2]):
                t0 = tile * queries
                tq = torch.arange(t0, t0 + queries)
                rows_t = tq.repeat_interleave(hpg)  # row = query-in-tile * hpg + head
                rows_h = torch.arange(hpg).repeat(queries) + g * hpg
                qt = q[b, rows_t.clamp(max=T - 1), rows_h].double()
                m = torch.full((queries * hpg,), float("-inf"), dtype=torch.float64)
                s_acc = torch.zeros(queries * hpg, dtype=torch.float64)
                acc = torch.zeros(queries * hpg, D, dtype=torch.float64)
                own = t0 // bs
                for i in range(int(count[b, g, tile])):
                    e = int(work[b, g, tile, i])
                    blk, mask = e >> QBITS, e & ((1 << QBITS) - 1)
                    cols = torch.arange(blk * bs, blk * bs + bs)
                    kk = torch.zeros(bs, D, dtype=torch.float64)
                    vv = torch.zeros(bs, D, dtype=torch.float64)
                    inb = cols < T
                    kk[inb] = k[b, cols[inb], g].double()
                    vv[inb] = v[b, cols[inb], g].double()
                    s = qt @ kk.T
                    keep = ((mask >> (rows_t - t0)) & 1).bool().view(-1, 1).expand_as(s)
                    if blk >= own:
                        keep = keep & (cols.view(1, -1) <= rows_t.view(-1, 1))
                    s = torch.where(keep, s, torch.full_like(s, float("-inf")))
                    m_new = torch.maximum(m, s.max(1).values)
                    base = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
                    alpha = torch.exp((m - base) * scale)
                    p = torch.exp((s - base.view(-1, 1)) * scale)
                    s_acc = s_acc * alpha + p.sum(1)
                    acc = acc * alpha.view(-1, 1) + p @ vv
                    m = m_new
                ok = rows_t < T
                inv = torch.where(s_acc > 0, 1.0 / s_acc.clamp(min=1e-300), torch.zeros_like(s_acc))
                out = acc * inv.view(-1, 1)
                ls = torch.where(s_acc > 0, m * scale + torch.log(s_acc.clamp(min=1e-300)),
                                 torch.full_like(s_acc, float("-inf")))
                o[b, rows_t[ok], rows_h[ok]] = out[ok]
                lse[b, rows_h[ok], rows_t[ok]] = ls[ok]
    return o, lse


@pytest.mark.parametrize("T,queries", [(45, 8), (40, 4)])
def test_union_tile_algorithm_equals_reference(T, queries):
    """Union + per-row mask + causal mask from the tile's block on gives the reference exactly:
    ragged T (a partial last tile and block), -1 padding, repeated ids, a row with no key."""
    gen = torch.Generator().manual_seed(T)
    B, G, hpg, D, bs, K = 2, 2, 4, 8, 8, 3
    q = torch.randn(B, T, G * hpg, D, generator=gen)
    k = torch.randn(B, T, G, D, generator=gen)
    v = torch.randn(B, T, G, D, generator=gen)
    bi = _selection(B, G, T, K, bs, gen)
    scale = 1.0 / math.sqrt(D)
    work, count = union_worklist(bi, queries, tile_count(T, bs))
    o, lse = emulate_union_tile(q, k, v, work, count, queries, bs, scale)
    ro, rlse = naive_sparse_attention(q, k, v, bi, bs, scale)
    torch.testing.assert_close(o, ro, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, rlse, rtol=1e-10, atol=1e-10)
    assert torch.isinf(lse[:, :, T // 3]).all() and (o[:, T // 3] == 0).all()


def test_unsupported_reason():
    q = torch.zeros(1, 8, 64, 128, dtype=torch.bfloat16)
    k = torch.zeros(1, 8, 4, 128, dtype=torch.bfloat16)
    assert sm90.unsupported_reason(q, k, 128, None, need_device=False) is None
    assert "dtype" in sm90.unsupported_reason(q.half(), k.half(), 128, None, need_device=False)
    assert "head dim" in sm90.unsupported_reason(q[..., :64], k[..., :64], 128, None, need_device=False)
    assert "heads per kv" in sm90.unsupported_reason(q[:, :, :32], k, 128, None, need_device=False)
    assert "block_size" in sm90.unsupported_reason(q, k, 64, None, need_device=False)
    assert "cu_seqlens" in sm90.unsupported_reason(q, k, 128, torch.tensor([0, 8]), need_device=False)
    assert "device" in sm90.unsupported_reason(q, k, 128, None)  # CPU tensors
    with pytest.raises(ValueError, match="device"):
        sm90.sparse_attention_fwd_sm90(q, k, k, torch.zeros(1, 4, 8, 2, dtype=torch.int32), 128, 0.1)


def test_union_ratio():
    bi = torch.full((1, 1, 16, 2), -1, dtype=torch.int32)
    bi[0, 0, :, 0] = torch.arange(16) // 8  # 8 queries agree per tile: one block per tile
    work, count = union_worklist(bi, 4 * sm90.CONFIG["consumers"], 2)
    assert sm90.union_ratio(count, bi) == pytest.approx(1.0)
    bi[0, 0, :, 1] = torch.arange(16) % 2 + 2  # two more distinct blocks per tile, each half the rows
    work, count = union_worklist(bi, 4 * sm90.CONFIG["consumers"], 4)
    assert sm90.union_ratio(count, bi) == pytest.approx(3 * 8 * 2 / 32)


@pytest.mark.parametrize("T,K", [(45, 4), (300, 16), (129, 3)])
def test_worklist_from_union_plan_equals_the_sorted_worklist(T, K):
    """The work list converted from the Triton union plan (what the dispatch runs) holds the same
    entries and counts as the torch-sorted definition, on -1 padding, repeats, empty rows and
    ragged tails."""
    from msakit.ops.sparse_attention.union import union_plan

    gen = torch.Generator().manual_seed(T * 31 + K)
    bs, queries = 16, 8
    bi = _selection(2, 3, T, K, bs, gen)
    work, count = sm90.worklist_from_union_plan(union_plan(bi, queries), queries)
    ref_work, ref_count = union_worklist(bi, queries, tile_count(T, bs))
    assert torch.equal(count, ref_count)
    n = ref_work.shape[-1]
    assert torch.equal(work[..., :n], ref_work)
    assert bool((work[..., n:] == -1).all())


def test_worklist_from_union_plan_checks_the_plan():
    from msakit.ops.sparse_attention.union import union_plan

    plan = union_plan(torch.zeros(1, 1, 16, 2, dtype=torch.int32), 8)
    with pytest.raises(ValueError, match="queries"):
        sm90.worklist_from_union_plan(plan, 9)
    with pytest.raises(ValueError, match="plan must be"):
        sm90.worklist_from_union_plan(plan, 4)


def test_dispatch_runs_sm90_only_where_it_can_and_warns_once_without_the_dsl(monkeypatch):
    """`sparse_attention`'s forward sends union tiles to the sm_90 kernel only on CUDA tensors it
    takes; where only the DSL is missing it warns once and the Triton union kernel runs."""
    import importlib
    import types
    import warnings

    import msakit.ops.dispatch as dispatch

    sa = importlib.import_module("msakit.ops.sparse_attention")  # the module (the package exports the op)

    q = torch.zeros(1, 8, 16, 128, dtype=torch.bfloat16)
    assert not sa._sm90_runs(q, q[:, :, :1], 128, 8)  # CPU tensors
    fake_q = types.SimpleNamespace(is_cuda=True)
    monkeypatch.setattr(sm90, "unsupported_reason", lambda *a, **k: "no nvidia-cutlass-dsl")
    monkeypatch.setattr(dispatch, "_warned", set())
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert not sa._sm90_runs(fake_q, None, 128, 8)
        assert not sa._sm90_runs(fake_q, None, 128, 8)
    assert len([x for x in w if "nvidia-cutlass-dsl" in str(x.message)]) == 1
    monkeypatch.setattr(sm90, "unsupported_reason", lambda *a, **k: None)
    assert sa._sm90_runs(fake_q, None, 128, sm90.queries_per_tile())
    assert not sa._sm90_runs(fake_q, None, 128, sm90.queries_per_tile() // 2)
    monkeypatch.setattr(sm90, "unsupported_reason", lambda *a, **k: "dtype torch.float16")
    assert not sa._sm90_runs(fake_q, None, 128, 8)


def _partly_shared_selection(T, bs, K, G):
    """Each query: its own block, blocks 0-4 (the tile shares them) and two blocks of its own
    (6 + 2 qi, 7 + 2 qi for query qi of its 8-query tile), where causal: union ratio ~2.0."""
    bi = torch.full((1, G, T, K), -1, dtype=torch.int32)
    for t in range(T):
        own, qi = t // bs, t % 8
        sel = sorted({own, *[b for b in (0, 1, 2, 3, 4, 6 + 2 * qi, 7 + 2 * qi) if b <= own]})[:K]
        bi[0, :, t, :len(sel)] = torch.tensor(sel, dtype=torch.int32)
    return bi


def test_forward_sends_union_tiles_to_sm90_up_to_its_ratio(monkeypatch):
    """Between the Triton union kernel's ratio (1.6) and the sm_90 kernel's (2.1) the forward runs
    the sm_90 kernel on the plan's converted work list; above, the KV-outer kernel."""
    import importlib

    from msakit.ops.sparse_attention import triton as kv_outer
    from msakit.ops.sparse_attention import union

    sa = importlib.import_module("msakit.ops.sparse_attention")
    calls, ratios = [], []
    plan_fn = union.union_plan

    def recording_plan(bi, qt):
        plan = plan_fn(bi, qt)
        ratios.append(float(plan[3].mean()))
        return plan

    monkeypatch.setattr(union, "union_plan", recording_plan)
    monkeypatch.setattr(sa, "_sm90_runs", lambda *a: True)
    monkeypatch.setattr(sm90, "sparse_attention_fwd_sm90", lambda *a, worklist=None: calls.append(("sm90", worklist)))
    monkeypatch.setattr(kv_outer, "sparse_attention_fwd_triton", lambda *a: calls.append(("kv_outer", None)))
    T, bs, K, G, Hq, D = 512, 16, 8, 1, 16, 16
    q, k, v = torch.zeros(1, T, Hq, D), torch.zeros(1, T, G, D), torch.zeros(1, T, G, D)
    bi = _partly_shared_selection(T, bs, K, G)
    sa._fwd_impl(q, k, v, bi, None, bs, 0.25)
    assert union.UNION_MAX_RATIO < ratios[-1] <= union.UNION_MAX_RATIO_SM90
    assert [c[0] for c in calls] == ["sm90"]
    work, count = calls[0][1]
    ref_work, ref_count = union_worklist(bi, 8, tile_count(T, bs))
    assert torch.equal(count, ref_count) and torch.equal(work[..., :ref_work.shape[-1]], ref_work)
    g = torch.Generator().manual_seed(0)
    rnd = (torch.rand(1, G, T, K, generator=g) * (torch.arange(T) // bs + 1).view(1, 1, T, 1)).int()
    sa._fwd_impl(q, k, v, rnd, None, bs, 0.25)
    assert ratios[-1] > union.UNION_MAX_RATIO_SM90 and [c[0] for c in calls] == ["sm90", "kv_outer"]


def _cutlass():
    try:
        import cuda.bindings.driver  # noqa: F401
        import cutlass.cute  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.skipif(not _cutlass(), reason="nvidia-cutlass-dsl not installed (tools/bench/sparse_sm90.py --compile-only)")
@pytest.mark.parametrize("consumers,stages", [(2, 2), (1, 2), (2, 3)])
def test_kernel_compiles_for_sm90a(tmp_path, consumers, stages):
    """PTX for sm_90a: the first entry's S, the loop's S and P V, and the last entry's P V, 8
    k-blocks each (32 wgmma)."""
    from msakit.ops.sparse_attention.sm90.kernel import compile_check

    res = compile_check(str(tmp_path), consumers=consumers, stages=stages)
    ptx = [f for f in res["files"] if f.endswith(".ptx")]
    assert ptx
    text = (tmp_path / ptx[0]).read_text()
    assert text.count("wgmma.mma_async") == 32
    assert "setmaxnreg.inc" in text and "cp.async.bulk.tensor" in text


def _on_hopper_with_dsl():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and sm90.dsl_available()


@pytest.mark.skipif(not _on_hopper_with_dsl(), reason="needs an sm_90 GPU and nvidia-cutlass-dsl")
@pytest.mark.parametrize("T", [1000, 4096])
def test_kernel_matches_reference_cuda(T):
    from msakit.ops.sparse_attention.reference import sparse_attention_reference

    gen = torch.Generator().manual_seed(T)
    B, G, Hq, D, bs, K = 2, 4, 64, 128, 128, 16
    q, k, v = (torch.randn(B, T, n, D, generator=gen).to("cuda", torch.bfloat16) for n in (Hq, G, G))
    bi = _selection(B, G, T, K, bs, gen).cuda()
    o = torch.full_like(q, float("nan"))
    lse = torch.full((B, Hq, T), float("nan"), device="cuda")
    sm90.sparse_attention_fwd_sm90(q, k, v, bi, bs, 1.0 / math.sqrt(D), out=o, lse_out=lse)
    ro, rlse = sparse_attention_reference(q.float(), k.float(), v.float(), bi, block_size=bs, return_lse=True)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert float((o.float() - ro).norm() / ro.norm()) < 1e-2
    fin = torch.isfinite(rlse)
    assert torch.equal(fin, torch.isfinite(lse))
    assert float((lse - rlse)[fin].abs().max()) < 1e-2
