"""msa_decode: Triton kernels (TRITON_INTERPRET=1 on CPU) against the paged reference, and
decode rows against the prefill path (index_topk + sparse_attention on the whole sequence)."""

from __future__ import annotations

import random

import pytest
import torch

from msakit import ops
from msakit.cache import PagedKVCache
from msakit.ops.dispatch import interpret_mode
from msakit.ops.decode import DecodeTiling, msa_decode, msa_decode_reference, plan_decode

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    not (torch.cuda.is_available() or interpret_mode()), reason="needs CUDA or TRITON_INTERPRET=1"
)
FP8 = torch.float8_e4m3fn
HQ, G, D, DI, PS = 4, 2, 32, 16, 16


def build(lens, *, kv=torch.float32, idx=torch.float32, hq=HQ, g=G, d=D, di=DI, ps=PS, seed=0, pages=None, shuffle=True):
    """A one-layer cache with random sequences of the given lengths (pages handed out in a
    shuffled order so page tables are not the identity).  Returns (cache, seq ids, full tensors)."""
    torch.manual_seed(seed)
    need = sum(-(-L // ps) for L in lens)
    cache = PagedKVCache(1, pages or need + 4, num_kv_heads=g, head_dim=d, index_dim=di, page_size=ps,
                         kv_dtype=kv, index_dtype=idx, device=DEV)
    if shuffle:
        random.Random(seed).shuffle(cache._free)
    sids, full = [], []
    for L in lens:
        k, v, ki = torch.randn(L, g, d), torch.randn(L, g, d), torch.randn(L, di)
        s = cache.allocate()
        if L:
            cache.prefill(s, k.to(DEV), v.to(DEV), ki.to(DEV))
        sids.append(s)
        full.append((k, v, ki))
    return cache, sids, full


def queries(B, nq, hq=HQ, g=G, d=D, di=DI, dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, nq, hq, d, generator=gen).to(dtype).to(DEV),
            torch.randn(B, nq, g, di, generator=gen).to(dtype).to(DEV))


def as_sets(bi):
    return [[[sorted(int(x) for x in row if x >= 0) for row in grp] for grp in b] for b in bi.cpu()]


def run_both(cache, sids, q, qi, topk, **kw):
    meta = cache.decode_metadata(sids)
    tiling = DecodeTiling(**{k: kw.pop(k) for k in list(kw) if k in ("score_splits", "attn_splits", "cluster",
                                                                     "merge_budget")})
    sel = dict(topk=topk, local_blocks=kw.pop("local_blocks", 1), init_blocks=kw.pop("init_blocks", 0))
    plan = plan_decode(cache.layer(0), batch=len(sids), nq=q.shape[1], num_heads=q.shape[2], width=meta.width,
                       seq_lens=meta.seq_lens_host, page_table=meta.page_table_host, **sel, tiling=tiling)
    o, lse, bi = msa_decode(q, qi, cache.layer(0), meta.page_table, meta.seq_lens, plan=plan, return_lse=True,
                            return_block_idx=True, backend="triton", **sel, **kw)
    ro, rlse, rbi = msa_decode_reference(q, qi, cache.layer(0), meta.page_table, meta.seq_lens_host, **sel, **kw)
    return (o, lse, bi.clone()), (ro, rlse, rbi)


# ---------------------------------------------------------------- reference == prefill rows
@pytest.mark.parametrize("nq", [1, 3])
def test_reference_equals_prefill_rows(nq):
    lens = [nq, 17, 64, 131]
    cache, sids, full = build(lens, seed=nq)
    topk = 3
    for b, (L, (k, v, ki)) in enumerate(zip(lens, full)):
        qf = torch.randn(1, L, HQ, D)
        qif = torch.randn(1, L, G, DI)
        bi_full = ops.index_topk(qif, ki[None], block_size=PS, topk=topk)
        o_full = ops.sparse_attention(qf, k[None], v[None], bi_full, block_size=PS)
        meta = cache.decode_metadata([sids[b]])
        o, lse, bi = msa_decode_reference(qf[:, L - nq:].to(DEV), qif[:, L - nq:].to(DEV), cache.layer(0),
                                          meta.page_table, meta.seq_lens_host, topk=topk)
        assert torch.equal(bi.cpu(), bi_full[:, :, L - nq:])
        torch.testing.assert_close(o.cpu(), o_full[:, L - nq:], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- triton == reference
@needs_triton
@pytest.mark.parametrize(
    "lens,nq,topk,kw",
    [
        ([1, 200, 37], 1, 4, {}),
        ([5, 130, 64], 3, 3, {}),
        ([16, 199], 4, 4, dict(local_blocks=2, init_blocks=1)),
        ([150, 33, 80], 2, 5, dict(score_splits=40, cluster=4)),  # two-level selection merge
        ([97, 64], 4, 16, dict(attn_splits=3)),  # topk above the page count: -1 padding
        ([120, 45], 1, 4, dict(score_splits=1, attn_splits=1)),  # one split list, one attention split
        ([120, 45], 2, 4, dict(score_splits=2)),
    ],
)
def test_triton_matches_reference_fp32(lens, nq, topk, kw):
    cache, sids, _ = build(lens, seed=len(lens) + nq)
    q, qi = queries(len(lens), nq)
    (o, lse, bi), (ro, rlse, rbi) = run_both(cache, sids, q, qi, topk, **kw)
    assert torch.equal(bi.cpu(), rbi.cpu())  # same sets and the same order (forced first, then by score)
    torch.testing.assert_close(o, ro, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, rlse, atol=2e-5, rtol=2e-5)


@needs_triton
@pytest.mark.parametrize("kv,idx", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, FP8), (FP8, FP8)])
def test_triton_matches_reference_low_precision(kv, idx):
    """bf16 / fp8 pools: the meaning is the reference on the dequantized pools; the kernel agrees
    up to float32 summation order (selection) and bf16 rounding of P and o."""
    lens = [70, 161, 3]
    cache, sids, _ = build(lens, kv=kv, idx=idx, seed=7)
    q, qi = queries(len(lens), 3, dtype=torch.bfloat16)
    (o, lse, bi), (ro, rlse, rbi) = run_both(cache, sids, q, qi, 4)
    assert as_sets(bi) == as_sets(rbi)
    torch.testing.assert_close(o.float(), ro.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, rlse, atol=1e-3, rtol=1e-3)


