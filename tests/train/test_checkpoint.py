"""Checkpoints: resume reproduces the uninterrupted loss trajectory, corruption is rejected,
an interruption (also mid-save) leaves the previous checkpoint loadable."""

from __future__ import annotations

import json

import pytest
import torch

from msakit.train import checkpoint as ck
from msakit.train.trainer import TrainConfig, Trainer, read_metrics

from toy_model import make_model, stdlib_data

pytestmark = pytest.mark.usefixtures("one_thread")


FILES = ["json/decoder.py", "json/encoder.py", "textwrap.py", "fnmatch.py", "bisect.py", "heapq.py", "glob.py"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return stdlib_data(tmp_path_factory.mktemp("ccorpus"), FILES, val_fraction=0.15)


def _trainer(data, out, steps=12, **kw):
    torch.manual_seed(0)
    model = make_model(data.tokenizer.vocab_size)
    cfg = TrainConfig(steps=steps, batch_size=2, lr=3e-3, lr_warmup_steps=2, dense_warmup_steps=steps // 3 + 1,
                      log_every=1, eval_every=1000, eval_rows=4, save_every=kw.pop("save_every", steps // 2), seed=3, **kw)
    return Trainer(model, cfg, data.train, data.val, out_dir=out, tokenizer=data.tokenizer, progress=False)


def test_resume_gives_the_same_loss_trajectory(data, tmp_path):
    straight = _trainer(data, tmp_path / "a")
    full = [r["loss"] for r in straight.fit()]
    assert len(full) == 12
    half = _trainer(data, tmp_path / "b")
    first = [r["loss"] for r in half.fit(until=6)]
    # make the interruption count: train two steps past the checkpoint, then throw that state away
    half.cfg.save_every = 1000
    half.fit(until=8)
    resumed = _trainer(data, tmp_path / "b")
    with torch.no_grad():  # scramble the fresh weights: resume must overwrite all of them
        for p in resumed.model.parameters():
            p.add_(1.0)
    ckpt = resumed.resume(tmp_path / "b")
    assert ckpt.name == "step-00000006" and resumed.step == 6
    second = [r["loss"] for r in resumed.fit()]
    assert first + second == full  # bit-identical on CPU / float32
    logged = [r["loss"] for r in read_metrics(tmp_path / "b" / "metrics.jsonl") if r["kind"] == "train"]
    assert logged == pytest.approx(full)  # the log was rewound to the checkpoint, then continued


def test_corrupt_or_incomplete_checkpoint_is_rejected(data, tmp_path):
    tr = _trainer(data, tmp_path / "r", steps=2, save_every=2)
    tr.fit()
    path = ck.resolve_checkpoint(tmp_path / "r")
    manifest = ck.verify_checkpoint(path)
    assert {"optimizer.safetensors", "optimizer.json", "rng.safetensors", "trainer_state.json", "tokenizer.json"} <= set(manifest["files"])
    assert not any(f.endswith((".pt", ".pkl", ".bin")) for f in manifest["files"])  # no pickle anywhere
    weights = next(f for f in manifest["files"] if f.startswith("model") and f.endswith(".safetensors"))
    blob = bytearray((path / weights).read_bytes())
    blob[-5] ^= 0xFF
    (path / weights).write_bytes(bytes(blob))
    fresh = _trainer(data, tmp_path / "r", steps=2)
    with pytest.raises(ck.CheckpointError, match="corrupt"):
        fresh.resume(tmp_path / "r")
    (path / weights).unlink()
    with pytest.raises(ck.CheckpointError, match="missing"):
        ck.verify_checkpoint(path)
    (path / ck.MANIFEST).write_text("{broken")
    with pytest.raises(ck.CheckpointError, match="corrupt manifest"):
        ck.verify_checkpoint(path)
    with pytest.raises(FileNotFoundError):
        ck.resolve_checkpoint(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ck.CheckpointError, match="no complete checkpoint"):
        ck.resolve_checkpoint(tmp_path / "empty")


def test_mismatching_checkpoint_is_rejected(data, tmp_path):
    tr = _trainer(data, tmp_path / "m", steps=2, save_every=2)
    tr.fit()
    torch.manual_seed(0)
    other = make_model(data.tokenizer.vocab_size, hidden_size=48)
    cfg = TrainConfig(steps=2, batch_size=2)
    t2 = Trainer(other, cfg, data.train, data.val, out_dir=tmp_path / "m2", progress=False)
    with pytest.raises(ck.CheckpointError):
        t2.resume(tmp_path / "m")


def test_ctrl_c_keeps_the_previous_checkpoint(data, tmp_path):
    out = tmp_path / "k"
    tr = _trainer(data, out, steps=12, save_every=3)

    def interrupt(trainer, rec):
        if trainer.step == 5:
            raise KeyboardInterrupt

    tr.callbacks.append(interrupt)
    with pytest.raises(KeyboardInterrupt):
        tr.fit()
    assert ck.resolve_checkpoint(out).name == "step-00000003"
    # interrupt in the middle of writing the next checkpoint, at every stage of the write
    for stage in ("model", "optimizer", "state", "manifest", "rename"):
        def hook(s, stage=stage):
            if s == stage:
                raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            tr.save(_hook=hook)
        good = ck.resolve_checkpoint(out)
        assert good.name == "step-00000003", stage  # `latest` moves only once the new folder is complete
        ck.verify_checkpoint(good)
        assert not list((out / "checkpoints").glob(".tmp-step-*"))  # the half-written folder is gone
    fresh = _trainer(data, out, steps=12)
    fresh.resume(out)
    assert fresh.step == 3
    state = json.loads((ck.resolve_checkpoint(out) / "trainer_state.json").read_text())
    assert state["step"] == fresh.step
