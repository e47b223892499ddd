"""Runs' JSON Lines logs (``metrics.jsonl``): one strict JSON object per line.

Every line is standard JSON: a float that is not finite (NaN, inf) is written as ``null``, so
strict parsers read the log; readers take ``null`` as "no value"."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

__all__ = ["METRICS_FILE", "append_jsonl", "append_metrics", "read_jsonl", "read_metrics", "strict_json"]

METRICS_FILE = "metrics.jsonl"


def strict_json(value: Any) -> Any:
    """`value` with every non-finite float (also inside dicts, lists, tuples) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def append_jsonl(path: str | os.PathLike, record: dict) -> None:
    """Append `record` as one strict JSON line to `path` (its folder is created)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(strict_json(record), allow_nan=False) + "\n")


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The records of a JSON Lines file ([] when it does not exist; a torn last line is skipped)."""
    p = Path(path)
    if not p.is_file():
        return []
    out = []
    for line in p.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def append_metrics(out_dir: str | os.PathLike, record: dict) -> None:
    """One line appended to out_dir / metrics.jsonl."""
    append_jsonl(Path(out_dir) / METRICS_FILE, record)


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a metrics.jsonl."""
    return read_jsonl(path)
