"""Data parallelism and FSDP2 on 2 and 4 gloo ranks equal one process on the same global batch:
the loss, the KL, every gradient, and the loss after one AdamW step (float32 tolerance); also with
QAT (`prepare_qat`) under FSDP2, and a world size that does not fit fails with a clear error."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from spawn_ranks import assert_grads_close, check_result, close_scalar, rank_check
from toy_model import make_model

from msakit.distributed.fsdp import allreduce_gradients, shard_model
from msakit.distributed.launch import check_fit, init_distributed, make_parallel
from msakit.distributed.step import loss_shares, reduce_sum
from msakit.train.data import Batch

B, T, V = 4, 32, 300


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    labels = ids.clone()
    labels[1, :5] = -100  # rows with different target counts: a mean of per-rank means would differ
    cu = [torch.tensor([0, T], dtype=torch.int32) for _ in range(B)]
    cu[2] = torch.tensor([0, 11, T], dtype=torch.int32)
    return ids, labels, cu


def _model(qat: bool):
    m = make_model(V)
    if qat:
        from msakit.quant import prepare_qat

        prepare_qat(m, quantize_activations=False)
    return m


def _opt(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.0, foreach=False)


def _reference(qat: bool, packed: bool):
    """Loss, KL, gradients and the loss after one step on one process."""
    model = _model(qat)
    ids, labels, cu = _batch()
    if packed:
        ids, labels, cu = Batch(ids, labels, cu).flat()
    fwd = lambda: model(ids, labels=labels, cu_seqlens=cu if packed else None)  # noqa: E731
    out = fwd()
    (out.loss + out.kl).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    opt = _opt(model)
    opt.step()
    with torch.no_grad():
        out2 = fwd()
    return float(out.loss), float(out.kl), grads, float(out2.loss + out2.kl)



def _case(world: int, fsdp: bool, qat: bool, packed: bool, ac: bool = False) -> None:
    loss_ref, kl_ref, g_ref, loss2_ref = _reference(qat, packed)
    env = init_distributed("cpu")
    par = make_parallel(env, cp=1, batch_size=B)
    model = _model(qat)
    if fsdp:
        shard_model(model, par.fsdp_mesh, activation_checkpointing=ac)
        moe = model.moe_layers()[0]
        assert isinstance(moe.experts.w1, DTensor)  # the stacked experts are sharded like any weight
        assert not isinstance(moe.e_score_correction_bias, DTensor)  # the routing bias stays replicated
    opt = _opt(model)
    ids, labels, cu = _batch()
    sh = loss_shares(model, ids, labels, par, cu_seqlens=cu if packed else None)
    ((sh.lm + sh.kl) * world).backward()
    if not fsdp:
        allreduce_gradients([p for p in model.parameters() if p.requires_grad])
    tag = f"world {world} fsdp={fsdp} qat={qat} packed={packed} activation checkpointing={ac}"
    close_scalar(float(reduce_sum(sh.lm, par)), loss_ref, f"loss ({tag})")
    close_scalar(float(reduce_sum(sh.kl, par)), kl_ref, f"kl ({tag})")
    assert_grads_close(model, g_ref, B * T, tag)
    opt.step()
    opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        sh2 = loss_shares(model, ids, labels, par, cu_seqlens=cu if packed else None)
    close_scalar(float(reduce_sum(sh2.lm, par) + reduce_sum(sh2.kl, par)), loss2_ref, f"loss after a step ({tag})")


@rank_check(worlds=(2,))
def fsdp_and_dp_two_ranks(rank: int, world: int, shared) -> None:
    for fsdp, qat, packed, ac in [(True, False, False, False), (False, False, True, False), (True, False, False, True)]:
        _case(world, fsdp, qat, packed, ac)


@rank_check(worlds=(2,))
def fsdp_qat_two_ranks(rank: int, world: int, shared) -> None:
    _case(world, True, True, False)


@rank_check(worlds=(4,))
def fsdp_four_ranks(rank: int, world: int, shared) -> None:
    _case(world, True, False, True)


def test_fsdp_two_ranks():
    check_result("fsdp_and_dp_two_ranks", 2)


def test_fsdp_qat_two_ranks():
    """prepare_qat + fully_shard: sharded master weights, fake-quantised weights from the gathered ones."""
    check_result("fsdp_qat_two_ranks", 2)


def test_fsdp_four_ranks():
    check_result("fsdp_four_ranks", 4)


def test_world_size_that_does_not_fit():
    with pytest.raises(ValueError, match="not a multiple of --cp"):
        check_fit(6, 4)
    with pytest.raises(ValueError, match="batch-size 6 is not a multiple of the data-parallel size 4"):
        check_fit(8, 2, batch_size=6)
    assert check_fit(8, 2, batch_size=8) == 4


@rank_check(worlds=(2,))
def bad_batch_raises(rank: int, world: int, shared) -> None:
    env = init_distributed("cpu")
    with pytest.raises(ValueError, match="not a multiple of the data-parallel size"):
        make_parallel(env, cp=1, batch_size=3)
    with pytest.raises(ValueError, match="not a multiple of --cp"):
        make_parallel(env, cp=4, batch_size=4)


def test_bad_batch_raises_on_every_rank_without_hanging():
    check_result("bad_batch_raises", 2)