@needs_triton
def test_eight_queries_four_groups_row_chunked_merge():
    """nq = 8 (the maximum) x G = 4: 32 index rows, so the selection merges run in row chunks."""
    hq, g = 8, 4
    lens = [150, 8, 190]
    cache, sids, _ = build(lens, hq=hq, g=g, seed=13)
    q, qi = queries(len(lens), 8, hq=hq, g=g)
    (o, lse, bi), (ro, rlse, rbi) = run_both(cache, sids, q, qi, 4, score_splits=12, cluster=4, attn_splits=16,
                                             merge_budget=64)  # [4, 16]-row merge tiles

    assert torch.equal(bi.cpu(), rbi.cpu())
    torch.testing.assert_close(o, ro, atol=2e-5, rtol=2e-5)


@needs_triton
def test_query_chunks_and_padding_slot():
    """128 query heads on one kv head with nq = 3: the attention rows (heads x queries) exceed
    128, so each query is its own chunk (3 chunks of 128 rows); plus a length-0 padding slot
    whose output is 0, lse -inf and selection -1."""
    hq, g, d, di = 128, 1, 16, 16
    lens = [45, 0, 20]
    cache, sids, _ = build(lens, hq=hq, g=g, d=d, di=di, seed=11)
    q, qi = queries(len(lens), 3, hq=hq, g=g, d=d, di=di)
    (o, lse, bi), (ro, rlse, rbi) = run_both(cache, sids, q, qi, 2)
    assert torch.equal(bi.cpu(), rbi.cpu())
    assert (bi[1] == -1).all() and (o[1] == 0).all() and torch.isinf(lse[1]).all()
    torch.testing.assert_close(o, ro, atol=2e-5, rtol=2e-5)


