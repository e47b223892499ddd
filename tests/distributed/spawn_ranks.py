"""Run checks on N CPU processes joined by a gloo process group, from the tests.

Starting ranks is the slow part on a small CPU (each imports torch), so every check of the
folder that needs W ranks runs in ONE spawn of W processes: test modules register their checks
with `@rank_check(worlds=...)`, and the first test that asks for a result (`check_result`) runs
all of them, world sizes in `WORLD_ORDER` (4 before 2: the resume checks read what the 4-rank
checks saved).  Each check's outcome (ok or the traceback, per rank) comes back as JSON.

Every collective has the process group's timeout (`COLLECTIVE_TIMEOUT_S`) and each spawn a
wall-clock limit: a hang becomes a test failure, not a stuck CI job.
"""

from __future__ import annotations

import datetime
import importlib
import json
import atexit
import os
import shutil
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 60
SPAWN_TIMEOUT_S = 240
WORLD_ORDER = (4, 2)

_CHECKS: dict[str, tuple[str, str, tuple[int, ...]]] = {}  # name -> (module, function, worlds)
_RESULTS: dict[int, dict[str, list[str | None]]] = {}
SHARED = Path(tempfile.mkdtemp(prefix="msakit-dist-"))  # what checks of different spawns share
atexit.register(shutil.rmtree, SHARED, True)


def rank_check(worlds: tuple[int, ...]) -> Callable:
    """Register fn(rank, world, shared_dir) to run on each world size in `worlds`."""
    def deco(fn: Callable) -> Callable:
        _CHECKS[fn.__name__] = (fn.__module__, fn.__name__, tuple(worlds))
        return fn
    return deco


def init_group(rank: int, world: int, init_file: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def _entry(rank: int, world: int, init_file: str, checks: list, shared: str, out: str) -> None:
    init_group(rank, world, init_file)
    res: dict[str, str | None] = {}
    try:
        for name, mod, fn in checks:
            try:
                getattr(importlib.import_module(mod), fn)(rank, world, Path(shared))
                res[name] = None
            except Exception:  # noqa: BLE001 - reported to the test that owns the check
                res[name] = traceback.format_exc()
            dist.barrier()
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(res))
        dist.destroy_process_group()


def run_ranks(world: int, checks: list[tuple[str, str, str]], shared: Path, timeout_s: float = SPAWN_TIMEOUT_S
              ) -> dict[str, list[str | None]]:
    """Run `checks` [(name, module, function)] on `world` ranks; {name: [traceback or None per rank]}."""
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_entry, args=(world, os.path.join(tmp, "pg"), checks, str(shared), tmp),
                                 nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        timed_out = False
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    timed_out = True
                    break
        except mp.ProcessRaisedException:
            pass
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
        out: dict[str, list[str | None]] = {name: [] for name, _, _ in checks}
        for r in range(world):
            f = Path(tmp, f"rank{r}.json")
            got = json.loads(f.read_text()) if f.is_file() else {}
            for name, _, _ in checks:
                why = "timed out" if timed_out else "rank exited before reporting"
                out[name].append(got.get(name, f"rank {r}: no result ({why})"))
        return out


def check_result(name: str, world: int) -> None:
    """Fail (with the ranks' tracebacks) unless check `name` passed on every one of `world` ranks."""
    if not _RESULTS:
        for w in WORLD_ORDER:
            todo = [(n, m, f) for n, (m, f, ws) in _CHECKS.items() if w in ws]
            _RESULTS[w] = run_ranks(w, todo, SHARED) if todo else {}
    res = _RESULTS.get(world, {}).get(name)
    if res is None:
        raise AssertionError(f"check {name} did not run on {world} ranks")
    bad = [f"rank {r}:\n{tb}" for r, tb in enumerate(res) if tb is not None]
    assert not bad, "\n".join(bad)


def assert_grads_close(model: torch.nn.Module, g_ref: dict[str, torch.Tensor], tokens: int, tag: str) -> None:
    """Every gradient of `model` (DTensors made whole) equals the single-process one `g_ref` by name.

    Both are sums over `tokens` tokens (and ranks) taken in different orders: the tolerance is
    float32 eps x sqrt(reduction length), relative to the largest gradient entry."""
    from torch.distributed.tensor import DTensor

    eps = torch.finfo(torch.float32).eps
    for n, p in model.named_parameters():
        if n not in g_ref:
            continue
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        scale = float(g_ref[n].abs().max()) + 1e-12
        torch.testing.assert_close(g, g_ref[n], rtol=1e-4, atol=50 * eps * tokens ** 0.5 * scale,
                                   msg=lambda m: f"grad {n} ({tag}): {m}")


def close_scalar(a: float, b: float, what: str, rel: float = 2e-6) -> None:
    """float32 scalars (losses) equal within `rel` of their size."""
    assert abs(a - b) <= rel * max(1.0, abs(b)), f"{what}: {a} vs {b}"

