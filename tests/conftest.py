"""Shared pytest fixtures; puts tests/ on sys.path so that every layer's tests import the shared
helpers (`naive`, `toy_model`).  Without CUDA, TRITON_INTERPRET=1 is set before any test module
imports triton (the kernels are decorated for the interpreter at import): the kernel tests run
on the CPU.  With CUDA nothing is set: the CUDA tests run the compiled kernels and the
interpreter-only ones skip (a module that set the variable at its own import would switch the
library's interpreter paths on for every later test while the kernels stay compiled)."""

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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
