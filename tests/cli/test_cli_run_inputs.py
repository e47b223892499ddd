"""What README's worked examples hand from one command to the next: `eval --model` takes a run
folder (its model/, else its newest checkpoint) with the model's own selection as the default
budget; `train-drafter --resume` continues without the target (the run records it)."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

from cli_helpers import one_line_error, tree_state
from msakit.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def dense_run(env):
    """A 2-step dense train run (a conversion's source)."""
    from cli_helpers import common

    out = env["root"] / "dense_run"
    assert main(["train", "--config", env["dense_config"], "--steps", "2", *common(env, out)]) == 0
    return out


def _convert_opts(env, out):
    from cli_helpers import common

    return [a for a in common(env, out) if a not in ("--vocab-size", "300")]


def _eval_argv(model, out, *extra):
    docs = Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py"
    return ["eval", "--model", str(model), "--tasks", "loss", "--lengths", "128", "--policies", "dense,msa",
            "--samples", "1", "--docs", str(docs), "--out", str(out), "--device", "cpu", "--no-progress", *extra]


def test_eval_takes_a_train_run_folder_and_the_models_own_budget(run_dir, tmp_path, capsys):
    before = tree_state(run_dir)
    out = tmp_path / "ev"
    assert main(_eval_argv(run_dir, out)) == 0
    err = capsys.readouterr().err
    assert "checkpoints/step-00000004" in err and "budget block8-top2" in err  # the toy run: blocks of 8, top-2
    summ = json.loads((out / "summary.json").read_text())
    assert set(summ["loss"]) == {"dense", "msa"}
    assert tree_state(run_dir) == before
    # a budget given is used or refused (the model's blocks are 8 tokens)
    err = one_line_error(capsys, main(_eval_argv(run_dir, tmp_path / "ev2", "--budget", "block64-top8")))
    assert "block8-top2" in err


def test_eval_takes_a_conversion_run_folder_by_its_model(env, dense_run, tmp_path, capsys):
    conv = tmp_path / "conv"
    assert main(["convert", str(dense_run), "--train", "index", "--steps", "2", "--block-size", "16", "--topk", "2",
                 *_convert_opts(env, conv)]) == 0
    assert (conv / "model" / "config.json").is_file()
    capsys.readouterr()
    assert main(_eval_argv(conv, tmp_path / "ev")) == 0
    err = capsys.readouterr().err
    assert f"evaluating {conv / 'model'}" in err and "budget block16-top2" in err


def test_eval_refuses_a_folder_without_a_model(tmp_path, capsys):
    empty = tmp_path / "nothing"
    empty.mkdir()
    err = one_line_error(capsys, main(_eval_argv(empty, tmp_path / "ev")))
    assert "--model" in err and "no model/, checkpoint or config.json" in err
    assert not (tmp_path / "ev").exists()


def test_train_drafter_resumes_without_the_target(env, run_dir, drafter_run, tmp_path, capsys):
    import shutil

    run = tmp_path / "drafter"
    shutil.copytree(drafter_run, run)
    assert main(["train-drafter", "--resume", "--out", str(run), "--steps", "3", "--cache-dir", env["cache"],
                 "--no-progress", "--device", "cpu"]) == 0
    assert "done: step 3" in capsys.readouterr().out
    # a target other than the recorded one is refused, not silently replaced
    before = tree_state(run)
    err = one_line_error(capsys, main(["train-drafter", str(tmp_path), "--resume", "--out", str(run),
                                       "--steps", "4", "--cache-dir", env["cache"]]))
    assert "run's target is" in err and tree_state(run) == before


def test_train_drafter_needs_a_target_for_a_fresh_run(tmp_path, capsys):
    err = one_line_error(capsys, main(["train-drafter", "--out", str(tmp_path / "d")]))
    assert "TARGET" in err and "--resume" in err
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("name", ["../outside.txt", "/etc/hostname"])
def test_a_checkpoint_manifest_naming_a_file_outside_is_refused(copy_run, tmp_path, capsys, name):
    import hashlib

    from msakit.train.checkpoint import MANIFEST, find_checkpoint

    ck = find_checkpoint(copy_run)
    outside = ck / name if not name.startswith("/") else Path(name)
    if not name.startswith("/"):
        outside.write_text("not the run's\n")
    man = json.loads((ck / MANIFEST).read_text())
    man["files"][name] = hashlib.sha256(outside.read_bytes()).hexdigest() if outside.is_file() else "0"
    (ck / MANIFEST).write_text(json.dumps(man))
    before = tree_state(copy_run)
    err = one_line_error(capsys, main(["generate", str(copy_run), "--prompt", "x", "--max-new-tokens", "2",
                                       "--device", "cpu"]))
    assert "a file outside" in err and repr(name) in err
    assert tree_state(copy_run) == before


def test_convert_time_budget_bounds_the_whole_run(env, dense_run, tmp_path, monkeypatch, capsys):
    """--time-budget counts from the command's start: the training loop gets what is left after
    loading, data preparation and the first validation, less one validation (the last step's)."""
    import time

    from msakit.train.trainer import Trainer

    seen = {}
    fit = Trainer.fit

    def timed_fit(self, *a, budget_s=None, **k):
        seen["budget"], seen["at"] = budget_s, time.time()
        return fit(self, *a, budget_s=budget_s, **k)

    monkeypatch.setattr(Trainer, "fit", timed_fit)
    t0 = time.time()
    assert main(["convert", str(dense_run), "--train", "index", "--steps", "2", "--time-budget", "1000",
                 *_convert_opts(env, tmp_path / "conv")]) == 0
    assert 0 < seen["budget"] < 1000 - (seen["at"] - t0)
    # a budget spent before training: one step, said once
    capsys.readouterr()
    assert main(["convert", str(dense_run), "--train", "index", "--steps", "5", "--time-budget", "1e-6",
                 *_convert_opts(env, tmp_path / "conv2")]) == 0
    out, err = capsys.readouterr()
    assert "spent before training" in out + err and "step 1," in out