@needs_triton
def test_decode_steps_equal_prefill_rows():
    """Grow sequences step by step (nq = 1, then speculative blocks of 3 and 2), decoding after
    every append: each decoded row equals the row of the prefill path on the final sequence."""
    torch.manual_seed(3)
    T0, steps = [30, 45], [1, 3, 2, 1]
    total = [t + sum(steps) for t in T0]
    kf = [torch.randn(t, G, D) for t in total]
    vf = [torch.randn(t, G, D) for t in total]
    kif = [torch.randn(t, DI) for t in total]
    qf = [torch.randn(t, HQ, D) for t in total]
    qif = [torch.randn(t, G, DI) for t in total]
    topk = 3
    rows = []
    for b in range(2):
        bi = ops.index_topk(qif[b][None], kif[b][None], block_size=PS, topk=topk)
        o = ops.sparse_attention(qf[b][None], kf[b][None], vf[b][None], bi, block_size=PS)
        rows.append((bi[0], o[0]))
    cache = PagedKVCache(1, 32, num_kv_heads=G, head_dim=D, index_dim=DI, page_size=PS, kv_dtype=torch.float32,
                         index_dtype=torch.float32, device=DEV)
    sids = [cache.allocate() for _ in range(2)]
    for b in range(2):
        cache.prefill(sids[b], kf[b][: T0[b]].to(DEV), vf[b][: T0[b]].to(DEV), kif[b][: T0[b]].to(DEV))
    pos = list(T0)
    for n in steps:
        slots = cache.append_slots(sids, n)
        cache.write(0, slots, torch.cat([kf[b][pos[b]:pos[b] + n] for b in range(2)]).to(DEV),
                    torch.cat([vf[b][pos[b]:pos[b] + n] for b in range(2)]).to(DEV),
                    torch.cat([kif[b][pos[b]:pos[b] + n] for b in range(2)]).to(DEV))
        pos = [p + n for p in pos]
        q = torch.stack([qf[b][pos[b] - n:pos[b]] for b in range(2)]).to(DEV)
        qi = torch.stack([qif[b][pos[b] - n:pos[b]] for b in range(2)]).to(DEV)
        meta = cache.decode_metadata(sids)
        o, bi = msa_decode(q, qi, cache.layer(0), meta.page_table, meta.seq_lens, topk=topk,
                           return_block_idx=True, backend="triton")
        for b in range(2):
            assert torch.equal(bi[b].cpu(), rows[b][0][:, pos[b] - n:pos[b]])
            torch.testing.assert_close(o[b].cpu(), rows[b][1][pos[b] - n:pos[b]], atol=2e-5, rtol=2e-5)


@needs_triton
def test_forked_sequences_share_pages():
    cache, sids, full = build([40], seed=5)
    child = cache.fork(sids[0])
    k2, v2, ki2 = torch.randn(2, G, D), torch.randn(2, G, D), torch.randn(2, DI)
    cache.append(child, k2.to(DEV), v2.to(DEV), ki2.to(DEV))
    cache.append(sids[0], (k2 * 2).to(DEV), (v2 * 2).to(DEV), (ki2 * 2).to(DEV))
    q, qi = queries(2, 2)
    (o, lse, bi), (ro, rlse, rbi) = run_both(cache, [sids[0], child], q, qi, 3)
    assert torch.equal(bi.cpu(), rbi.cpu())
    torch.testing.assert_close(o, ro, atol=2e-5, rtol=2e-5)


