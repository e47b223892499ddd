"""benchmarks/ruler_gpu.py: the task deal and the merge of shard folders (the parallel launch
itself runs `msakit eval`, tested in tests/eval)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import ruler_gpu  # noqa: E402
from msakit.eval.ruler import RULER_TASKS  # noqa: E402
from msakit.eval.runner import record_key  # noqa: E402


def test_deal_covers_every_task_once_costliest_first():
    groups = ruler_gpu.deal(list(RULER_TASKS), 4)
    assert len(groups) == 4
    flat = [t for g in groups for t in g]
    assert sorted(flat) == sorted(RULER_TASKS)
    assert groups[0][0] == "cwe"  # the costliest task opens the first share
    load = [sum(ruler_gpu._COST.get(t, 40) for t in g) for g in groups]
    assert max(load) - min(load) <= 120  # greedy: within one task's cost
    assert ruler_gpu.deal(["fwe", "cwe"], 8) == [["cwe"], ["fwe"]]
    with pytest.raises(ValueError, match="workers"):
        ruler_gpu.deal(["cwe"], 0)


def _rec(policy, task, length, i, score):
    return dict(policy=policy, task=task, length=length, depth=None, index=i, key=record_key(policy, task, length, None, i),
                selection="x", budget="block64-top8", score=score, pred="p", outputs=["a"], metric="all",
                prompt_tokens=length - 10, generated=3, size=1)


def _write(folder: Path, recs):
    folder.mkdir(parents=True)
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_merge_deduplicates_and_reports(tmp_path, capsys):
    a = [_rec(p, "niah_single_1", 512, i, 1.0 if p == "dense" else 0.0) for p in ("dense", "msa") for i in range(3)]
    b = [_rec("dense", "niah_single_1", 512, 2, 0.0), _rec("dense", "qa_1", 512, 0, 1.0),
         _rec("msa", "qa_1", 512, 0, 1.0)]
    _write(tmp_path / "s1", a)
    _write(tmp_path / "s2", b)
    assert ruler_gpu.main(["--merge", str(tmp_path / "s1"), str(tmp_path / "s2" / "results.jsonl"),
                           "--out", str(tmp_path / "m")]) == 0
    merged = tmp_path / "m" / "merged"
    lines = (merged / "results.jsonl").read_text().splitlines()
    assert len(lines) == 8  # the repeated key keeps the first record (score 1.0)
    kept = [json.loads(x) for x in lines if json.loads(x)["key"] == record_key("dense", "niah_single_1", 512, None, 2)]
    assert [r["score"] for r in kept] == [1.0]
    table = (merged / "table.md").read_text()
    assert "niah_single_1" in table and "qa_1" in table and "(3)" in table
    assert (merged / "summary.json").is_file()
    assert "niah_single_1" in capsys.readouterr().out


def test_refusals(tmp_path, capsys):
    assert ruler_gpu.main(["--merge", str(tmp_path / "none"), "--out", str(tmp_path / "m")]) == 2
    assert "no results.jsonl" in capsys.readouterr().err
    assert ruler_gpu.main(["--out", str(tmp_path / "m")]) == 2
    assert "--model" in capsys.readouterr().err
    _write(tmp_path / "two", [_rec("dense", "qa_1", 512, 0, 1.0), dict(_rec("msa", "qa_1", 512, 0, 1.0), budget="b")])
    assert ruler_gpu.main(["--merge", str(tmp_path / "two"), "--out", str(tmp_path / "m2")]) == 2
    assert "one budget" in capsys.readouterr().err
