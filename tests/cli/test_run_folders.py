"""Run folders (`msakit.run_folder`): every command that writes a folder marks it with its name and
holds it by an OS lock while it runs.  A fresh run takes only a new or empty folder, ``--resume``
only a folder of the same command's runs, a second command on a held folder is refused in one
line, and a killed run leaves its folder free.  Refusals exit 2 with one stderr line and change no
file (checksums, inside and outside ``--out``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_helpers import common, one_line_error, tree_state
from msakit import run_folder as rf
from msakit.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[2]


def _eval_argv(env, model, out, tasks="loss,passkey", *extra):
    return ["eval", "--model", str(model), "--tasks", tasks, "--lengths", "256", "--depths", "0.5",
            "--samples", "1", "--docs", env["data"], "--out", str(out), "--device", "cpu", "--no-progress", *extra]


def _model(run_dir):
    return run_dir / "checkpoints" / "step-00000004"


# ----------------------------------------------------------------------------- the library
def test_fresh_claim_marks_and_locks_and_a_failed_fresh_run_leaves_nothing(tmp_path):
    out = tmp_path / "a" / "b"
    with rf.claim(out, "train") as c:
        assert c.fresh and rf.read_marker(out)["command"] == "train"
        assert (out / rf.LOCK).is_file()
        with pytest.raises(rf.FolderBusy, match="in use by `msakit train` \\(pid"):
            rf.check_fresh(out)
        with pytest.raises(rf.FolderBusy, match="in use by `msakit train`"):
            with rf.claim(out, "train", resume=True):
                pass
    assert sorted(os.listdir(out)) == [rf.MARKER]  # the lock file goes with the run
    with pytest.raises(rf.RunFolderError, match="already holds a run of `msakit train`"):
        rf.check_fresh(out)
    with pytest.raises(rf.RunFolderError, match="holds a run of `msakit train`, not of `msakit eval`"):
        rf.check_resume(out, "eval")
    rf.check_resume(out, "convert", accepts=("train", "convert"))
    with pytest.raises(KeyboardInterrupt):
        with rf.claim(tmp_path / "x" / "y", "eval"):
            (tmp_path / "x" / "y" / "results.jsonl").write_text("{}\n")
            raise KeyboardInterrupt
    assert sorted(os.listdir(tmp_path)) == ["a"]  # what the failed fresh run created is gone


def test_resume_needs_the_commands_marker_or_a_legacy_run(tmp_path):
    user = tmp_path / "mine"
    user.mkdir()
    (user / "table.md").write_text("my table")
    with pytest.raises(rf.RunFolderError, match="holds no run of `msakit eval` to resume"):
        rf.check_resume(user, "eval")
    with pytest.raises(rf.RunFolderError, match="not empty"):
        rf.check_fresh(user)
    assert rf.check_resume(user, "eval", legacy=lambda p: (p / "table.md").is_file())  # recognised, no marker
    with rf.claim(user, "eval", resume=True, legacy=lambda p: True):
        pass
    assert sorted(os.listdir(user)) == ["table.md"]  # a legacy folder is not relabelled
    (user / rf.MARKER).write_text("[1, 2]")
    with pytest.raises(rf.RunFolderError, match="does not name the command"):
        rf.check_resume(user, "eval")
    with pytest.raises(rf.RunFolderError, match="no such run folder"):
        rf.check_resume(tmp_path / "missing", "eval")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / rf.LOCK).write_text("")  # an unheld lock file left by a killed run counts as empty
    rf.check_fresh(empty)


_HOLDER = """
import sys, time
from msakit.run_folder import claim
with claim(sys.argv[1], "train"):
    print("held", flush=True)
    time.sleep(120)
