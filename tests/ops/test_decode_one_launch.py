"""msa_decode's one-launch kernel (`DecodeTiling(launch="ticket")`): scoring, selection merges,
attention and the fused combine in one `_ticket_kernel` launch whose
programs take work items from a ticket counter.  Triton under TRITON_INTERPRET=1 (programs run one
after another: program 0 takes every item) against the paged reference at small shapes, with
unused pool pages and the slots past each sequence's end poisoned with NaN.  On a GPU the same
tests run the real kernel; CUDA-graph capture / replay of it is `tools.bench.decode.graph_check`
(tests/ops/test_kernel_decode.py::test_cuda_graph_capture_replay)."""

from __future__ import annotations

import pytest
import torch
from test_decode_v2 import DEV, FP8, G, HQ, PS, as_sets, pytestmark, queries  # noqa: F401 (pytestmark: the same marks)
from test_decode_v2 import build as build_cache

from msakit.ops.decode import DecodeTiling, msa_decode, msa_decode_reference, plan_decode

ONE_LAUNCH = ("ticket",)


def _poison(x: torch.Tensor, sel) -> None:
    """NaN into x[sel] (fp8 e4m3fn: its NaN code 0x7f)."""
    if x.dtype == FP8:
        x.view(torch.uint8)[sel] = 0x7F
    else:
        x[sel] = float("nan")


def build(lens, *, kv=torch.float32, idx=torch.float32, seed=0):
    """test_decode_v2's one-layer cache (shuffled physical pages); then every pool page no
    sequence holds, and every slot past a sequence's end in its last page, is NaN (keys, values,
    index keys and their fp8 scales): none of it may reach an output."""
    cache, sids = build_cache(lens, kv=kv, idx=idx, seed=seed)
    pools = cache.layer(0)
    used = {p for s in sids for p in cache.pages(s)}
    free = torch.tensor(sorted(set(range(pools.num_pages)) - used), dtype=torch.long, device=DEV)
    tensors = [t for t in (pools.k, pools.v, pools.k_idx, pools.k_scale, pools.v_scale, pools.k_idx_scale)
               if t is not None]
    for t in tensors:
        _poison(t, free)
    for s, L in zip(sids, lens):
        if L % PS:
            last, tail = cache.pages(s)[-1], slice(L % PS, None)
            for t in (pools.k, pools.v, pools.k_scale, pools.v_scale):
                if t is not None:
                    _poison(t, (last, slice(None), tail))
            for t in (pools.k_idx, pools.k_idx_scale):
                if t is not None:
                    _poison(t, (last, tail))
    return cache, sids


def run(cache, sids, q, qi, topk, *, launch, local_blocks=1, init_blocks=0, **tiling):
    meta = cache.decode_metadata(sids)
    sel = dict(topk=topk, local_blocks=local_blocks, init_blocks=init_blocks)
    plan = plan_decode(cache.layer(0), batch=len(sids), nq=q.shape[1], num_heads=q.shape[2], width=meta.width,
                       seq_lens=meta.seq_lens_host, page_table=meta.page_table_host, **sel,
                       tiling=DecodeTiling(launch=launch, **tiling))
    o, lse, bi = msa_decode(q, qi, cache.layer(0), meta.page_table, meta.seq_lens, plan=plan, return_lse=True,
                            return_block_idx=True, backend="triton")
    ro, rlse, rbi = msa_decode_reference(q, qi, cache.layer(0), meta.page_table, meta.seq_lens_host, **sel)
    return (o, lse, bi.clone()), (ro, rlse, rbi), plan


def queue_reset(plan) -> bool:
    """The ticket / exit counters, ready flags and merge counters are back to 0 for the next call."""
    return bool((plan.work == 0).all() and (plan.cnt1 == 0).all() and (plan.cnt2 == 0).all()
                and (plan.cnt3 == 0).all())


@pytest.mark.parametrize("launch", ONE_LAUNCH)
@pytest.mark.parametrize(
    "lens,nq,topk,kw",
    [
        ([1, 200, 37, 0], 1, 4, {}),  # ragged lengths, a padding slot
        ([16, 199, 64], 4, 4, dict(local_blocks=2, init_blocks=1)),  # forced init / local blocks
        ([97, 20], 4, 16, dict(attn_splits=3)),  # a budget above the page count: -1 padded selections
        ([150, 33, 80], 1, 5, dict(score_splits=40, cluster=4)),  # two-level selection merge
    ],
)
@pytest.mark.parametrize("idx", [torch.float32, FP8])  # v1 scoring, v2 scoring
def test_one_launch_matches_reference(launch, lens, nq, topk, kw, idx):
    """fp32 queries and K / V with fp32 (v1) or fp8 (v2) index keys: the selection equals the
    reference's on the (dequantized) keys in the same order; o and lse within float32 summation
    order; padding slots give 0 / -inf; the queue is reset for the next call."""
    sel = {k: kw.pop(k) for k in ("local_blocks", "init_blocks") if k in kw}
    cache, sids = build(lens, idx=idx, seed=len(lens) + nq)
    assert torch.isnan(cache.layer(0).k.float()).any() and torch.isnan(cache.layer(0).k_idx.float()).any()
    q, qi = queries(len(lens), nq)
    (o, lse, bi), (ro, rlse, rbi), plan = run(cache, sids, q, qi, topk, launch=launch, **sel, **kw)
    assert plan.launch == launch and plan.fuse_combine and plan.score_impl == ("v2" if idx == FP8 else "v1")
    assert torch.equal(bi.cpu(), rbi.cpu())
    assert torch.isfinite(o).all()
    torch.testing.assert_close(o, ro, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, rlse, atol=2e-5, rtol=2e-5)
    for b, L in enumerate(lens):
        if L == 0:
            assert (o[b] == 0).all() and torch.isinf(lse[b]).all() and (bi[b] == -1).all()
    if topk * PS > max(lens):
        assert (bi == -1).any()
    assert queue_reset(plan)


