"""msa_decode's v2 scoring kernel (the kernel for fp8 index keys), its fused combine, and the v1
kernel of 16-bit / fp32 keys with the combine kernel: Triton (TRITON_INTERPRET=1 on CPU) against
the paged reference at small shapes, with `DecodeTiling` reaching the paths the GPU defaults take
at large shapes (two merge levels, row-chunked merges, a chunked final top-k)."""

from __future__ import annotations

import random

import pytest
import torch

from msakit.cache import PagedKVCache
from msakit.ops.dispatch import interpret_mode
from msakit.ops.decode import DecodeTiling, msa_decode, msa_decode_reference, plan_decode
from msakit.ops.decode import triton as decode_kernels
from tolerances import assert_close_sums

pytestmark = [
    pytest.mark.skipif(not (torch.cuda.is_available() or interpret_mode()), reason="needs CUDA or TRITON_INTERPRET=1"),
    pytest.mark.usefixtures("one_thread"),
]
DEV = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn
HQ, G, D, DI, PS = 4, 2, 32, 16, 16


def build(lens, *, kv=torch.float32, idx=FP8, hq=HQ, g=G, d=D, di=DI, ps=PS, seed=0):
    torch.manual_seed(seed)
    need = sum(-(-L // ps) for L in lens)
    cache = PagedKVCache(1, need + 4, num_kv_heads=g, head_dim=d, index_dim=di, page_size=ps,
                         kv_dtype=kv, index_dtype=idx, device=DEV)
    random.Random(seed).shuffle(cache._free)  # page tables are not the identity
    sids = []
    for L in lens:
        s = cache.allocate()
        if L:
            cache.prefill(s, torch.randn(L, g, d).to(DEV), torch.randn(L, g, d).to(DEV), torch.randn(L, di).to(DEV))
        sids.append(s)
    return cache, sids


def queries(B, nq, hq=HQ, g=G, d=D, di=DI, dtype=torch.float32, seed=1, qscale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, nq, hq, d, generator=gen).to(dtype).to(DEV),
            (torch.randn(B, nq, g, di, generator=gen) * qscale).to(dtype).to(DEV))


def run(cache, sids, q, qi, topk, *, local_blocks=1, init_blocks=0, **tiling):
    meta = cache.decode_metadata(sids)
    sel = dict(topk=topk, local_blocks=local_blocks, init_blocks=init_blocks)
    plan = plan_decode(cache.layer(0), batch=len(sids), nq=q.shape[1], num_heads=q.shape[2], width=meta.width,
                       seq_lens=meta.seq_lens_host, page_table=meta.page_table_host, **sel,
                       tiling=DecodeTiling(**tiling))
    o, lse, bi = msa_decode(q, qi, cache.layer(0), meta.page_table, meta.seq_lens, plan=plan, return_lse=True,
                            return_block_idx=True, backend="triton")
    return (o, lse, bi.clone()), plan


def reference(cache, sids, q, qi, topk, **sel):
    meta = cache.decode_metadata(sids)
    return msa_decode_reference(q, qi, cache.layer(0), meta.page_table, meta.seq_lens_host, topk=topk, **sel)


def as_sets(bi):
    return [[[sorted(int(x) for x in row if x >= 0) for row in grp] for grp in b] for b in bi.cpu()]


@pytest.fixture(params=["tma", "ptr"])
def key_loads(request, monkeypatch):
    """v2 reads the key pages through a tensor map, or by pointer loads where the pool allows none."""
    if request.param == "ptr":
        monkeypatch.setattr(decode_kernels, "_tma_ok", lambda k_idx: False)
    return request.param


@pytest.mark.parametrize(
    "lens,nq,topk,kw",
    [
        ([1, 200, 37], 1, 4, {}),
        ([5, 130, 64], 3, 3, {}),
        ([16, 199], 4, 4, dict(local_blocks=2, init_blocks=1)),
        ([150, 33, 80], 2, 5, dict(score_splits=40, cluster=4)),  # two-level selection merge
        # the split's final top-k in several chunks (PCH = 8 < 19 pages per split)
        ([600, 310], 2, 4, dict(score_splits=2, end_chunk=8)),
        ([600, 310], 2, 8, dict(score_splits=2, end_chunk=8)),  # PCH == KP: the sort path
        ([97, 64], 4, 16, dict(attn_splits=3)),  # topk above the page count: -1 padding
        ([120, 45], 1, 4, dict(score_splits=1, attn_splits=1)),
        ([40, 0, 20], 2, 3, dict(score_splits=6)),  # splits without pages, a padding slot
    ],
)
def test_v2_matches_reference_fp32_query(lens, nq, topk, kw, key_loads):
    """fp8 index keys, fp32 queries and K / V: the selection is the reference's on the
    dequantized keys, in the same order; o and lse within float32 summation order."""
    sel = {k: kw.pop(k) for k in ("local_blocks", "init_blocks") if k in kw}
    cache, sids = build(lens, seed=len(lens) + nq)
    q, qi = queries(len(lens), nq)
    (o, lse, bi), plan = run(cache, sids, q, qi, topk, **sel, **kw)
    assert plan.score_impl == "v2" and plan.fuse_combine
    ro, rlse, rbi = reference(cache, sids, q, qi, topk, **sel)
    assert torch.equal(bi.cpu(), rbi.cpu())  # same sets and order (forced first, then by score)
    torch.testing.assert_close(o, ro, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, rlse, atol=2e-5, rtol=2e-5)
    assert (plan.cnt1 == 0).all() and (plan.cnt2 == 0).all() and (plan.cnt3 == 0).all()  # counters back to 0


def test_v2_chunked_final_topk_is_exercised():
    cache, sids = build([600, 310], seed=4)
    meta = cache.decode_metadata(sids)
    plan = plan_decode(cache.layer(0), batch=2, nq=2, num_heads=HQ, width=meta.width, topk=4,
                       tiling=DecodeTiling(score_splits=2, end_chunk=8))
    assert plan.pch == 8 and -(-meta.width // plan.score_splits) > 2 * plan.pch


def test_v1_with_the_combine_kernel():
    """16-bit / fp32 index keys: v1 scoring and the combine kernel, one and two merge levels."""
    lens, nq, topk = [150, 33, 80], 2, 5
    cache, sids = build(lens, idx=torch.float32, seed=9)
    q, qi = queries(len(lens), nq)
    ro, rlse, rbi = reference(cache, sids, q, qi, topk)
    for kw in (dict(), dict(score_splits=40, cluster=4), dict(attn_splits=5)):
        (o, lse, bi), plan = run(cache, sids, q, qi, topk, **kw)
        assert plan.score_impl == "v1" and plan.bmax is None and not plan.fuse_combine
        assert torch.equal(bi.cpu(), rbi.cpu())
        torch.testing.assert_close(o, ro, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(lse, rlse, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("nq,attn_splits", [(1, 7), (3, 2), (3, 1)])
def test_fused_combine(nq, attn_splits):
    """The last attention split merges the partials (v2): equal to the reference, with and
    without lse, counters back to 0, a padding slot's output 0 and lse -inf."""
    lens = [130, 0, 77]
    cache, sids = build(lens, seed=nq)
    q, qi = queries(len(lens), nq)
    (o, lse, bi), plan = run(cache, sids, q, qi, 4, attn_splits=attn_splits)
    ro, rlse, rbi = reference(cache, sids, q, qi, 4)
    assert plan.fuse_combine and (plan.cnt3 == 0).all()
    assert torch.equal(bi.cpu(), rbi.cpu())
    torch.testing.assert_close(o, ro, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, rlse, atol=2e-5, rtol=2e-5)
    assert (o[1] == 0).all() and torch.isinf(lse[1]).all()
    meta = cache.decode_metadata(sids)
    o3 = msa_decode(q, qi, cache.layer(0), meta.page_table, meta.seq_lens, plan=plan, backend="triton")
    assert torch.equal(o3, o)


def test_v2_eight_queries_four_groups():
    """nq = 8 x G = 4: 32 index rows (the end pass and the merges in row chunks)."""
    hq, g = 8, 4
    lens = [150, 8, 190]
    cache, sids = build(lens, hq=hq, g=g, seed=13)
    q, qi = queries(len(lens), 8, hq=hq, g=g)
    (o, lse, bi), _ = run(cache, sids, q, qi, 4, score_splits=12, cluster=4, attn_splits=16, merge_budget=64,
                          end_chunk=16)
    ro, rlse, rbi = reference(cache, sids, q, qi, 4)
    assert torch.equal(bi.cpu(), rbi.cpu())
    torch.testing.assert_close(o, ro, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("qscale", [1.0, 1e-30, 1e30])
def test_v2_fp8_keys_bf16_query(qscale, key_loads):
    """fp8 index keys with a bf16 query: the v2 kernel scores with fp16 tensor-core dots of the
    power-of-2 pre-scaled query (exact products), so the selection equals the reference's on the
    dequantized keys, for any query magnitude."""
    lens = [70, 161, 3, 260]
    cache, sids = build(lens, kv=torch.bfloat16, idx=FP8, seed=7)
    q, qi = queries(len(lens), 3, dtype=torch.bfloat16, qscale=qscale)
    (o, lse, bi), plan = run(cache, sids, q, qi, 4, score_splits=3)
    ro, rlse, rbi = reference(cache, sids, q, qi, 4)
    assert as_sets(bi) == as_sets(rbi)
    torch.testing.assert_close(o.float(), ro.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, rlse, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("kv,idx", [(torch.bfloat16, torch.bfloat16), (FP8, FP8)])
def test_v2_low_precision(kv, idx):
    lens = [70, 161, 3]
    cache, sids = build(lens, kv=kv, idx=idx, seed=8)
    q, qi = queries(len(lens), 2, dtype=torch.bfloat16)
    (o, lse, bi), _ = run(cache, sids, q, qi, 4)
    ro, rlse, rbi = reference(cache, sids, q, qi, 4)
    assert as_sets(bi) == as_sets(rbi)
    torch.testing.assert_close(o.float(), ro.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, rlse, atol=1e-3, rtol=1e-3)


def test_tiling_checks_and_plan_dtype():
    cache, sids = build([40], seed=2)
    pools = cache.layer(0)
    for bad in (dict(cluster=3), dict(score_splits=0), dict(end_chunk=True), dict(merge_budget=1.5)):
        with pytest.raises(ValueError, match="DecodeTiling"):
            DecodeTiling(**bad)
    with pytest.raises(ValueError, match="tiling"):
        plan_decode(pools, batch=1, nq=1, num_heads=HQ, width=4, tiling=dict(score_splits=2))
    # a plan of fp8 index keys (v2) does not serve 16-bit / fp32 keys (v1), and vice versa
    c32, s32 = build([40], idx=torch.float32, seed=2)
    meta = c32.decode_metadata(s32)
    plan = plan_decode(pools, batch=1, nq=1, num_heads=HQ, width=meta.width)
    q, qi = queries(1, 1)
    with pytest.raises(ValueError, match="index keys"):
        msa_decode(q, qi, c32.layer(0), meta.page_table, meta.seq_lens, plan=plan, backend="triton")


def test_score_kernel_follows_the_index_key_dtype():
    """v1 (8 warps, combine kernel) for bf16 / fp32 index keys, v2 (4 warps, fused combine) for
    fp8 ones."""
    for idx, want in ((torch.float32, "v1"), (torch.bfloat16, "v1"), (torch.float8_e4m3fn, "v2")):
        cache, sids = build([300, 40], kv=torch.bfloat16 if idx != torch.float32 else torch.float32, idx=idx)
        meta = cache.decode_metadata(sids)
        plan = plan_decode(cache.layer(0), batch=2, nq=1, num_heads=HQ, width=meta.width)
        assert plan.score_impl == want
        assert plan.fuse_combine == (want == "v2")
        assert plan.score_warps == (8 if want == "v1" else 4)
