"""This tree against an earlier one, on the same GPU in one device call.

    python benchmarks/versus.py CLAIM [CLAIM ...] --baseline-tree .baseline [--out $OUT]
                                [--h200-reference CLAIM=FILE ...] [--budget-s 560] [--tol 0.03]

Each claim (RUNS) is one benchmark script with fixed arguments, run the same way in the baseline
tree (a copy of an earlier commit's msakit/, benchmarks/ and tools/, e.g. `git archive <commit>
msakit benchmarks tools | tar -x -C .baseline`) and in this tree, alternating per claim so that
both see the card in the same state; the headline numbers (gpu.py's BASELINES paths) are compared
with a `--tol` band.  On an H200 with every claim given a committed H200 result
(`--h200-reference CLAIM=FILE`, under benchmarks/results/), the baseline runs are skipped and this
tree is compared with those files.  Writes $OUT/versus.json (the comparison, GPU, versions,
commits), $OUT/versus_log.txt and each run's JSON as $OUT/<claim>_{old,new}.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import env_info  # noqa: E402
from benchmarks.gpu import BASELINES, pick, verdict  # noqa: E402

# claim -> (script under benchmarks/, arguments, time limit in seconds)
RUNS: dict[str, tuple[str, tuple[str, ...], float]] = {
    "prefill": ("prefill.py", ("--kinds", "random", "trained-like", "--train-T", "131072"), 190.0),
    "decode": ("decode.py", ("--N", "1048576", "--read-flush"), 90.0),
    "generate_compile": ("generate.py", ("--compile", "--contexts", "32768"), 150.0),
    "spec": ("spec.py", ("--quick",), 170.0),
}


def run_one(tree: Path, claim: str, out: Path, limit: float, log) -> dict | None:
    script, args, _ = RUNS[claim]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(tree / "benchmarks" / script), *args, "--out", tmp, "--tag", "_versus"]
        env = dict(os.environ, PYTHONPATH=str(tree), OUT=tmp)
        t0 = time.time()
        try:
            p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=limit)
            status = f"rc {p.returncode}"
            text = p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            status, text = "timeout", (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else ""
        log.write(f"\n######## {claim} in {tree} ({status}, {time.time() - t0:.0f} s): {' '.join(cmd)}\n{text}\n")
        log.flush()
        found = sorted(Path(tmp).glob("*_versus*.json"))
        if not found:
            return None
        data = json.loads(found[0].read_text())
        (out).write_text(json.dumps(data, indent=1))
        return data


def rows_for(claim: str, old: dict | None, new: dict | None, tol: float) -> list[dict]:
    rows = []
    for spec in BASELINES:
        if spec[0] != claim:
            continue
        label, old_path, new_path, higher = spec[1], spec[3], spec[4], spec[5]
        path = new_path if new_path is not None else old_path
        scale = spec[6] if len(spec) > 6 else 1.0
        a, b = pick(old, path), pick(new, path)
        a = a * scale if isinstance(a, (int, float)) else None
        b = b * scale if isinstance(b, (int, float)) else None
        if a is None and b is None:
            continue
        ratio, v = verdict(a, b, higher, tol)
        rows.append({"claim": claim, "metric": label, "old": a, "new": b, "ratio": ratio, "verdict": v})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("claims", nargs="+", choices=sorted(RUNS))
    ap.add_argument("--baseline-tree", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "versus_out")))
    ap.add_argument("--budget-s", type=float, default=560.0)
    ap.add_argument("--tol", type=float, default=0.03)
    ap.add_argument("--h200-reference", action="append", default=[], metavar="CLAIM=FILE")
    args = ap.parse_args(argv)
    if not (args.baseline_tree / "benchmarks").is_dir():
        ap.error(f"--baseline-tree {args.baseline_tree} holds no benchmarks/")
    t0 = time.time()
    env = env_info()
    refs = dict(r.split("=", 1) for r in args.h200_reference)
    committed = "H200" in str(env.get("gpu")) and all(c in refs for c in args.claims)
    args.out.mkdir(parents=True, exist_ok=True)
    base_commit = (args.baseline_tree / "benchmarks" / "COMMIT")
    summary = {"env": env, "baseline_commit": base_commit.read_text().strip() if base_commit.is_file() else None,
               "reference": "committed H200 results" if committed else "baseline tree, same run", "rows": [],
               "tol": args.tol}
    with open(args.out / "versus_log.txt", "w") as log:
        for claim in args.claims:
            limit = RUNS[claim][2]
            if time.time() - t0 + limit * (1 if committed else 2) > args.budget_s:
                summary["rows"].append({"claim": claim, "verdict": "skipped (budget)"})
                continue
            if committed:
                old = json.loads((ROOT / "benchmarks" / "results" / refs[claim]).read_text())
            else:
                old = run_one(args.baseline_tree.resolve(), claim, args.out / f"{claim}_old.json", limit, log)
            new = run_one(ROOT, claim, args.out / f"{claim}_new.json", limit, log)
            summary["rows"] += rows_for(claim, old, new, args.tol)
    (args.out / "versus.json").write_text(json.dumps(summary, indent=1, default=str))
    print(f"{'claim':16s} {'metric':42s} {'old':>11s} {'new':>11s} {'ratio':>7s}  verdict")
    for r in summary["rows"]:
        f = lambda x: "-" if x is None else f"{x:.4g}"  # noqa: E731
        print(f"{r['claim']:16s} {r.get('metric', ''):42s} {f(r.get('old')):>11s} {f(r.get('new')):>11s} "
              f"{f(r.get('ratio')):>7s}  {r['verdict']}")
    print(f"[versus] {env.get('gpu')}; reference: {summary['reference']}; {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
