"""Shared pytest fixtures; puts tests/ on sys.path so that every layer's tests import the shared
helpers (`naive`, `toy_model`)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="module")
def one_thread():
    """Toy-sized ops on a loaded 2-core machine run far slower (up to ~1000x) with 2 intra-op
    threads (spin / yield contention): one thread for the module, restored afterwards.  Use with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
