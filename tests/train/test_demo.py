"""`msakit demo`: the pipeline end to end at toy size (fast), its output-folder rules (never a
user's file overwritten, no temporary folder left on SIGTERM), and the real demo (slow, opt-in)."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from msakit.cli import main
from msakit.train import demo

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def toy_profile(monkeypatch):
    prof = dict(demo.PROFILES["tiny"], context=128, vocab_size=300, batch_size=2, final_eval_rows=4, eval_rows=2,
                recall_rows=1, sample_tokens=8, tokenizer_bytes=300_000)
    monkeypatch.setitem(demo.PROFILES, "tiny", prof)
    return prof


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("demo-cache")


def _demo(out, cache, *extra):
    return main(["demo", "--steps", "4", "--out", str(out), "--cache-dir", str(cache), "--no-progress",
                 "--device", "cpu", *extra])


def _state(p):
    return {str(f.relative_to(p)): f.read_bytes() for f in sorted(p.rglob("*")) if f.is_file()}


def test_demo_pipeline_at_toy_size_replaces_only_an_earlier_demo(toy_profile, tmp_path, cache, capsys):
    out = tmp_path / "runs" / "demo"
    out.mkdir(parents=True)
    (out / "report.md").write_text("an earlier demo's report")
    (out / demo.DEMO_MARKER).write_text(json.dumps({"files": ["report.md", "loss.png"]}))
    rc = _demo(out, cache)
    assert rc == 0
    printed = capsys.readouterr().out
    assert "validation loss, same weights: dense" in printed and "context-free" in printed
    # 4 steps: far from learning anything from context, so the comparison is not called a pass
    assert "NOT TESTED: dense is" in printed and "PASS" not in printed
    # the phases after the training bar say what they do
    assert "final evaluation of the same weights" in printed and "sampling" in printed
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temporary folders left
    for name in ("report.md", "metrics.jsonl", "loss.png", "recall.png", "tokenizer.json", demo.DEMO_MARKER):
        assert (out / name).is_file(), name
    assert json.loads((out / demo.DEMO_MARKER).read_text())["files"] == sorted(
        p.name for p in out.iterdir() if p.name != demo.DEMO_MARKER)
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in recs if r["kind"] == "final"][-1]
    assert final["step"] == 4 and len(final["recall_per_layer"]) == 4
    # context 128 = 4 blocks of 32 and top-4: the selection keeps everything, so sparse == dense
    assert final["val_loss_sparse"] == pytest.approx(final["val_loss_dense"], rel=1e-5)
    assert all(r == pytest.approx(1.0, abs=1e-5) for r in final["recall_per_layer"])
    report = (out / "report.md").read_text()
    assert "| dense |" in report and "| sparse" in report and "**NOT TESTED**" in report and "## Sample" in report
    assert "| context-free" in report and "What the comparison can show" in report
    assert final["verdict"] == "NOT TESTED" and final["val_loss_unigram"] > 0
    assert main(["generate", str(out), "--max-new-tokens", "4", "--device", "cpu"]) == 0
    # its own output can be refreshed; a user's file added beside it makes it a user folder again
    (out / "notes.txt").write_text("mine")
    before = _state(out)
    assert _demo(out, cache) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "notes.txt" in err
    assert _state(out) == before


def test_demo_refuses_a_user_folder_and_the_working_directory(toy_profile, tmp_path, cache, monkeypatch, capsys):
    user = tmp_path / "mine"
    user.mkdir()
    (user / "thesis.tex").write_text("years of work")
    before = _state(user)
    assert _demo(user, cache) == 2
    assert "not empty" in capsys.readouterr().err
    monkeypatch.chdir(user)
    assert _demo(".", cache) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not empty" in err
    assert _state(user) == before and sorted(os.listdir(tmp_path)) == ["mine"]
    # the working directory holding an earlier demo's output is refused too (it cannot be swapped)
    (user / "thesis.tex").unlink()
    (user / "report.md").write_text("r")
    (user / demo.DEMO_MARKER).write_text(json.dumps({"files": ["report.md"]}))
    assert _demo(".", cache) == 2
    assert "working directory" in capsys.readouterr().err


def test_demo_into_an_empty_folder_and_sigterm_leaves_no_temporary_folder(toy_profile, tmp_path, cache,
                                                                           monkeypatch, capsys):
    from msakit.train.trainer import Trainer

    def fit(self, *a, **k):
        assert any(p.name.startswith(".") for p in self.out_dir.parent.iterdir())  # the temporary folder
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)

    monkeypatch.setattr(Trainer, "fit", fit)
    new = tmp_path / "a" / "b" / "demo"
    assert _demo(new, cache) == 143
    assert "terminated" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == []  # no .demo-tmp-*, and the parents it created are gone
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _demo(empty, cache) == 143
    assert list(empty.iterdir()) == []


@pytest.mark.skipif(os.environ.get("MSAKIT_SLOW") != "1", reason="the full demo takes ~3 minutes; set MSAKIT_SLOW=1")
def test_full_demo_within_five_minutes(tmp_path, capsys):
    t0 = time.time()
    assert main(["demo", "--out", str(tmp_path / "demo"), "--no-progress"]) == 0
    assert time.time() - t0 < 300
    final = [json.loads(x) for x in (tmp_path / "demo" / "metrics.jsonl").read_text().splitlines()][-1]
    assert final["kind"] == "final" and final["relative_gap"] <= demo.BAR


def test_verdict_tests_the_selection_only_for_a_model_that_uses_context():
    # near the context-free loss: not a test of the selection, whatever the gap
    word, why = demo.verdict(dense=6.8, sparse=6.81, unigram=6.6)
    assert word == "NOT TESTED" and "context-free" in why
    word, why = demo.verdict(dense=4.0, sparse=4.05, unigram=6.0)
    assert word == "PASS" and "97.5%" in why  # keeps (6 - 4.05) / (6 - 4) of the gain
    assert demo.verdict(dense=4.0, sparse=4.2, unigram=6.0)[0] == "FAIL"


def test_unigram_loss_is_the_smoothed_frequencies_cross_entropy():
    import math

    import numpy as np
    import torch

    from msakit.train.data import Batch, PackedRows, TokenStream

    stream = TokenStream(np.array([0, 0, 0, 1], dtype=np.int32), np.array([0, 4], dtype=np.int64), ["a"], [])
    rows = PackedRows(stream, 4, pad_id=3)
    labels = torch.tensor([[0, 1, -100, 2]])
    b = Batch(labels.clamp(min=0), labels, [torch.tensor([0, 4], dtype=torch.int32)])
    # counts + 1 over a vocabulary of 3: p = (4, 2, 1) / 7
    want = -(math.log(4 / 7) + math.log(2 / 7) + math.log(1 / 7)) / 3
    assert demo.unigram_loss(rows, [b], 3) == pytest.approx(want)


def test_recall_plot_of_a_short_run_is_per_layer_bars(tmp_path):
    from msakit.train import plots

    recs = [{"kind": "train", "step": 1, "loss": 6.0}, {"kind": "eval", "step": 2, "val_loss": 5.0,
            "recall_per_layer": [0.5, 0.6], "oracle_per_layer": [0.7, 0.8]},
            {"kind": "final", "step": 2, "val_loss_dense": 5.0, "recall_per_layer": [0.55, float("nan")],
             "oracle_per_layer": [0.7, 0.8], "recall_far_per_layer": [None, 0.3], "oracle_far_per_layer": [0.4, 0.5]}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs).replace("NaN", "null"))
    calls = []
    orig = plots._recall_bars
    plots_bars = lambda *a: (calls.append(a[1]["step"]), orig(*a))  # noqa: E731
    import unittest.mock

    with unittest.mock.patch.object(plots, "_recall_bars", plots_bars):
        written = plots.write_plots(tmp_path / "metrics.jsonl", tmp_path)
    assert calls == [2] and tmp_path / "recall.png" in written and (tmp_path / "recall.png").stat().st_size > 0


def test_publishing_into_an_empty_folder_moves_the_files_up(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    assert demo.output_mode(out) == "empty"
    work = out / ".demo-tmp-x"
    (work / "checkpoints").mkdir(parents=True)
    (work / "report.md").write_text("r")
    demo.move_into_place(work, out, "empty")
    assert sorted(os.listdir(out)) == sorted([demo.DEMO_MARKER, "checkpoints", "report.md"])
    assert demo.output_mode(out) == "replace"  # a later demo may refresh it
    assert demo.output_mode(tmp_path / "missing") == "new"
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a folder"):
        demo.output_mode(tmp_path / "file")
