"""benchmarks/versus.py: the same headline metrics on both sides, ratios and verdicts."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.versus import RUNS, rows_for  # noqa: E402


def test_rows_compare_the_headline_numbers():
    old = json.loads((ROOT / "benchmarks" / "results" / "decode_NVIDIA_H200_run18.json").read_text())
    new = copy.deepcopy(old)
    row = next(r for r in new["rows"] if r.get("B") == 1 and r.get("N") == 1048576 and r.get("idx") == "bf16")
    row["msa_ms"] *= 1.10  # 10% slower
    rows = {r["metric"]: r for r in rows_for("decode", old, new, 0.03)}
    assert rows["1M B1 bf16 msa us"]["verdict"] == "WORSE" and abs(rows["1M B1 bf16 msa us"]["ratio"] - 1.1) < 1e-9
    assert rows["1M B8 fp8 msa us"]["verdict"] == "ok"
    assert set(RUNS) == {"prefill", "decode", "generate_compile", "spec"}
