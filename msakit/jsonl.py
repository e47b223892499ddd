"""JSON Lines as msakit writes them (a run's ``metrics.jsonl``, an evaluation's ``results.jsonl``):
one strict JSON object per line.

Every line is standard JSON: a float that is not finite (NaN, inf) is written as ``null``, so
strict parsers read every file; readers take ``null`` as "no value".  A torn last line (an
interrupted write) is skipped by `read_jsonl` and cut by `drop_torn_tail` before appending again.
Standard library only (a leaf module).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

__all__ = ["append_jsonl", "drop_torn_tail", "dumps_strict", "read_jsonl", "strict_json"]


def strict_json(value: Any) -> Any:
    """`value` with every non-finite float (also inside dicts, lists, tuples) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def dumps_strict(value: Any, **kw: Any) -> str:
    """`json.dumps` of `strict_json(value)` (never NaN / Infinity literals); `kw`: json.dumps's options."""
    return json.dumps(strict_json(value), allow_nan=False, **kw)


def append_jsonl(path: str | os.PathLike, *records: dict, sort_keys: bool = False, sync: bool = False) -> None:
    """Append each of `records` as one strict JSON line to `path` (its folder is created); `sync`:
    flushed to the disk before returning."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "a", encoding="utf-8") as fh:
        fh.write("".join(dumps_strict(r, sort_keys=sort_keys) + "\n" for r in records))
        if sync:
            fh.flush()
            os.fsync(fh.fileno())


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The records of a JSON Lines file ([] when it does not exist; blank lines and a torn last
    line are skipped)."""
    p = Path(path)
    if not p.is_file():
        return []
    out = []
    for line in p.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def drop_torn_tail(path: str | os.PathLike) -> None:
    """Cut a last line without its newline (an interrupted write) so that new records start clean."""
    p = Path(path)
    if not p.is_file():
        return
    data = p.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(p, "r+b") as fh:
            fh.truncate(data.rfind(b"\n") + 1)
