"""Sharded checkpoints (DCP): saved on 4 FSDP2 ranks, resumed on 2 ranks and on 1 process, the
next step's loss (and the loss after its update, which reads the optimizer moments) equals the
uninterrupted run's; conversion to and from the single-file safetensors layout."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from spawn_ranks import SHARED, check_result, close_scalar, rank_check
from toy_model import make_model

from msakit.distributed.checkpoint import (dcp_to_pretrained, has_optimizer_state, load_sharded, pretrained_to_dcp,
                                           read_state, save_sharded)
from msakit.distributed.fsdp import shard_model
from msakit.distributed.launch import DistEnv, Parallel, init_distributed, make_parallel
from msakit.distributed.step import loss_shares, reduce_sum
from msakit.models import M3ForCausalLM

B, T, V, STEPS = 4, 24, 300, 3
CKPT = "dcp-step2"


def _batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, V, (B, T), generator=g)
    return ids, ids.clone()


def _opt(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6, weight_decay=0.1, foreach=False)


def _step(model, opt, par: Parallel, step: int) -> float:
    ids, labels = _batch(step)
    sh = loss_shares(model, ids, labels, par)
    ((sh.lm + sh.kl) * par.world_size).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(reduce_sum(sh.lm, par) + reduce_sum(sh.kl, par))


def _uninterrupted() -> list[float]:
    model = make_model(V)
    opt = _opt(model)
    par = _single()
    return [_step(model, opt, par, s) for s in range(STEPS + 1)]


def _single() -> Parallel:
    """One process without a process group."""
    return Parallel(DistEnv(0, 1, 0, torch.device("cpu"), None), dp=1, cp=1, dp_rank=0, cp_rank=0)



@rank_check(worlds=(4,))
def dcp_save_four(rank: int, world: int, shared) -> None:
    par = make_parallel(init_distributed("cpu"), cp=1, batch_size=B)
    model = shard_model(make_model(V), par.fsdp_mesh)
    opt = _opt(model)
    for s in range(2):
        _step(model, opt, par, s)
    save_sharded(shared / CKPT, model, opt, state={"step": 2})


@rank_check(worlds=(2,))
def dcp_resume_two(rank: int, world: int, shared) -> None:
    ref = _uninterrupted()
    par = make_parallel(init_distributed("cpu"), cp=1, batch_size=B)
    torch.manual_seed(123)
    model = M3ForCausalLM(make_model(V).config)  # other weights: the load must replace them
    shard_model(model, par.fsdp_mesh)
    opt = _opt(model)
    assert load_sharded(shared / CKPT, model, opt) == {"step": 2}
    assert isinstance(model.lm_head.weight, DTensor)
    close_scalar(_step(model, opt, par, 2), ref[2], "loss of the step after resuming on 2 ranks", rel=1e-5)
    close_scalar(_step(model, opt, par, 3), ref[3], "loss after the resumed update (optimizer moments)", rel=1e-5)


def test_dcp_save_on_four_ranks():
    check_result("dcp_save_four", 4)


def test_dcp_resume_on_two_ranks():
    check_result("dcp_resume_two", 2)


def test_dcp_resume_on_one_process_and_convert(tmp_path):
    check_result("dcp_save_four", 4)
    ck = SHARED / CKPT
    ref = _uninterrupted()
    torch.manual_seed(7)
    model = M3ForCausalLM(make_model(V).config)
    opt = _opt(model)
    assert read_state(ck)["step"] == 2 and has_optimizer_state(ck)
    load_sharded(ck, model, opt)
    par = _single()
    close_scalar(_step(model, opt, par, 2), ref[2], "loss of the step after resuming on one process", rel=1e-5)
    close_scalar(_step(model, opt, par, 3), ref[3], "loss after the resumed step's update", rel=1e-5)
    # DCP -> safetensors (loads on one GPU / process) -> DCP without optimizer state
    single = dcp_to_pretrained(ck, tmp_path / "hf")
    loaded = M3ForCausalLM.from_pretrained(single)
    again = M3ForCausalLM(make_model(V).config)
    load_sharded(ck, again)
    for (n, a), (_, b) in zip(loaded.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n
    back = pretrained_to_dcp(single, tmp_path / "dcp", state={"step": 2})
    assert not has_optimizer_state(back)
    fresh = M3ForCausalLM(make_model(V).config)
    fopt = _opt(fresh)
    load_sharded(back, fresh, fopt)  # weights only; the optimizer starts fresh
    for (n, a), (_, b) in zip(fresh.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n
