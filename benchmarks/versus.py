"""This tree against an earlier one, on the same GPU in one device call.

    python benchmarks/versus.py CLAIM [CLAIM ...] --baseline-tree .baseline --out $OUT [--quick]
                                [--h200-reference CLAIM=FILE ...] [--budget-s 560]

Runs `benchmarks/gpu.py CLAIMS` on the baseline tree (a copy of an earlier commit's msakit/ and
benchmarks/, e.g. `git archive <commit> msakit benchmarks tools | tar -x -C .baseline`), then on
this tree with each claim compared against the baseline run's JSON (`gpu.py --baseline`), so both
numbers come from the same card.  On an H200 with every claim given a committed reference
(`--h200-reference`, files under benchmarks/results/ measured on an H200), the baseline run is
skipped and this tree is compared with those files instead.  The budget is split between the two
runs.  What comes back: $OUT/new (this tree's bundle, its gpu_summary.json holding the comparison)
and the baseline's result JSONs and log in $OUT/old.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def gpu_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - only the name is wanted
        return "unknown"


def run_driver(tree: Path, claims: list[str], out: Path, *, quick: bool, budget: float, tag: str,
               baselines: list[str]) -> int:
    cmd = [sys.executable, str(tree / "benchmarks" / "gpu.py"), *claims, "--out", str(out), "--tag", tag,
           "--budget-s", f"{budget:.0f}"]
    if quick:
        cmd.append("--quick")
    for b in baselines:
        cmd += ["--baseline", b]
    env = dict(os.environ, PYTHONPATH=str(tree))
    print(f"[versus] {' '.join(cmd)}", flush=True)
    return subprocess.run(cmd, cwd=tree, env=env).returncode


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("claims", nargs="+")
    ap.add_argument("--baseline-tree", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "versus_out")))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--budget-s", type=float, default=560.0)
    ap.add_argument("--tag", default="_versus")
    ap.add_argument("--h200-reference", action="append", default=[], metavar="CLAIM=FILE")
    args = ap.parse_args(argv)
    if not (args.baseline_tree / "benchmarks" / "gpu.py").is_file():
        ap.error(f"--baseline-tree {args.baseline_tree} holds no benchmarks/gpu.py")
    t0 = time.time()
    name = gpu_name()
    refs = dict(r.split("=", 1) for r in args.h200_reference)
    out_new, out_old = args.out / "new", args.out / "old"
    if "H200" in name and all(c in refs for c in args.claims):
        print(f"[versus] {name}: comparing with the committed H200 results {refs}", flush=True)
        baselines = [f"{c}={(ROOT / 'benchmarks' / 'results' / f).resolve()}" for c, f in refs.items()]
        return run_driver(ROOT, args.claims, out_new, quick=args.quick, budget=args.budget_s, tag=args.tag,
                          baselines=baselines)
    print(f"[versus] {name}: baseline tree first, then this tree", flush=True)
    work = Path("/tmp/versus_old")
    shutil.rmtree(work, ignore_errors=True)
    run_driver(args.baseline_tree.resolve(), args.claims, work, quick=args.quick, budget=args.budget_s / 2,
               tag=args.tag + "_old", baselines=[])
    out_old.mkdir(parents=True, exist_ok=True)
    summary = json.loads((work / "gpu_summary.json").read_text()) if (work / "gpu_summary.json").is_file() else {}
    baselines = []
    for c, info in summary.get("claims", {}).items():
        j = info.get("json")
        if j and (work / j).is_file():
            shutil.copy(work / j, out_old / j)
            baselines.append(f"{c}={(out_old / j).resolve()}")
    if (work / "gpu_log.txt").is_file():
        shutil.copy(work / "gpu_log.txt", out_old / "gpu_log.txt")
    left = args.budget_s - (time.time() - t0)
    return run_driver(ROOT, args.claims, out_new, quick=args.quick, budget=max(60.0, left - 10), tag=args.tag,
                      baselines=baselines)


if __name__ == "__main__":
    sys.exit(main())
