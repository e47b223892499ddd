"""Runs' JSON Lines logs (``metrics.jsonl``): one strict JSON object per line, written by
`msakit.jsonl` (a float that is not finite is written as ``null``; readers take ``null`` as "no
value")."""

from __future__ import annotations

import os
from pathlib import Path

from msakit.jsonl import append_jsonl, read_jsonl, strict_json

__all__ = ["METRICS_FILE", "append_jsonl", "append_metrics", "read_jsonl", "read_metrics", "strict_json"]

METRICS_FILE = "metrics.jsonl"


def append_metrics(out_dir: str | os.PathLike, record: dict) -> None:
    """One line appended to out_dir / metrics.jsonl."""
    append_jsonl(Path(out_dir) / METRICS_FILE, record)


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a metrics.jsonl."""
    return read_jsonl(path)
