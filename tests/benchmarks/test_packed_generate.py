"""benchmarks/packed_generate.py's CPU smoke run: the packed, reference and bf16 models decode and
the packed path's greedy tokens are compared with the reference path's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import common, packed_generate  # noqa: E402


def test_tiny_run_writes_the_comparison(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    assert packed_generate.main(["--tiny", "--reps", "1", "--out", str(tmp_path / "out")]) == 0
    files = list((tmp_path / "results").glob("packed_generate_*.json"))
    assert len(files) == 1
    res = json.loads(files[0].read_text())
    assert set(res["rows"]) == {"packed", "reference", "bf16"}
    assert all(len(r["tokens"]) == res["new"] and r["tok_s"] > 0 for r in res["rows"].values())
    # on the CPU both packed loads dequantize (no kernel), so their greedy tokens must agree
    assert res["greedy_tokens_identical"] is True and res["first_mismatch"] is None
    assert "greedy tokens identical" in capsys.readouterr().out


def test_refusals(capsys):
    assert packed_generate.main(["--tiny", "--new", "0"]) == 2
    assert "--new" in capsys.readouterr().err
