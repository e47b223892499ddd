"""Shared helpers of the GPU benchmark scripts: environment record, timing, dense baselines, output."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
COMMIT_FILE = Path(__file__).resolve().parent / "COMMIT"
# what a tree digest covers: the code a benchmark runs
DIGEST_DIRS = ("msakit", "benchmarks", "tools")


def tree_digest(root: Path = ROOT, dirs: tuple[str, ...] = DIGEST_DIRS) -> str:
    """sha256 (16 hex digits) over the relative paths and bytes of every .py file under `dirs`:
    names the code that ran when the commit cannot (a device copy of a working tree)."""
    h = hashlib.sha256()
    for d in dirs:
        for p in sorted((root / d).rglob("*.py")):
            if "__pycache__" in p.parts:
                continue
            h.update(str(p.relative_to(root)).encode() + b"\0")
            h.update(p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def commit_info(commit_file: Path = COMMIT_FILE, override: str | None = None) -> dict:
    """The commit of the code: `override`, else $MSAKIT_COMMIT (the GPU driver passes its own down),
    else the first line of benchmarks/COMMIT, else `git rev-parse HEAD` -- which on a copied
    working tree may name an older HEAD, so that source is marked unreliable.
    Returns {"commit", "commit_source", "commit_reliable"}."""
    if override:
        return {"commit": override.strip(), "commit_source": "argument", "commit_reliable": True}
    if os.environ.get("MSAKIT_COMMIT"):
        return {"commit": os.environ["MSAKIT_COMMIT"], "commit_source": "MSAKIT_COMMIT", "commit_reliable": True}
    if commit_file.is_file():
        text = commit_file.read_text().strip().splitlines()
        if text and text[0].strip():
            return {"commit": text[0].strip(), "commit_source": str(commit_file.name), "commit_reliable": True}
    try:
        head = subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, cwd=ROOT,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:
        head = None
    return {"commit": head, "commit_source": "git rev-parse (may be stale on a copied tree)" if head else None,
            "commit_reliable": False}


def env_info() -> dict:
    """Date, GPU, torch / triton / CUDA versions, the commit (`commit_info`) and the tree digest."""
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
    info.update(commit_info())
    info["tree_digest"] = tree_digest()
    return info


def gpu_tag(info: dict | None = None) -> str:
    """The device name as used in result file names ("NVIDIA_H200"; "cpu" without a GPU)."""
    if info is not None:
        name = info.get("gpu")
    else:
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return (name or "cpu").replace(" ", "_")


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
    """Median milliseconds of fn() with CUDA events.  The first call is timed on the host (a
    second one too when the first exceeds `max_s`: it may hold compilation); when the planned
    calls would exceed `max_s`, fewer repetitions run, and a call longer than `max_s` itself is
    not repeated (its host time is returned: one-time costs are small beside it)."""
    def once() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    first = once()
    if first > max_s:  # the first call may hold compilation / autotuning: time a second one
        first = once()
        if first > max_s:
            return first * 1e3
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
    dense baseline).  q [1,T,Hq,D], k/v [1,T,G,D]; returns a closure that runs it."""
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


def add_run_args(ap: "argparse.ArgumentParser", quick_help: str) -> None:
    """The options every claim script takes: --quick (a smoke run, `quick_help` says which), --tag (a
    suffix of the result names) and --out (where the outputs are also copied; default $OUT)."""
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--tag", default="", help="suffix of the result names")
    ap.add_argument("--out", default=None, help="also copy the outputs here (default $OUT)")


def out_dir(explicit: str | None = None) -> Path | None:
    """Where a script copies what it writes besides benchmarks/results/: --out, else $OUT."""
    d = explicit or os.environ.get("OUT")
    return Path(d) if d else None


