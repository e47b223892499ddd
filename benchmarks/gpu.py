"""The GPU driver: runs a named set of benchmark claims in one device call and bundles the results.

    python benchmarks/gpu.py prefill decode generate spec --out $OUT [--quick] [--tag _run18]
                             [--budget-s 540] [--gpus N] [--commit SHA]
    python benchmarks/gpu.py --list            # the claims, their commands and time budgets
    python benchmarks/gpu.py --digest          # the tree digest of this checkout (compare with a run's)

Each claim (CLAIMS) runs as a subprocess with its own time limit (its budget, cut to what the
total --budget-s leaves), on one GPU; with several GPUs visible (--gpus, default all) the claims
are spread over them, longest expected first, one queue per GPU.  Each claim writes its JSON
(GPU name, torch / triton / CUDA versions, the commit, the tree digest: benchmarks/common.py)
into its own folder; the driver then prints each headline number beside the reference run's
(BASELINES: runs 11-12 and 17 in benchmarks/results/) with the ratio and a verdict (within 5%
counts as holding), and bundles for the device machine's return limits (at most 8 files of at
most 16 MiB, two folders deep): gpu_summary.json (the table, every claim's status and the
environment), gpu_log.txt (all claims' output), one JSON per claim, and gpu_extras.tgz (plots,
profiles, other JSONs).

The commit: --commit, else $MSAKIT_COMMIT, else the file benchmarks/COMMIT (write it with
`git rev-parse HEAD > benchmarks/COMMIT` before sending the tree), else `git rev-parse HEAD`,
which on the device's copy of a working tree can name a stale HEAD: the driver warns then.  The
tree digest (sha256 of the .py files of msakit/, benchmarks/, tools/) names the code either way.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
from benchmarks.common import RESULTS, commit_info, env_info, tree_digest  # noqa: E402

MAX_FILES = 8
MAX_BYTES = 16 * 2**20
TOLERANCE = 0.05  # "within 5%" of the reference run
RESERVE_S = 15.0  # kept for collecting, bundling and printing


@dataclass(frozen=True)
class Claim:
    script: str  # under benchmarks/
    args: tuple[str, ...] = ()
    quick_args: tuple[str, ...] = ("--quick",)
    budget_s: float = 300.0  # time limit of the full run
    quick_budget_s: float = 120.0
    expect_s: float = 120.0  # expected time of the full run (scheduling)
    quick_expect_s: float = 45.0
    prefix: str = ""  # the result JSON's name starts with this (default: the script's stem)
    note: str = ""
    tag: bool = True  # the script takes --tag
    tag_suffix: str = ""  # added to --tag: claims sharing a script name their JSONs apart

    def json_prefix(self) -> str:
        return self.prefix or Path(self.script).stem


CLAIMS: dict[str, Claim] = {
    # forward 16K / 128K / 1M (bf16 and fp8 scoring) and training step 16K / 128K, random, trained-like and real-like
    # selections
    "prefill": Claim("prefill.py", budget_s=330, quick_budget_s=120, expect_s=180, quick_expect_s=60),
    # msa_decode at 16K / 128K / 1M, B 1 and 8, bf16 and fp8 index keys (+ read-flush timings at B 1)
    "decode": Claim("decode.py", ("--read-flush",), budget_s=180, quick_budget_s=75, expect_s=80, quick_expect_s=30),
    # model.generate of the small preset, B 1, contexts 1K / 32K / 128K
    "generate": Claim("generate.py", budget_s=150, quick_budget_s=75, expect_s=60, quick_expect_s=30),
    # the kernels of one decode step by kind, tokens/s at 4K / 32K / 128K
    "generate_profile": Claim("generate.py", ("--profile",), ("--profile", "--quick"), budget_s=180,
                              quick_budget_s=90, expect_s=90, prefix="generate", tag_suffix="_profile",
                              note="writes generate_<gpu><tag>_profile.json"),
    # the graphed step uncompiled vs under torch.compile: ms/token, tok/s, kernels per step at 4K / 32K / 128K
    "generate_compile": Claim("generate.py", ("--compile",), ("--compile", "--quick"), budget_s=300,
                              quick_budget_s=150, expect_s=180, quick_expect_s=90, prefix="generate",
                              tag_suffix="_compile", note="writes generate_<gpu><tag>_compile.json"),
    # speculative decoding: run 17's training step for step, speed table at B 1 (T 0 and 1)
    "spec": Claim("spec.py", ("--recipe", "run17", "--speed-batches", "1"), budget_s=330, quick_budget_s=150,
                  expect_s=240, quick_expect_s=80),
    "train_speed": Claim("train_speed.py", budget_s=180, quick_budget_s=90, expect_s=90),
    # the kernels of one training step by kind (small preset, 8K / 32K, MSA and dense cuDNN), eager
    "train_profile": Claim("train_speed.py", ("--profile",), ("--profile", "--quick"), budget_s=150,
                           quick_budget_s=90, expect_s=100, quick_expect_s=45, tag_suffix="_profile",
                           note="writes train_speed_<gpu><tag>_profile.json"),
    # eager vs torch.compile'd decoder layers (msakit train --compile): tok/s, MFU, kernels by kind
    "train_compile": Claim("train_speed.py", ("--compile", "--profile"), ("--compile", "--quick"), budget_s=480,
                           quick_budget_s=240, expect_s=300, quick_expect_s=120, tag_suffix="_compile",
                           note="writes train_speed_<gpu><tag>_compile.json"),
    # graph == eager, paged == contiguous, speculative == plain, graphs reused across calls
    "forward_check": Claim("forward_check.py", (), (), budget_s=180, quick_budget_s=180, expect_s=60, tag=False,
                           note="writes forward_check_<gpu>.json (no tag)"),
    # issue 18: the distributed code paths at world size 1 against the plain ones
    "cp_overhead": Claim("distributed.py", ("cp-overhead",), ("cp-overhead", "--steps", "2"), budget_s=180,
                         quick_budget_s=90, expect_s=60, prefix="distributed"),
    "fsdp_overhead": Claim("distributed.py", ("fsdp-overhead",), ("fsdp-overhead", "--steps", "2"), budget_s=180,
                           quick_budget_s=90, expect_s=60, prefix="distributed"),
    "qat": Claim("qat.py", ("--budget-s", "270"), ("--budget-s", "60", "--no-kernels"), budget_s=330,
                 quick_budget_s=120, expect_s=300),
    "quality": Claim("quality.py", ("--runs", "dense,msa", "--budget-s", "420", "--device", "cuda"),
                     ("--runs", "msa", "--budget-s", "100", "--device", "cuda"), budget_s=480, quick_budget_s=150,
                     expect_s=450, tag=False),
}

# Reference numbers: (claim, label, old file under benchmarks/results, path in the old JSON,
# path in the new JSON, higher is better).  A path walks dict keys; a dict element picks the
# first list item whose fields match (an old row without "kind" is a "random" one).
Path_ = tuple[Any, ...]
R12P, R12D, R17 = "prefill_NVIDIA_H200_run12.json", "decode_NVIDIA_H200_run12.json", "spec_NVIDIA_H200_run17.json"
R11G, R11C = "decode_NVIDIA_H200_run11gen.json", "generate_graph_check_NVIDIA_H200_run11.json"
R19T = "train_speed_NVIDIA_H200_run19.json"
ROW_DEFAULTS = {"kind": "random", "score": "bf16"}


def _ctx(T: int) -> str:
    return f"{T >> 20}M" if T >= 1 << 20 and T % (1 << 20) == 0 else f"{T >> 10}K"


def _prefill_baselines() -> list[tuple]:
    out = []
    for T in (16384, 131072, 1048576):
        sel = {"T": T, "kind": "random", "score": "bf16"}
        out += [("prefill", f"fwd {_ctx(T)} msa ms", R12P, ("forward", sel, "msa_fwd_ms"), None, False),
                ("prefill", f"fwd {_ctx(T)} speedup vs cuDNN", R12P, ("forward", sel, "speedup_fwd"), None, True),
                ("prefill", f"fwd {_ctx(T)} sparse attn TFLOP/s", R12P, ("forward", sel, "sparse_attn_tflops"),
                 None, True),
                ("prefill", f"fwd {_ctx(T)} trained-like msa ms", None, None,
                 ("forward", {"T": T, "kind": "trained-like"}, "msa_fwd_ms"), False),
                ("prefill", f"fwd {_ctx(T)} trained-like attn TFLOP/s", None, None,
                 ("forward", {"T": T, "kind": "trained-like"}, "sparse_attn_tflops"), True),
                ("prefill", f"fwd {_ctx(T)} real-like msa ms", None, None,
                 ("forward", {"T": T, "kind": "real-like"}, "msa_fwd_ms"), False),
                ("prefill", f"fwd {_ctx(T)} real-like attn TFLOP/s", None, None,
                 ("forward", {"T": T, "kind": "real-like"}, "sparse_attn_tflops"), True),
                ("prefill", f"fwd {_ctx(T)} fp8 scoring speedup", None, None,
                 ("forward", {"T": T, "score": "fp8"}, "speedup_fwd"), True),
                ("prefill", f"fwd {_ctx(T)} fp8 recall vs bf16", None, None,
                 ("forward", {"T": T, "score": "fp8"}, "recall_vs_bf16"), True)]
    for T in (16384, 131072):
        sel = {"T": T, "kind": "random"}
        out += [("prefill", f"train {_ctx(T)} msa ms", R12P, ("train", sel, "msa_train_ms"), None, False),
                ("prefill", f"train {_ctx(T)} speedup vs cuDNN", R12P, ("train", sel, "speedup_train"), None, True),
                ("prefill", f"train {_ctx(T)} trained-like speedup", None, None,
                 ("train", {"T": T, "kind": "trained-like"}, "speedup_train"), True),
                ("prefill", f"train {_ctx(T)} real-like speedup", None, None,
                 ("train", {"T": T, "kind": "real-like"}, "speedup_train"), True)]
    return out


def _decode_baselines() -> list[tuple]:
    out = []
    for B in (1, 8):
        for idx in ("bf16", "fp8"):
            sel = {"B": B, "N": 1048576, "idx": idx}
            out += [("decode", f"1M B{B} {idx} msa us", R12D, ("rows", sel, "msa_ms"), None, False, 1e3),
                    ("decode", f"1M B{B} {idx} speedup vs dense", R12D, ("rows", sel, "speedup"), None, True)]
    return out


BASELINES: list[tuple] = [
    *_prefill_baselines(),
    *_decode_baselines(),
    ("generate", "ctx 1K tok/s (steady)", R11C, ("rows", {"context": 1024}, "graph", "tok_per_s_steady"),
     ("rows", {"context": 1024}, "tok_s"), True),
    ("generate", "ctx 32K tok/s (steady)", R11C, ("rows", {"context": 32768}, "graph", "tok_per_s_steady"),
     ("rows", {"context": 32768}, "tok_s"), True),
    ("generate", "ctx 32K tok/s (per call)", R11G, ("generate", {"context": 32768}, "paged_tok_s"),
     ("rows", {"context": 32768}, "tok_s_per_call"), True),
    ("generate", "ctx 128K tok/s (per call)", R11G, ("generate", {"context": 131072}, "paged_tok_s"),
     ("rows", {"context": 131072}, "tok_s_per_call"), True),
    ("generate", "ctx 128K tok/s (steady)", None, None, ("rows", {"context": 131072}, "tok_s"), True),
    *[("generate_compile", f"ctx {_ctx(T)} {v} {what}", None, None, ("rows", {"context": T}, v, key),
       False) for T in (4096, 32768, 131072) for v in ("eager", "compiled")
      for what, key in (("step ms (replayed)", "step_ms"), ("ms/token", "ms_per_token"))],
    *[("train_speed", f"ctx {_ctx(T)} {m} tok/s", R19T, ("rows", {"context": T, "mode": m}, "tok_s"), None, True)
      for T in (8192, 32768) for m in ("dense", "sparse")],
    *[x for T in (8192, 32768) for m in ("dense", "sparse") for x in (
        ("train_compile", f"ctx {_ctx(T)} {m} compiled tok/s", None, None,
         ("rows", {"context": T, "mode": m, "compiled": True}, "tok_s"), True),
        ("train_compile", f"ctx {_ctx(T)} {m} compiled / eager", None, None,
         ("rows", {"context": T, "mode": m, "compiled": True}, "speedup_vs_eager"), True))],
    *[x for T in (0.0, 1.0) for x in (
        ("spec", f"B1 T{T:g} plain tok/s", R17, ("speed", {"batch": 1, "temperature": T}, "plain_tok_s"), None, True),
        ("spec", f"B1 T{T:g} spec tok/s", R17, ("speed", {"batch": 1, "temperature": T}, "spec_tok_s"), None, True),
        ("spec", f"B1 T{T:g} accepted length", R17, ("speed", {"batch": 1, "temperature": T}, "accepted_length"),
         None, True),
        ("spec", f"B1 T{T:g} speedup (decode rate)", R17,
         ("speed", {"batch": 1, "temperature": T}, "speedup_vs_generate"), None, True),
        ("spec", f"B1 T{T:g} speedup (end to end)", R17,
         ("speed", {"batch": 1, "temperature": T}, "speedup_vs_generate_e2e"), None, True),
        ("spec", f"B1 T{T:g} round ms", R17, ("speed", {"batch": 1, "temperature": T}, "ms_per_spec_round"),
         None, False))],
]


# ---------------------------------------------------------------------------------------------
# comparison
# ---------------------------------------------------------------------------------------------


def pick(obj: Any, path: Path_ | None) -> Any:
    """Walks `path` through nested dicts / lists (a dict element selects the first list item whose
    fields match, ROW_DEFAULTS filling fields an item lacks); None when anything is missing."""
    if path is None:
        return None
    for key in path:
        if isinstance(key, dict):
            if not isinstance(obj, list):
                return None
            obj = next((it for it in obj if isinstance(it, dict)
                        and all(it.get(k, ROW_DEFAULTS.get(k)) == v for k, v in key.items())), None)
        elif isinstance(obj, dict):
            obj = obj.get(key)
        else:
            return None
        if obj is None:
            return None
    return obj


def verdict(old: float | None, new: float | None, higher_better: bool, tol: float = TOLERANCE) -> tuple[float | None, str]:
    """(new / old, "ok" | "better" | "WORSE" | "new" | "missing") with `tol` as the 'within' band."""
    if new is None or not isinstance(new, (int, float)) or new != new:
        return None, "missing"
    if old is None:
        return None, "new"
    ratio = new / old if old else float("inf")
    gain = ratio if higher_better else (1 / ratio if ratio else float("inf"))
    if gain >= 1 + tol:
        return ratio, "better"
    if gain >= 1 - tol:
        return ratio, "ok"
    return ratio, "WORSE"


def compare(results: dict[str, dict], baselines: list[tuple], results_dir: Path = RESULTS,
            overrides: dict[str, str] | None = None) -> list[dict]:
    """The comparison rows of the claims in `results` ({claim: its JSON}) against their old files."""
    cache: dict[str, Any] = {}
    rows = []
    for spec in baselines:
        claim, label, old_file, old_path, new_path, higher = spec[:6]
        scale = spec[6] if len(spec) > 6 else 1.0
        if claim not in results:
            continue
        if overrides and claim in overrides and old_file:
            old_file = overrides[claim]
        old = None
        if old_file:
            if old_file not in cache:
                p = Path(old_file) if Path(old_file).is_absolute() else results_dir / old_file
                cache[old_file] = json.loads(p.read_text()) if p.is_file() else None
            old = pick(cache[old_file], old_path)
        new = pick(results[claim], new_path if new_path is not None else old_path)
        old = old * scale if isinstance(old, (int, float)) else None
        new = new * scale if isinstance(new, (int, float)) else None
        ratio, v = verdict(old, new, higher)
        rows.append({"claim": claim, "metric": label, "old": old, "new": new, "ratio": ratio, "verdict": v,
                     "higher_is_better": higher, "old_file": Path(old_file).name if old_file else None})
    return rows


def result_notes(results: dict[str, dict]) -> list[str]:
    """Lines a reader needs beside the table: how a claim's setup differs from its reference run,
    rows that failed, partial results."""
    out = []
    for name, data in results.items():
        rec = data.get("recipe") if isinstance(data, dict) else None
        if isinstance(rec, dict) and rec.get("differs_from_run17"):
            out.append(f"{name}: recipe {rec.get('name')} -- differs from run 17: {rec['differs_from_run17']}")
        if name == "prefill" and isinstance(data, dict):  # issue 16: trained-like <= 1.15 x random
            for key, field_ in (("forward", "sparse_attn_ms"), ("train", "msa_train_ms")):
                rows_ = [r for r in data.get(key, []) if isinstance(r, dict) and field_ in r]
                for T in sorted({r["T"] for r in rows_}):
                    by = {r.get("kind", "random"): r[field_] for r in rows_ if r["T"] == T}
                    if "random" in by and "trained-like" in by:
                        out.append(f"prefill: {key} T={T}: trained-like / random {field_} = "
                                   f"{by['trained-like'] / by['random']:.3f} (issue 16 bar <= 1.15)")
        if isinstance(data, dict) and data.get("partial"):
            out.append(f"{name}: PARTIAL result (the script did not finish)")
        for key in ("forward", "train", "rows"):
            for r in data.get(key, []) if isinstance(data, dict) and isinstance(data.get(key), list) else []:
                if isinstance(r, dict) and "error" in r:
                    sel = {k: r[k] for k in ("T", "kind", "context", "mode", "B", "N") if k in r}
                    out.append(f"{name}: {key} {sel} failed: {str(r['error'])[:150]}")
    return out


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    a = abs(x)
    return f"{x:.0f}" if a >= 1000 else f"{x:.1f}" if a >= 100 else f"{x:.2f}" if a >= 1 else f"{x:.3g}"


def table_text(rows: list[dict]) -> str:
    lines = [f"{'metric':44s} {'old':>9s} {'new':>9s} {'new/old':>8s}  verdict  (old from)"]
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        lines.append(f"{r['claim'] + ' ' + r['metric']:44s} {_fmt(r['old']):>9s} {_fmt(r['new']):>9s} {ratio:>8s}  "
                     f"{r['verdict']:7s}  {r['old_file'] or ''}")
    worse = [r for r in rows if r["verdict"] == "WORSE"]
    lines.append(f"{len(rows)} numbers, {sum(r['verdict'] in ('ok', 'better') for r in rows)} within "
                 f"{TOLERANCE:.0%} or better, {len(worse)} worse"
                 + (": " + ", ".join(f"{r['claim']} {r['metric']}" for r in worse) if worse else ""))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------------------------


@dataclass
class Job:
    name: str
    claim: Claim
    cmd: list[str]
    limit_s: float
    folder: Path
    gpu: int | None = None
    status: str = "pending"
    seconds: float = 0.0
    rc: int | None = None
    log: Path | None = None
    files: list[Path] = field(default_factory=list)


def claim_command(name: str, claim: Claim, *, quick: bool, tag: str, python: str = sys.executable) -> list[str]:
    """The claim's command line: its script with the full or quick arguments and --tag."""
    args = list(claim.quick_args if quick else claim.args)
    cmd = [python, str(HERE / claim.script), *args]
    if claim.tag:
        cmd += ["--tag", tag + claim.tag_suffix]
    return cmd  # (the scripts copy what they write into $OUT, which run_job sets to the claim's folder)


