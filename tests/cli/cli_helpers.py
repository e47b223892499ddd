"""Helpers shared by the CLI tests: the tiny corpus's options, folder snapshots, one-line errors."""

from __future__ import annotations

import hashlib
from pathlib import Path


def common(env, out, *extra):
    """Options of a tiny CPU run on the test corpus (vocab 300, context 64, batch 2)."""
    return ["--out", str(out), "--no-stdlib", "--data", env["data"], "--vocab-size", "300", "--context", "64",
            "--cache-dir", env["cache"], "--batch-size", "2", "--lr-warmup-steps", "1", "--log-every", "1",
            "--eval-every", "4", "--eval-rows", "4", "--no-progress", "--val-fraction", "0.15", "--device", "cpu",
            *extra]


def tree_state(p: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under p ({} when p does not exist)."""
    if not p.exists():
        return {}
    return {str(f.relative_to(p)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(p.rglob("*")) if f.is_file()}


def one_line_error(capsys, rc) -> str:
    """The single stderr line of a refused command (asserts exit status 2 and one line)."""
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "error:" in err, err
    return err
