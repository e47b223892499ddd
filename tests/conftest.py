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

# Under pytest-xdist (`make test` runs `-n 2`) each worker has one of the machine's cores: its
# torch runs one intra-op thread (two workers with two threads each on two cores contend, see
# `one_thread`), and so do the processes its tests start, unless told otherwise.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook (called only when xdist runs the tests)
def pytest_xdist_make_scheduler(config, log):
    """`-n N` (xdist's default --dist load): tests go to the workers one by one as they free up,
    except tests/distributed, which runs whole in one worker: its rank checks all run in the first
    spawn one of its tests asks for (spawn_ranks.py; a second worker would spawn them all again)
    and its torchrun launches take torchrun's default port.  (xdist's own way to say this,
    `--dist loadgroup` with `xdist_group` marks, does not group under pytest 9.2: xdist 3.8 renames
    `item._nodeid`, which pytest 9.2 no longer reads.)"""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    whole = Path(__file__).resolve().parent.joinpath("distributed").relative_to(config.rootpath).as_posix() + "/"

    class OneByOneButDistributed(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return whole if nodeid.startswith(whole) else nodeid

    return OneByOneButDistributed(config, log)


@pytest.fixture(scope="module")
def one_thread():
    """Toy-sized ops on a loaded 2-core machine run far slower (up to ~1000x) with 2 intra-op
    threads (spin / yield contention): one thread for the module, restored afterwards.  Use with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