def schedule(names: list[str], gpus: int, quick: bool) -> list[list[str]]:
    """Claims per GPU queue: longest expected first, each to the least loaded queue."""
    gpus = max(1, gpus)
    queues: list[list[str]] = [[] for _ in range(gpus)]
    load = [0.0] * gpus
    exp = {n: (CLAIMS[n].quick_expect_s if quick else CLAIMS[n].expect_s) for n in names}
    for n in sorted(names, key=lambda n: -exp[n]) if gpus > 1 else names:
        i = min(range(gpus), key=lambda j: load[j])
        queues[i].append(n)
        load[i] += exp[n]
    return queues


def run_job(job: Job, deadline: float, env: dict) -> None:
    job.limit_s = max(1.0, min(job.limit_s, deadline - time.time()))
    job.folder.mkdir(parents=True, exist_ok=True)
    job.log = job.folder / f"{job.name}_log.txt"
    e = dict(env, OUT=str(job.folder), PYTHONUNBUFFERED="1")
    if job.gpu is not None:
        e["CUDA_VISIBLE_DEVICES"] = str(job.gpu)
    t0 = time.time()
    print(f"[gpu.py] start {job.name} (GPU {job.gpu if job.gpu is not None else 'default'}, limit "
          f"{job.limit_s:.0f} s): {' '.join(job.cmd[1:])}", flush=True)
    with open(job.log, "w") as fh:
        proc = subprocess.Popen(job.cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, env=e, start_new_session=True)
        try:
            job.rc = proc.wait(timeout=job.limit_s)
            job.status = "ok" if job.rc == 0 else f"failed (rc {job.rc})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)  # the process group this driver started
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            job.rc, job.status = None, f"timed out after {job.limit_s:.0f} s"
    job.seconds = time.time() - t0
    print(f"[gpu.py] {job.name}: {job.status} in {job.seconds:.0f} s", flush=True)


