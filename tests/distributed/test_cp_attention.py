"""Context-parallel MSA on 2 and 4 gloo ranks equals one process: the same selections, and outputs,
KL and the gradients of q, k, v, q_idx, k_idx within float32 tolerance; also for a packed batch
whose documents cross chunk boundaries, a T that is not a multiple of the chunk, dense mode and a
layer without an index branch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from spawn_ranks import check_result, rank_check

from msakit.distributed import ContextParallel, GatherSequence, chunk_layout, comm_bytes_per_layer
from msakit.cache import HeldKeys
from msakit.models.interface import document_segments
from msakit.nn.core import attend
from msakit.ops.index_topk import Selection

SEL = Selection(block_size=8, topk=3, local_blocks=1, init_blocks=1)
# (batch, T, cu_seqlens, mode, index branch)
CASES = [
    (2, 64, None, "sparse", True),  # T a multiple of block * 2 * cp
    (2, 53, None, "sparse", True),  # padded
    (1, 61, [0, 13, 37, 61], "sparse", True),  # documents across chunk boundaries, padded
    (1, 64, [0, 20, 21, 64], "dense", True),  # dense mode (KL over the indexer's selection), a 1-token document
    (2, 40, None, "dense", False),  # a dense GQA layer (no index branch)
]


def _tensors(B: int, T: int, seed: int, index: bool):
    g = torch.Generator().manual_seed(seed)
    Hq, G, D, Di = 4, 2, 8, 8
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q, k, v = r(B, T, Hq, D), r(B, T, G, D), r(B, T, G, D)
    qi, ki = (r(B, T, G, Di), r(B, T, Di)) if index else (None, None)
    w, c = r(B, T, Hq, D), 0.7  # loss = sum(o * w) + c * kl
    return q, k, v, qi, ki, w, c


def _reference(B, T, cu, mode, index, seed):
    q, k, v, qi, ki, w, c = _tensors(B, T, seed, index)
    leaves = [t.requires_grad_() for t in (q, k, v, qi, ki) if t is not None]
    segs = document_segments(None if cu is None else torch.tensor(cu, dtype=torch.int32), B, T)
    o, kl, bi = attend(q, qi, HeldKeys(k, v, ki), SEL, mode=mode, compute_kl=index, need_block_idx=index,
                       segments=segs)
    loss = (o * w).sum() + (c * kl if kl is not None else 0)
    grads = torch.autograd.grad(loss, leaves)
    return o.detach(), kl, bi, grads


def _check_case(rank: int, world: int, case, seed: int) -> None:
    B, T, cu, mode, index = case
    o_ref, kl_ref, bi_ref, g_ref = _reference(B, T, cu, mode, index, seed)
    cp = ContextParallel(dist.group.WORLD, T, SEL.block_size, cu_seqlens=cu, batch_size=B)
    full = _tensors(B, T, seed, index)
    loc = [None if t is None else cp.shard(t).detach().requires_grad_() for t in full[:5]]
    w_loc = cp.shard(full[5])
    q_, k_, v_, qi_, ki_ = loc
    o, kl, bi = cp.attend(q_, qi_, HeldKeys(k_, v_, ki_), SEL, mode=mode, compute_kl=index, need_block_idx=index)
    loss = (o * w_loc).sum() + (full[6] * kl if kl is not None else 0)
    loss.backward()
    moved = (cp.stats.all_gather, cp.stats.reduce_scatter)  # before the checks' own gathers
    Hq = o.shape[2]
    if index:
        sel = cp.unshard(bi, dim=2)
        assert torch.equal(sel.sort(dim=-1).values, bi_ref.sort(dim=-1).values), f"selection differs in {case}"
        kl_all = kl.detach().clone()
        dist.all_reduce(kl_all)
        tol = 1e-6 * max(1.0, float(kl_ref))
        assert abs(float(kl_all) - float(kl_ref)) <= tol + 1e-6, (case, float(kl_all), float(kl_ref))
    # attention rows are sums over <= T keys of float32 products: tolerance from eps and length
    atol = 50 * torch.finfo(torch.float32).eps * T ** 0.5
    torch.testing.assert_close(cp.unshard(o), o_ref, atol=atol, rtol=1e-4)
    names = [n for n, t in zip(("q", "k", "v", "q_idx", "k_idx"), loc) if t is not None]
    for name, t, g in zip(names, [t for t in loc if t is not None], g_ref):
        scale = max(1.0, float(g.abs().max()))
        torch.testing.assert_close(cp.unshard(t.grad), g, atol=atol * scale * Hq, rtol=1e-4,
                                   msg=lambda m: f"grad {name} in {case}: {m}")
    # the bytes moved are those of the volume formula (float32 here): gather, re-gather, reduce-scatter
    G, D = full[1].shape[2], full[1].shape[3]
    vol = comm_bytes_per_layer(B * cp.layout.padded_len, world, groups=G, head_dim=D,
                               index_dim=full[3].shape[-1] if index else None, kv_bytes=4, index_bytes=4)
    assert moved == (vol["forward_all_gather"] + vol["backward_all_gather"], vol["backward_reduce_scatter"]), \
        (moved, vol)
    # padding rows: zero output, -1 selections, zero gradients
    pad = cp.layout.positions() >= T
    if pad.any():
        assert not o[:, pad].any() and (bi is None or (bi[:, :, pad] == -1).all())


@rank_check(worlds=(2, 4))
def cp_equals_one_process(rank: int, world: int, shared) -> None:
    for i, case in enumerate(CASES):
        _check_case(rank, world, case, seed=10 + i)
    # GatherSequence: all-gather forward, reduce-scatter backward
    cp = ContextParallel(dist.group.WORLD, 45, SEL.block_size)
    full = torch.randn(2, 45, 3, generator=torch.Generator().manual_seed(3))
    x = cp.shard(full).requires_grad_()
    y = GatherSequence.apply(x, cp)
    assert torch.equal(y[:, :45], full) and not y[:, 45:].any()
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(4))
    (y * w).sum().backward()
    # every rank's gradient for every token is w: the reduce-scatter sums world copies of the rank's part
    assert torch.allclose(x.grad, world * w.index_select(1, cp.layout.positions()))


@pytest.mark.parametrize("world", [2, 4])
def test_cp_equals_one_process(world):
    check_result("cp_equals_one_process", world)


def test_cp_world_one_without_collectives():
    """Without a process group the context runs at world size 1 through the plain ops."""
    B, T, cu, mode, index = CASES[2]
    o_ref, kl_ref, bi_ref, _ = _reference(B, T, cu, mode, index, 12)
    cp = ContextParallel(None, T, SEL.block_size, cu_seqlens=cu, batch_size=B)
    q, k, v, qi, ki, _, _ = _tensors(B, T, 12, index)
    q, k, v, qi, ki = (cp.shard(t) for t in (q, k, v, qi, ki))
    o, kl, bi = cp.attend(q, qi, HeldKeys(k, v, ki), SEL, mode=mode, compute_kl=True, need_block_idx=True)
    assert torch.equal(bi[:, :, :T], bi_ref)
    torch.testing.assert_close(o[:, :T], o_ref)
    torch.testing.assert_close(kl, kl_ref)
    assert cp.stats.all_gather == 0


def test_layout_balances_chunks():
    lay = chunk_layout(100, 4, 1, 8)
    assert lay.padded_len == 128 and lay.chunk == 16  # padded to a multiple of 8 * 2 * 4
    assert lay.chunk_ids() == (1, 6)
    assert lay.spans() == [(0, 16, 32), (16, 96, 112)]
    order = torch.cat([chunk_layout(100, 4, r, 8).positions() for r in range(4)])
    assert torch.equal(order.sort().values, torch.arange(128))
    one = chunk_layout(100, 1, 0, 8)
    assert one.spans() == [(0, 0, 112)]  # both chunks of one rank merge into the whole sequence
    with pytest.raises(ValueError, match="rank"):
        chunk_layout(100, 4, 4, 8)


def test_comm_volume_m3():
    v = comm_bytes_per_layer(1 << 20, 8, groups=4, head_dim=128, index_dim=128)
    assert v["bytes_per_token"] == 2304  # 2.25 KiB per token of the key side in bf16
    assert v["forward_all_gather"] == pytest.approx((1 << 20) * 7 / 8 * 2304)


def test_core_queries_at_the_end_of_held_keys_in_row_chunks(monkeypatch):
    """Queries that are the last rows of the keys' sequence equal those rows of full causal attention
    (dense) and of the whole-sequence MSA (sparse, KL), however the rows are chunked."""
    from msakit.nn import core

    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 40, 4, 8, generator=g)
    k, v = torch.randn(2, 40, 2, 8, generator=g), torch.randn(2, 40, 2, 8, generator=g)
    qi, ki = torch.randn(2, 40, 2, 8, generator=g), torch.randn(2, 40, 8, generator=g)
    keys = HeldKeys(k, v, ki)
    full_dense = attend(q, None, keys, SEL, mode="dense")[0]
    full_sparse, _, bi = attend(q, qi, keys, SEL, mode="sparse", need_block_idx=True)
    for limit in (1 << 20, 40 * 2 * 3):  # one chunk; chunks of 3 rows
        monkeypatch.setattr(core, "MASK_ELEMENTS", limit)
        torch.testing.assert_close(attend(q[:, 27:], None, keys, SEL, mode="dense")[0], full_dense[:, 27:])
        o, kl, b = attend(q[:, 27:], qi[:, 27:], keys, SEL, mode="sparse", compute_kl=True, need_block_idx=True)
        torch.testing.assert_close(o, full_sparse[:, 27:])
        assert torch.equal(b, bi[:, :, 27:]) and kl is not None and torch.isfinite(kl)
    with pytest.raises(ValueError, match="last positions"):
        attend(q, None, HeldKeys(k[:, :10], v[:, :10]), SEL, mode="dense")