def save_json(name: str, payload: dict, out: str | os.PathLike | None = None) -> Path:
    """Writes benchmarks/results/<name> and a copy into `out` (default $OUT) when set."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    text = json.dumps(payload, indent=1, default=str)
    path.write_text(text)
    extra = out_dir(str(out) if out else None)
    if extra is not None:
        extra.mkdir(parents=True, exist_ok=True)
        (extra / name).write_text(text)
    return path


def copy_out(path: Path, out: str | os.PathLike | None = None) -> None:
    """Copies a written file (a plot, a profile table) into `out` (default $OUT) when set."""
    import shutil

    extra = out_dir(str(out) if out else None)
    if extra is not None and Path(path).is_file():
        extra.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, extra / Path(path).name)


def print_rows(rows: list[dict], columns: list[tuple[str, str, str]], lead: tuple[str, ...] = ()) -> None:
    """Prints a table: `columns` are (header, key, format spec) with the header's width; a row
    with "error" prints its `lead` columns and the error instead."""
    print("\n" + " ".join(f"{h:>{max(len(h), 7)}}" for h, _, _ in columns))
    for r in rows:
        if "error" in r:
            print(" ".join(str(r.get(k, "")) for k in lead) + f"  error: {str(r['error'])[:80]}")
            continue
        print(" ".join(f"{'-' if r.get(k) is None else format(r[k], f):>{max(len(h), 7)}}" for h, k, f in columns))


# ---------------------------------------------------------------------------------------------
# kernels by kind (torch.profiler): generate.py's decode step, train_speed.py's training step
# ---------------------------------------------------------------------------------------------

# (kind, regex on the kernel name), first match wins
KERNEL_KINDS: tuple[tuple[str, str], ...] = (
    ("msa_decode", r"_score2?_kernel|_merge[12]_kernel|_attn_kernel|_combine_kernel|msa_decode|decode"),
    ("sampling", r"argmax|multinomial|exponential|distribution|philox|sampl|cumsum.*prob|gumbel"),
    ("routed_experts", r"_gate_up_kernel|_down_kernel"),  # msakit.ops.moe (MoE decode path)
    ("moe_routing", r"sort|radix|topk|top_k|scatter|gather|index|cumsum|scan|histc|bincount|route"),
    ("grouped_gemm", r"grouped|group_gemm|_grouped_mm|GroupProblem"),  # cutlass's GemmUniversal<GroupProblemShape..>
    ("gemm", r"gemm|nvjet|cublas|xmma|cutlass|matmul|wgmma|splitk"),
    ("norm", r"norm|rms"),
    ("rope", r"rope|rotary"),
    ("softmax", r"softmax"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise|triton_poi|silu|swiglu|mul_|add_"),
    ("reduce", r"reduce|triton_red|sum|amax|max"),
    ("copy", r"copy|memcpy|memset|cat|fill|Memcpy|Memset"),
)


def kernel_kind(name: str, kinds: tuple[tuple[str, str], ...] = KERNEL_KINDS, ops: tuple[str, ...] = (),
                op_kinds: tuple[tuple[str, str], ...] = ()) -> str:
    """The kind of a CUDA kernel: the first of `op_kinds` whose regex matches one of `ops` (the
    CPU ops around its launch), else the first of `kinds` matching its name; "other" when none."""
    for kind, pat in op_kinds:
        if any(re.search(pat, o, flags=re.IGNORECASE) for o in ops):
            return kind
    for kind, pat in kinds:
        if re.search(pat, name, flags=re.IGNORECASE):
            return kind
    return "other"


def kernel_table(events: list[tuple], kinds: tuple[tuple[str, str], ...] = KERNEL_KINDS,
                 op_kinds: tuple[tuple[str, str], ...] = ()) -> dict[str, dict]:
    """{kind: {"count", "us"}} over (kernel name, device microseconds[, enclosing CPU ops]) events."""
    out: dict[str, dict] = {}
    for ev in events:
        d = out.setdefault(kernel_kind(ev[0], kinds, ev[2] if len(ev) > 2 else (), op_kinds), {"count": 0, "us": 0.0})
        d["count"] += 1
        d["us"] += ev[1]
    return out


def profiled_kernels(fn, with_ops: bool = False) -> tuple[list[tuple], list[tuple[str, float]]]:
    """(kernel name, device us) of every kernel / memcpy / memset that fn() ran, and the top
    kernel names by total time.  `with_ops`: (kernel name, device us, the names of the CPU ops
    around its launch, innermost first), from the kernels the profiler links to each CPU op."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = list(prof.events())
    device = [e for e in events if "CUDA" in str(getattr(e, "device_type", ""))]
    # the device events are the ground truth (each kernel once, with its device time); a CPU
    # event's `kernels` list only names the ops around a launch (summing it as well counted
    # kernels twice: the profiler can attach one kernel to more than one CPU event)
    ev: list[tuple] = []
    if with_ops:
        launchers: dict[int, list[tuple[str, ...]]] = {}
        on_device = {id(e) for e in device}
        for e in events:
            if id(e) in on_device or not getattr(e, "kernels", None):
                continue
            chain, p = [], e
            while p is not None:
                chain.append(p.name)
                p = p.cpu_parent
            launchers.setdefault(e.id, []).append(tuple(chain))
        for e in device:
            chains = launchers.get(getattr(e, "linked_correlation_id", 0), [()])
            ev.append((e.name, float(e.time_range.elapsed_us()), max(chains, key=len)))  # innermost launch
    else:
        ev = [(e.name, float(e.time_range.elapsed_us())) for e in device]
    tot: dict[str, float] = {}
    for x in ev:
        tot[x[0]] = tot.get(x[0], 0.0) + x[1]
    top = sorted(tot.items(), key=lambda x: -x[1])[:25]
    return ev, top
