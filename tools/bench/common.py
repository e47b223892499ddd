"""Helpers shared by the kernels' GPU checks and benchmarks (`tools/bench/<op>.py`)."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| over the finite entries of b (float64)."""
    a, b = a.double(), b.double()
    fin = torch.isfinite(b)
    a, b = torch.where(fin, a, 0.0), torch.where(fin, b, 0.0)
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def time_ms(fn: Callable[[], Any], *, grad_to_none=None, long_ms: float = 200.0, rep: int = 200) -> float:
    """Median milliseconds of fn() after a warm-up call: triton.testing.do_bench for calls
    shorter than long_ms, else the median of 3 timed runs (CUDA events)."""
    import triton.testing

    fn()  # compile / warm up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once = (time.perf_counter() - t0) * 1e3
    if once < long_ms:
        return float(triton.testing.do_bench(fn, warmup=25, rep=rep, grad_to_none=grad_to_none, return_mode="median"))
    times = []
    for _ in range(3):
        for t in grad_to_none or ():
            t.grad = None
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return float(sorted(times)[1])


def peak_extra(fn: Callable[[], Any]) -> tuple[int, Any]:
    """(peak bytes allocated during fn() beyond what was allocated before, fn's result)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated() - base), out
