"""benchmarks/distributed.py runs (CPU smoke, one process): cp-check compares the CP path with the
plain one and writes its JSON to --out only (a CPU run is not a result)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import distributed as bench  # noqa: E402


def test_cp_check_and_overhead_smoke(tmp_path):
    assert bench.main(["cp-check", "--device", "cpu", "--tokens", "75", "--layers", "1", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "distributed_cp_check_cpu_x1.json").read_text())
    assert res["selection_rows_differing"] == 0 and res["kl_rel_err"] < 1e-5 and res["grad_rel_err_max"] < 1e-5
    assert bench.main(["cp-overhead", "--device", "cpu", "--tokens", "64", "--layers", "1", "--steps", "1",
                       "--warmup", "0", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "distributed_cp_overhead_cpu_x1.json").read_text())
    assert res["plain_step_s"] > 0 and res["cp_step_s"] > 0 and res["bar"] == 1.03
