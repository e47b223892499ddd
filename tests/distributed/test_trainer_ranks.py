"""The Trainer on 2 gloo ranks with FSDP2 trains exactly like one process (same losses, KL and
gradient norms step by step), logs on rank 0 only, and resumes from its sharded checkpoint; the
same with context parallelism (cp = 2) and activation checkpointing."""

from __future__ import annotations

import numpy as np
import torch

from spawn_ranks import check_result, close_scalar, rank_check
from toy_model import make_model

from msakit.distributed.launch import init_distributed, make_parallel
from msakit.train.data import PackedRows, TokenStream
from msakit.train.trainer import TrainConfig, Trainer, read_metrics

V, CONTEXT = 300, 32


def _rows() -> PackedRows:
    rng = np.random.default_rng(0)
    n = 24 * CONTEXT
    starts = np.array([0, 50, 51, 170, 300, 480, 610, n], dtype=np.int64)
    stream = TokenStream(tokens=rng.integers(1, V, n).astype(np.int32), doc_starts=starts,
                         names=[f"d{i}" for i in range(len(starts) - 1)], long=[])
    return PackedRows(stream, CONTEXT, pad_id=0)


def _cfg(**kw) -> TrainConfig:
    base = dict(steps=3, batch_size=4, lr=3e-3, lr_warmup_steps=1, dense_warmup_steps=1, log_every=1,
                eval_every=100, save_every=100, seed=0, doc_attention=True)
    return TrainConfig(**{**base, **kw})



@rank_check(worlds=(2,))
def trainer_fsdp_two_ranks(rank: int, world: int, shared) -> None:
    rows = _rows()
    ref = Trainer(make_model(V), _cfg(), rows, None, out_dir=shared / f"ref{rank}", progress=False).fit()
    par = make_parallel(init_distributed("cpu"), cp=1, batch_size=4)
    run = shared / "run"
    tr = Trainer(make_model(V), _cfg(), rows, None, out_dir=run, progress=False, parallel=par, fsdp=True)
    hist = tr.fit(until=2)
    tr.save()
    hist += tr.fit()
    for a, b in zip(hist, ref):
        for key in ("loss", "kl", "grad_norm"):
            close_scalar(a[key], b[key], f"step {b['step']} {key}", rel=1e-5)
    torch.distributed.barrier()
    logged = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in logged] == [1, 2, 3], logged  # rank 0 alone writes the log
    # a new run resumes from the step-2 sharded checkpoint and repeats step 3
    again = Trainer(make_model(V), _cfg(), rows, None, out_dir=shared / "run2", progress=False, parallel=par,
                    fsdp=True)
    again.resume_sharded(run / "sharded" / "step-00000002")
    assert again.step == 2
    (rec,) = again.fit()
    close_scalar(rec["loss"], ref[2]["loss"], "resumed step 3 loss", rel=1e-5)
    # context parallel (cp = 2: each row's sequence over both ranks) with activation checkpointing
    cp = make_parallel(init_distributed("cpu"), cp=2, batch_size=4)
    tr = Trainer(make_model(V), _cfg(), rows, None, out_dir=shared / "run-cp", progress=False, parallel=cp,
                 fsdp=True, activation_checkpointing=True)
    for a, b in zip(tr.fit(), ref):
        for key in ("loss", "kl", "grad_norm"):
            close_scalar(a[key], b[key], f"cp step {b['step']} {key}", rel=1e-5)
        assert a["cp_comm_bytes"] > 0


def test_trainer_fsdp_two_ranks():
    check_result("trainer_fsdp_two_ranks", 2)