def run_queues(jobs: list[list[Job]], deadline: float, env: dict) -> None:
    def worker(q: list[Job]) -> None:
        for j in q:
            if time.time() > deadline - 5:
                j.status = "skipped (no time left)"
                continue
            run_job(j, deadline, env)

    threads = [threading.Thread(target=worker, args=(q,)) for q in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main_json(job: Job) -> tuple[Path | None, dict | None]:
    """The claim's result JSON in its folder (the newest whose name starts with the prefix)."""
    cands = sorted(job.folder.glob(f"{job.claim.json_prefix()}_*.json"), key=lambda p: p.stat().st_mtime)
    if not cands:
        return None, None
    try:
        return cands[-1], json.loads(cands[-1].read_text())
    except json.JSONDecodeError:
        return cands[-1], None


# ---------------------------------------------------------------------------------------------
# bundling
# ---------------------------------------------------------------------------------------------


def bundle(out: Path, primary: list[Path], extras: list[Path], *, max_files: int = MAX_FILES,
           max_bytes: int = MAX_BYTES, tar_name: str = "gpu_extras.tgz") -> dict:
    """Copies files into `out` within the return limits: `primary` as plain files, in order, while
    they fit (one slot stays for the archive when anything goes into it); the other primaries and
    `extras` go into one gzipped tar (as '<folder>/<name>'), the largest left out while the archive
    exceeds `max_bytes`.  Returns {"files": names in out, "archived", "left_out"}."""
    out.mkdir(parents=True, exist_ok=True)
    primary = [p for p in primary if p.is_file()]
    extras = [p for p in extras if p.is_file()]
    fits = [p for p in primary if p.stat().st_size <= max_bytes]
    big = [p for p in primary if p.stat().st_size > max_bytes]
    slots = max_files - (1 if (extras or big or len(fits) > max_files) else 0)
    plain, to_tar = fits[:slots], fits[slots:] + big + extras
    written = []
    for p in plain:
        dst = out / p.name
        if p.resolve() != dst.resolve():
            dst.write_bytes(p.read_bytes())
        written.append(dst.name)
    archived, left = [], []
    if to_tar:
        keep = sorted(to_tar, key=lambda p: p.stat().st_size)
        tpath = out / tar_name
        while True:
            with tarfile.open(tpath, "w:gz") as tf:
                for p in keep:
                    tf.add(p, arcname=f"{p.parent.name}/{p.name}")
            if tpath.stat().st_size <= max_bytes or not keep:
                break
            left.append(f"{keep[-1].parent.name}/{keep[-1].name}")
            keep = keep[:-1]
        archived = [f"{p.parent.name}/{p.name}" for p in keep]
        written.append(tar_name)
    return {"files": written, "archived": archived, "left_out": left}


# ---------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("claims", nargs="*", help=f"claims to run, of: {', '.join(CLAIMS)}")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="where the bundle goes (default $OUT)")
    ap.add_argument("--quick", action="store_true", help="smoke run of every claim (prefill decode generate spec: "
                    "~2 min on 2 GPUs, ~3 on one)")
    ap.add_argument("--tag", default="", help="suffix of the result names, e.g. _run18")
    ap.add_argument("--budget-s", type=float, default=540.0, help="wall-clock limit of the whole set")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs to spread the claims over (default: all visible)")
    ap.add_argument("--commit", default=None, help="the commit of the tree (default: benchmarks/COMMIT, ...)")
    ap.add_argument("--baseline", action="append", default=[], metavar="CLAIM=FILE",
                    help="compare a claim against another result file")
    ap.add_argument("--list", action="store_true", help="print the claims and exit")
    ap.add_argument("--digest", action="store_true", help="print the tree digest and exit")
    args = ap.parse_args(argv)
    unknown = [c for c in args.claims if c not in CLAIMS]
    if unknown:
        ap.error(f"unknown claim(s) {unknown}; known: {', '.join(CLAIMS)}")
    if len(set(args.claims)) != len(args.claims):
        ap.error("a claim is named twice")
    if not (args.list or args.digest):
        if not args.claims:
            ap.error("name at least one claim")
        if not args.out:
            ap.error("--out (or $OUT) is required")
    for b in args.baseline:
        if "=" not in b or b.split("=", 1)[0] not in CLAIMS:
            ap.error(f"--baseline takes CLAIM=FILE, got {b!r}")
    return args


def visible_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.digest:
        print(tree_digest())
        return 0
    if args.list:
        for n, c in CLAIMS.items():
            print(f"{n:17s} {c.script:15s} full: {' '.join(c.args) or '(defaults)'} [{c.budget_s:.0f} s]   "
                  f"quick: {' '.join(c.quick_args)} [{c.quick_budget_s:.0f} s]  {c.note}")
        return 0
    t0 = time.time()
    deadline = t0 + args.budget_s - RESERVE_S
    out = Path(args.out)
    work = Path(tempfile.mkdtemp(prefix="msakit_gpu_"))  # the claims' folders; the bundle goes to out
    ci = commit_info(override=args.commit)
    warnings = []
    if not ci["commit_reliable"]:
        warnings.append(f"commit unreliable: {ci['commit']} from {ci['commit_source']}; write `git rev-parse HEAD > "
                        f"benchmarks/COMMIT` (or pass --commit) before sending the tree; the tree digest names the code")
    env = dict(os.environ)
    if ci["commit"] and ci["commit_reliable"]:
        env["MSAKIT_COMMIT"] = ci["commit"]
    digest = tree_digest()
    n_gpu = args.gpus if args.gpus is not None else visible_gpus()
    queues = schedule(args.claims, max(1, n_gpu), args.quick)
    jobs = []
    for gi, q in enumerate(queues):
        jq = []
        for name in q:
            c = CLAIMS[name]
            folder = work / name
            jq.append(Job(name, c, claim_command(name, c, quick=args.quick, tag=args.tag),
                          c.quick_budget_s if args.quick else c.budget_s, folder, gpu=gi if n_gpu > 1 else None))
        jobs.append(jq)
    for w in warnings:
        print(f"[gpu.py] WARNING: {w}", flush=True)
    print(f"[gpu.py] {len(args.claims)} claim(s) on {max(1, n_gpu)} GPU queue(s): "
          + "; ".join(f"GPU {i}: {', '.join(q)}" for i, q in enumerate(queues) if q)
          + f"; budget {args.budget_s:.0f} s; tree digest {digest}", flush=True)
    run_queues(jobs, deadline, env)

    flat = [j for q in jobs for j in q]
    results, primary, extras = {}, [], []
    log_path = work / "gpu_log.txt"
    with open(log_path, "w") as fh:
        for j in flat:
            fh.write(f"\n######## {j.name}: {j.status}, {j.seconds:.0f} s, GPU {j.gpu}: {' '.join(j.cmd)}\n")
            if j.log and j.log.is_file():
                fh.write(j.log.read_text(errors="replace"))
    envs = {}
    for j in flat:
        path, data = main_json(j)
        if data is not None:
            results[j.name] = data
            envs[j.name] = data.get("env", {})
        if path is not None:
            primary.append(path)
        if j.folder.is_dir():
            extras += [p for p in sorted(j.folder.iterdir()) if p.is_file() and p != path and p != j.log]
    overrides = dict(b.split("=", 1) for b in args.baseline)
    rows = compare(results, BASELINES, overrides=overrides)
    env0 = next(iter(envs.values()), None)
    if not env0:  # no claim wrote its environment: the driver's own (after the claims: CUDA is free)
        try:
            env0 = env_info()
        except Exception:
            env0 = {}
    for name, e in envs.items():
        if e.get("tree_digest") and e["tree_digest"] != digest:
            warnings.append(f"{name}: tree digest {e['tree_digest']} differs from the driver's {digest}")
    summary = {
        "claims": {j.name: {"status": j.status, "seconds": round(j.seconds, 1), "gpu": j.gpu, "command": j.cmd[1:],
                            "json": (main_json(j)[0].name if main_json(j)[0] else None)} for j in flat},
        "env": {k: env0.get(k) for k in ("gpu", "torch", "triton", "cuda")} | ci | {"tree_digest": digest},
        "quick": args.quick, "tag": args.tag, "budget_s": args.budget_s, "wall_s": round(time.time() - t0, 1),
        "comparison": rows, "warnings": warnings,
    }
    sum_path = work / "gpu_summary.json"
    sum_path.write_text(json.dumps(summary, indent=1, default=str))
    manifest = bundle(out, [sum_path, log_path, *primary], extras)
    summary["bundle"] = manifest
    sum_path.write_text(json.dumps(summary, indent=1, default=str))
    (out / "gpu_summary.json").write_text(sum_path.read_text())

    print(f"\n== gpu.py: {len(flat)} claim(s), {summary['wall_s']:.0f} s; {env0.get('gpu')}, torch {env0.get('torch')}, "
          f"triton {env0.get('triton')}, CUDA {env0.get('cuda')}; commit {ci['commit']} ({ci['commit_source']}); "
          f"tree digest {digest}")
    for j in flat:
        print(f"  {j.name:17s} {j.status:28s} {j.seconds:6.0f} s  {summary['claims'][j.name]['json'] or '-'}")
    for j in flat:  # the end of a failed claim's output (the whole of it is in gpu_log.txt)
        if j.status != "ok" and j.log and j.log.is_file():
            tail = j.log.read_text(errors="replace").strip().splitlines()[-4:]
            print(f"  -- {j.name}: " + "\n     ".join(t[:200] for t in tail))
    if rows:
        print(table_text(rows))
    for line in result_notes(results):
        print(line)
    if args.quick:
        print("(--quick: smoke sizes and training; ratios against the reference runs are not the claim)")
    for w in warnings:
        print(f"WARNING: {w}")
    print(f"bundle in {out}: {', '.join(manifest['files'])}"
          + (f"; left out: {', '.join(manifest['left_out'])}" if manifest["left_out"] else ""))
    return 0 if all(j.status == "ok" for j in flat) else 1


if __name__ == "__main__":
    sys.exit(main())
