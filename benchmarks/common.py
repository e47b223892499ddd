"""Shared helpers of the GPU benchmark scripts: environment record, timing, dense baselines."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def env_info() -> dict:
    info = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:
        info["triton"] = None
    try:
        info["commit"] = subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
        dirty = subprocess.check_output(["git", "status", "--porcelain", "--untracked-files=no"], text=True).strip()
        info["dirty"] = bool(dirty)
    except Exception:
        info["commit"] = os.environ.get("MSAKIT_COMMIT")
    return info


def wall_s(fn, reps: int = 3) -> float:
    """Median host wall-clock seconds of fn() between two device syncs (whole generate loops,
    training steps: host work included, unlike bench_ms's events)."""
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2]


def bench_ms(fn, *, warmup: int = 2, rep: int = 10, max_s: float = 20.0) -> float:
    """Median milliseconds of fn() with CUDA events; fewer repetitions when one call is slow."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    if first * (warmup + rep) > max_s:
        rep = max(1, int(max_s / max(first, 1e-6)) - 1)
        warmup = 0 if rep <= 2 else 1
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rep):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def dense_cudnn(q, k, v, *, backward: bool = False):
    """Causal attention through SDPA's cuDNN backend, K/V expanded to all query heads (the
    baseline layout of ../shared/baselines).  q [1,T,Hq,D], k/v [1,T,G,D]."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    Hq, G = q.shape[2], k.shape[2]
    qh = q.transpose(1, 2)
    kh = k.transpose(1, 2).repeat_interleave(Hq // G, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(Hq // G, dim=1)
    if backward:
        qh, kh, vh = (t.detach().requires_grad_(True) for t in (qh, kh, vh))

    def run():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            o = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
        if backward:
            o.backward(torch.ones_like(o))
        return o

    return run


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def save_json(name: str, payload: dict, out_dir: str | None = None) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    text = json.dumps(payload, indent=1, default=str)
    path.write_text(text)
    if out_dir or os.environ.get("OUT"):
        Path(out_dir or os.environ["OUT"], name).write_text(text)
    return path