"""


def _holder(out: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, str(out)], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_second_command_on_a_held_folder_is_refused_and_a_killed_run_frees_it(env, tmp_path, capsys):
    out = tmp_path / "cc"
    p = _holder(out)
    try:
        before, outside = tree_state(out), tree_state(tmp_path / "other")
        err = one_line_error(capsys, main(["train", "--config", env["config"], "--steps", "2", *common(env, out)]))
        assert "in use by `msakit train` (pid" in err and str(p.pid) in err
        err = one_line_error(capsys, main(["train", "--resume", "--out", str(out)]))
        assert "in use by" in err
        assert tree_state(out) == before and tree_state(tmp_path / "other") == outside
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    # the kernel dropped the killed process's lock: the folder is free (its marker says a train run)
    assert rf.read_marker(out)["command"] == "train"
    with rf.claim(out, "train", resume=True):
        pass


def test_two_train_runs_started_together_one_is_refused(env, tmp_path):
    out = tmp_path / "cc"
    argv = [sys.executable, "-m", "msakit", "train", "--config", env["config"], "--steps", "3", "--save-every", "3",
            *common(env, out)]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}) for _ in range(2)]
    res = [(p.wait(timeout=600), p.stderr.read()) for p in procs]
    codes = sorted(rc for rc, _ in res)
    assert codes == [0, 2], res
    err = next(e for rc, e in res if rc == 2).strip().splitlines()
    assert len(err) == 1 and ("in use by" in err[0] or "already holds a run" in err[0] or "was taken" in err[0]), err
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in recs if r.get("kind") == "train"]
    assert steps == sorted(set(steps)) == [1, 2, 3]  # one run's log, not two mixed


# ----------------------------------------------------------------------------- the commands
def test_eval_never_writes_a_folder_it_did_not_make(env, run_dir, tmp_path, capsys):
    user = tmp_path / "mine"
    user.mkdir()
    (user / "table.md").write_text("the user's own table")
    for argv in (_eval_argv(env, _model(run_dir), user, "loss", "--resume"), _eval_argv(env, _model(run_dir), user)):
        before = tree_state(tmp_path)
        err = one_line_error(capsys, main(argv))
        assert "msakit eval: error:" in err and ("no run of `msakit eval`" in err or "not empty" in err), err
        assert tree_state(tmp_path) == before
    # a train run's folder is neither a fresh --out nor an evaluation to resume
    before = tree_state(run_dir)
    err = one_line_error(capsys, main(_eval_argv(env, _model(run_dir), run_dir)))
    assert "already holds a run of `msakit train`" in err
    err = one_line_error(capsys, main(_eval_argv(env, _model(run_dir), run_dir, "loss", "--resume")))
    assert "holds a run of `msakit train`, not of `msakit eval`" in err
    assert tree_state(run_dir) == before


def test_eval_resumed_with_other_tasks_reports_every_result(env, run_dir, tmp_path, capsys):
    out = tmp_path / "ev"
    assert main(_eval_argv(env, _model(run_dir), out, "loss")) == 0
    assert rf.read_marker(out)["command"] == "eval" and not (out / rf.LOCK).exists()
    capsys.readouterr()
    assert main(_eval_argv(env, _model(run_dir), out, "passkey", "--resume")) == 0
    table = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["tasks"] == ["loss", "passkey"]
    assert "256" in summary["loss"]["dense"] and "256" in summary["retrieval"]["dense"]["passkey"]
    assert "loss 256" in table and "passkey 256" in table
    # results.jsonl is strict JSON (no NaN / Infinity literals)

    def strict(token):
        raise ValueError(token)

    for line in (out / "results.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=strict)
    # train / train-drafter do not resume an evaluation's folder
    before = tree_state(out)
    err = one_line_error(capsys, main(["train", "--resume", "--out", str(out)]))
    assert "holds a run of `msakit eval`, not of `msakit train`" in err
    assert tree_state(out) == before


def test_train_drafter_resume_refuses_a_train_run(run_dir, capsys):
    before = tree_state(run_dir)
    err = one_line_error(capsys, main(["train-drafter", str(run_dir), "--resume", "--out", str(run_dir)]))
    assert "holds a run of `msakit train`, not of `msakit train-drafter`" in err
    assert tree_state(run_dir) == before


def test_train_runs_are_marked_and_a_legacy_run_still_resumes(run_dir, copy_run, capsys):
    marker = rf.read_marker(run_dir)
    assert marker["command"] == "train" and marker["msakit"]
    assert not (run_dir / rf.LOCK).exists()
    (copy_run / rf.MARKER).unlink()  # a run written before markers: its checkpoint identifies it
    assert main(["train", "--resume", "--out", str(copy_run), "--steps", "5", "--no-progress"]) == 0
    assert not (copy_run / rf.MARKER).exists()
