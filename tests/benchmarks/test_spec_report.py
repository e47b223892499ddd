"""benchmarks/spec_report.py: the plot and the table from the committed H200 runs, and its errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "spec_report.py"


def test_report_from_committed_runs(tmp_path):
    out = tmp_path / "r.png"
    r = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert out.stat().st_size > 10_000
    assert "speedup" in r.stdout and r.stdout.count("x ") >= 4  # four speed rows


def test_report_rejects_a_run_without_breakdown(tmp_path):
    spd = json.loads((ROOT / "benchmarks" / "results" / "spec_NVIDIA_H200_run15.json").read_text())
    assert "round_breakdown" not in spd
    bad = tmp_path / "s.json"
    bad.write_text(json.dumps(spd))
    r = subprocess.run([sys.executable, str(SCRIPT), "--speed", str(bad), "--out", str(tmp_path / "x.png")],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode != 0 and "round_breakdown" in r.stderr
