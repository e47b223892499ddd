"""Runs' JSONL logs are strict JSON: non-finite floats are written as null."""

from __future__ import annotations

import json
import math

from msakit.train.jsonl import append_metrics, read_metrics


def test_metrics_lines_are_strict_json(tmp_path):
    append_metrics(tmp_path, {"step": 1, "loss": float("nan"), "layers": [{"kl": float("inf")}, {"kl": 0.5}]})
    append_metrics(tmp_path, {"step": 2, "loss": 1.25})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()

    def strict(token):  # json's hook for NaN / Infinity literals: a strict parser refuses them
        raise ValueError(f"non-standard JSON constant {token}")

    recs = [json.loads(line, parse_constant=strict) for line in lines]
    assert recs[0] == {"step": 1, "loss": None, "layers": [{"kl": None}, {"kl": 0.5}]}
    assert read_metrics(tmp_path / "metrics.jsonl")[1]["loss"] == 1.25
    assert not any(isinstance(v, float) and not math.isfinite(v) for v in recs[0].values())