@needs_triton
def test_fp8_against_full_precision_prefill():
    """fp8 e4m3 index keys and K/V (per-token scales) against the fp32 prefill path.  Stated
    tolerance: on random data at least 85 % of the selected blocks agree (measured 94-100 %), and where a row's
    selection agrees the output is within 8 % (relative Frobenius; measured <= 4.4 %) of full
    precision."""
    lens = [120, 200, 77]
    nq, topk = 2, 4
    c32, sids, full = build(lens, seed=21)
    c8, sids8, _ = build(lens, kv=FP8, idx=FP8, seed=21)
    q, qi = queries(len(lens), nq, seed=4)
    meta = c8.decode_metadata(sids8)
    o8, bi8 = msa_decode(q, qi, c8.layer(0), meta.page_table, meta.seq_lens, topk=topk, return_block_idx=True,
                         backend="triton")
    m32 = c32.decode_metadata(sids)
    o32, _, bi32 = msa_decode_reference(q, qi, c32.layer(0), m32.page_table, m32.seq_lens_host, topk=topk)
    s8, s32 = as_sets(bi8), as_sets(bi32)
    agree = tot = 0
    for b in range(len(lens)):
        for r in range(G):
            for i in range(nq):
                agree += len(set(s8[b][r][i]) & set(s32[b][r][i]))
                tot += len(s32[b][r][i])
                if s8[b][r][i] == s32[b][r][i]:
                    x, y = o8[b, i, r * (HQ // G):(r + 1) * (HQ // G)], o32[b, i, r * (HQ // G):(r + 1) * (HQ // G)]
                    assert float((x - y).norm() / y.norm()) < 0.08
    assert agree / tot >= 0.85


# ---------------------------------------------------------------- host-side validation
def _setup_small():
    cache, sids, _ = build([20, 40], seed=2)
    meta = cache.decode_metadata(sids)
    q, qi = queries(2, 2)
    return cache, meta, q, qi


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_bad_inputs_raise_before_any_kernel(backend):
    if backend == "triton" and not (torch.cuda.is_available() or interpret_mode()):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    cache, meta, q, qi = _setup_small()
    pools = cache.layer(0)
    call = lambda **kw: msa_decode(kw.pop("q", q), kw.pop("qi", qi), pools, kw.pop("pt", meta.page_table_host),  # noqa: E731
                                   kw.pop("sl", meta.seq_lens_host), topk=3, backend=backend, **kw)
    q9, qi9 = queries(2, 9)
    with pytest.raises(ValueError, match="nq"):
        call(q=q9, qi=qi9)
    bad = meta.page_table_host.clone()
    bad[1, 1] = cache.num_pages
    with pytest.raises(ValueError, match="page ids"):
        call(pt=bad)
    with pytest.raises(ValueError, match="longer than its pages"):
        call(sl=[20, 40 + 3 * PS])
    with pytest.raises(ValueError, match="nq"):
        call(sl=[1, 40])
    with pytest.raises(ValueError, match="q_idx"):
        call(qi=qi[:, :, :1])
    with pytest.raises(ValueError):
        call(pt=meta.page_table_host[:1])
    with pytest.raises(ValueError):
        plan_decode(pools, batch=2, nq=9, num_heads=HQ, width=4)
    with pytest.raises(ValueError, match="page ids"):
        plan_decode(pools, batch=2, nq=2, num_heads=HQ, width=meta.width, seq_lens=meta.seq_lens_host, page_table=bad)


@needs_triton
def test_plan_mismatch_raises():
    cache, meta, q, qi = _setup_small()
    plan = plan_decode(cache.layer(0), batch=2, nq=1, num_heads=HQ, width=meta.width, topk=3)
    with pytest.raises(ValueError, match="plan"):
        msa_decode(q, qi, cache.layer(0), meta.page_table, meta.seq_lens, plan=plan, backend="triton")


# ---------------------------------------------------------------- CUDA graph (GPU only)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_capture_replay():
    from tools.bench.decode import graph_check

    res = graph_check(small=True)
    assert res["ok"], res
