"""Puts the repository root on sys.path: some kernel tests use the tools/ helpers (tools.bench)."""

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tolerances.py
