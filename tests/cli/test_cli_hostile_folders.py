"""Corrupt or hostile model folders and checkpoints: every command that loads a model, a tokenizer
or a checkpoint (generate, eval, train --init / --resume, convert, train-drafter) refuses a
truncated, empty, garbage or absurd-header safetensors file, an unreadable tokenizer.json, weights
holding NaN / inf, a malformed rng.safetensors and a trainer_state.json with missing or mistyped
fields in one stderr line naming the file, exit status 2, with every file outside --out unchanged.
The library raises one error type for all of them (`ModelFolderError`)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cli_helpers import one_line_error, tree_state
from msakit.cli import main
from msakit.models import M3ForCausalLM
from msakit.models.io import ModelFolderError, read_tokenizer_file
from msakit.train.checkpoint import CheckpointError, load_checkpoint_state

pytestmark = pytest.mark.usefixtures("one_thread")

WEIGHTS = "model.safetensors"


def _last_checkpoint(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()


def _edit_weights(folder: Path, fn) -> None:
    t = load_file(str(folder / WEIGHTS))
    fn(t)
    save_file(t, str(folder / WEIGHTS), metadata={"format": "pt"})


def _header(h: dict) -> bytes:
    raw = json.dumps(h).encode()
    return struct.pack("<Q", len(raw)) + raw


def _nan(t):
    for k in t:
        t[k] = torch.full_like(t[k], float("nan"))


def _one_inf(t):
    t["model.layers.0.self_attn.q_proj.weight"][0, 0] = float("inf")


# what each hostile model folder does to the copy of a good one, and a word its error names
DAMAGE = {
    "truncated": (lambda d: (d / WEIGHTS).write_bytes((d / WEIGHTS).read_bytes()[:1000]), WEIGHTS),
    "empty": (lambda d: (d / WEIGHTS).write_bytes(b""), WEIGHTS),
    "garbage": (lambda d: (d / WEIGHTS).write_bytes(os.urandom(4096)), WEIGHTS),
    "absurd-header": (lambda d: (d / WEIGHTS).write_bytes(struct.pack("<Q", 2**62) + b"{}"), WEIGHTS),
    "absurd-shape": (lambda d: (d / WEIGHTS).write_bytes(_header(
        {"lm_head.weight": {"dtype": "F32", "shape": [10**12], "data_offsets": [0, 8]}}) + b"\0" * 8), WEIGHTS),
    "tokenizer": (lambda d: (d / "tokenizer.json").write_text('{"version": "1.0", "model": 12'), "tokenizer.json"),
    "nan": (lambda d: _edit_weights(d, _nan), "NaN"),
    "one-inf": (lambda d: _edit_weights(d, _one_inf), "q_proj"),
}


@pytest.fixture(scope="module")
def hostile(run_dir, tmp_path_factory):
    """{kind: a model folder (config.json, weights, tokenizer.json) damaged that way}."""
    root = tmp_path_factory.mktemp("hostile")
    src = _last_checkpoint(run_dir)
    out = {}
    for kind, (damage, _) in DAMAGE.items():
        d = root / kind
        d.mkdir()
        for f in ("config.json", WEIGHTS, "tokenizer.json"):
            shutil.copy(src / f, d / f)
        damage(d)
        out[kind] = d
    return out


def _refused(capsys, argv, watched: Path, out: Path | None, word: str) -> str:
    before = tree_state(watched)
    err = one_line_error(capsys, main(argv))
    assert word in err, err
    assert tree_state(watched) == before
    if out is not None:
        assert not out.exists()
    return err


DATA = ["--no-stdlib", "--context", "64", "--batch-size", "2", "--no-progress", "--device", "cpu",
        "--val-fraction", "0.15"]


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_generate_and_eval_refuse_a_damaged_model_folder(hostile, kind, tmp_path, capsys, env):
    folder = hostile[kind]
    word = DAMAGE[kind][1]
    _refused(capsys, ["generate", str(folder), "--max-new-tokens", "2", "--device", "cpu"], folder, None, word)
    out = tmp_path / "eval"
    _refused(capsys, ["eval", "--model", str(folder), "--tasks", "loss", "--lengths", "64", "--samples", "1",
                      "--out", str(out), "--device", "cpu", "--no-progress", "--docs", env["data"]],
             folder, out, word)


@pytest.mark.parametrize("kind", ["truncated", "tokenizer", "nan"])
def test_train_init_convert_and_drafter_refuse_a_damaged_model_folder(hostile, kind, tmp_path, capsys, env):
    folder = hostile[kind]
    word = DAMAGE[kind][1]
    data = ["--data", env["data"], "--cache-dir", env["cache"], *DATA]
    for argv in (["train", "--init", str(folder), "--steps", "1"],
                 ["convert", str(folder), "--steps", "1", "--train", "all"],
                 ["train-drafter", str(folder), "--steps", "1", "--size", "tiny"]):
        out = tmp_path / argv[0]
        _refused(capsys, [*argv, "--out", str(out), *data], folder, out, word)


def test_one_error_type(hostile):
    for kind in ("truncated", "garbage", "nan"):
        with pytest.raises(ModelFolderError, match=str(hostile[kind] / WEIGHTS).replace("\\", "\\\\")):
            M3ForCausalLM.from_pretrained(hostile[kind])
    with pytest.raises(ModelFolderError, match="tokenizer.json"):
        read_tokenizer_file(hostile["tokenizer"] / "tokenizer.json")
    assert issubclass(CheckpointError, ModelFolderError) and issubclass(ModelFolderError, ValueError)


# ----------------------------------------------------------------------------- checkpoints
def _rewrite_manifest(ck: Path) -> None:
    """Re-hash every file: the damage is one a manifest check cannot see."""
    m = json.loads((ck / "manifest.json").read_text())
    m["files"] = {f: hashlib.sha256((ck / f).read_bytes()).hexdigest() for f in m["files"]}
    (ck / "manifest.json").write_text(json.dumps(m))


def _rng(fn):
    def damage(ck: Path) -> None:
        t = load_file(str(ck / "rng.safetensors"))
        fn(t)
        save_file(t, str(ck / "rng.safetensors"))
    return damage


def _state(fn):
    def damage(ck: Path) -> None:
        s = json.loads((ck / "trainer_state.json").read_text())
        s = fn(s)
        (ck / "trainer_state.json").write_text(json.dumps(s))
    return damage


def _drop(key, sub=None):
    def fn(s):
        del (s if sub is None else s[sub])[key]
        return s
    return fn


def _set(key, val, sub=None):
    def fn(s):
        (s if sub is None else s[sub])[key] = val
        return s
    return fn


CKPT_DAMAGE = {
    "rng-missing-tensor": (_rng(lambda t: t.pop("torch_cpu")), "rng.safetensors"),
    "rng-short": (_rng(lambda t: t.__setitem__("torch_cpu", t["torch_cpu"][:10].clone())), "rng.safetensors"),
    "rng-dtype": (_rng(lambda t: t.__setitem__("numpy_keys", t["numpy_keys"].float())), "rng.safetensors"),
    "rng-garbage": (lambda ck: (ck / "rng.safetensors").write_bytes(b"x" * 24), "rng.safetensors"),
    "no-step": (_state(_drop("step")), "'step'"),
    "step-text": (_state(_set("step", "four")), "'step'"),
    "no-loader": (_state(_drop("loader")), "'loader'"),
    "loader-field": (_state(_drop("pos", "loader")), "'loader.pos'"),
    "no-rng": (_state(_drop("rng")), "'rng'"),
    "rng-python": (_state(_set("python", 3, "rng")), "'rng.python'"),
    "no-config": (_state(_drop("config")), "'config'"),
    "config-type": (_state(_set("steps", "x", "config")), "'steps'"),
    "tokens-seen": (_state(_set("tokens_seen", "x")), "'tokens_seen'"),
    "not-an-object": (_state(lambda s: [1, 2]), "trainer_state.json"),
    "optimizer-json": (lambda ck: (ck / "optimizer.json").write_text('{"param_names": 3}'), "optimizer"),
}


@pytest.mark.parametrize("kind", list(CKPT_DAMAGE))
def test_resume_refuses_a_malformed_checkpoint(run_dir, env, kind, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    ck = _last_checkpoint(run)
    damage, word = CKPT_DAMAGE[kind]
    damage(ck)
    _rewrite_manifest(ck)
    before = tree_state(run)
    err = one_line_error(capsys, main(["train", "--resume", "--out", str(run), "--steps", "6", "--no-progress",
                                       "--device", "cpu", "--cache-dir", env["cache"]]))
    assert word in err, err
    assert tree_state(run) == before
    if kind not in ("optimizer-json", "config-type"):  # read by the trainer / its config class
        with pytest.raises(CheckpointError):
            load_checkpoint_state(ck)
