"""Puts tests/distributed on sys.path so that the tests and their spawned ranks import `spawn_ranks`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