@pytest.mark.parametrize("launch", ONE_LAUNCH)
@pytest.mark.parametrize("idx", [torch.bfloat16, FP8])
@pytest.mark.parametrize("nq", [1, 4])
def test_one_launch_bf16(launch, idx, nq):
    """bf16 queries and K / V, bf16 (v1) or fp8 (v2) index keys: the reference on the
    dequantized pools up to float32 summation order (the selected sets) and bf16 rounding of P
    and o."""
    lens = [70, 161, 5, 260]
    cache, sids = build(lens, kv=torch.bfloat16, idx=idx, seed=7)
    q, qi = queries(len(lens), nq, dtype=torch.bfloat16)
    (o, lse, bi), (ro, rlse, rbi), plan = run(cache, sids, q, qi, 4, launch=launch, score_splits=3)
    assert as_sets(bi) == as_sets(rbi)
    torch.testing.assert_close(o.float(), ro.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, rlse, atol=1e-3, rtol=1e-3)
    assert queue_reset(plan)


@pytest.mark.parametrize("launch", ONE_LAUNCH)
def test_one_launch_repeats_and_equals_split(launch):
    """A second call with the same plan (the reset queue) gives the same result, equal to the
    multi-launch path's up to float32 summation order (v1: the combine kernel there, the fused
    combine here)."""
    lens = [150, 8, 190]
    cache, sids = build(lens, seed=13)
    q, qi = queries(len(lens), 2)
    meta = cache.decode_metadata(sids)
    outs = {}
    for name, tiling in (("split", DecodeTiling(launch="split")), (launch, DecodeTiling(launch=launch))):
        plan = plan_decode(cache.layer(0), batch=len(lens), nq=2, num_heads=HQ, width=meta.width, topk=4,
                           tiling=tiling)
        outs[name] = [msa_decode(q, qi, cache.layer(0), meta.page_table, meta.seq_lens, plan=plan, topk=4,
                                 return_lse=True, return_block_idx=True, backend="triton") for _ in range(2)]
        outs[name] = [tuple(t.clone() for t in r) for r in outs[name]]
        if name != "split":
            items = len(lens) * plan.score_splits + len(lens) * G * plan.nqc * plan.attn_splits
            assert plan.programs == items
            assert queue_reset(plan)
    (o1, l1, b1), (o2, l2, b2) = outs[launch]
    assert torch.equal(o1, o2) and torch.equal(l1, l2) and torch.equal(b1, b2)
    so, sl, sb = outs["split"][0]
    assert torch.equal(b1, sb)
    torch.testing.assert_close(o1, so, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(l1, sl, atol=2e-5, rtol=2e-5)


def test_one_launch_plan_fields():
    """Warps and grid of the one-launch plan (the split path's shapes unchanged); "auto" picks
    "ticket" for fp8 index keys with nq >= 2 only."""
    cache, sids = build([300, 40], kv=torch.bfloat16, idx=torch.bfloat16)
    meta = cache.decode_metadata(sids)
    mk = lambda **kw: plan_decode(cache.layer(0), batch=2, nq=kw.pop("nq", 1), num_heads=HQ,  # noqa: E731
                                  width=meta.width, tiling=DecodeTiling(**kw))
    split, tick = mk(launch="split"), mk(launch="ticket")
    assert split.launch == "split" and not split.fuse_combine  # v1 keeps its combine kernel
    assert (tick.score_splits, tick.attn_splits) == (split.score_splits, split.attn_splits)
    assert tick.one_warps == 8 and tick.fuse_combine
    assert mk().launch == mk(nq=4).launch == "split"  # bf16 index keys: "auto" is the split path
    c8, s8 = build([300, 40], kv=torch.bfloat16, idx=FP8)
    m8 = c8.decode_metadata(s8)
    for nq, warps in ((1, 4), (2, 4), (4, 8), (8, 8)):  # 16 heads per group: 16 * nq attention rows
        p = plan_decode(c8.layer(0), batch=2, nq=nq, num_heads=16 * G, width=m8.width,
                        tiling=DecodeTiling(launch="ticket"))
        assert p.one_warps == warps
        auto = plan_decode(c8.layer(0), batch=2, nq=nq, num_heads=16 * G, width=m8.width)
        assert auto.launch == ("ticket" if nq >= 2 else "split")
    for bad in ("fused", "", None):
        with pytest.raises(ValueError, match="DecodeTiling.launch"):
            DecodeTiling(launch=bad)
    with pytest.raises(ValueError, match="DecodeTiling.launch"):
        DecodeTiling(launch="persistent")  # measured and removed (run 28)
    from msakit.ops.decode.triton import launch

    q, qi = queries(2, 1, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one launch"):
        launch(tick, q, qi, cache.layer(0), meta.page_table, meta.seq_lens, 0.1, False, phases="select")
