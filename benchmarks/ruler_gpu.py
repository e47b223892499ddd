"""RULER's tasks on one GPU in parallel processes, then one merged report (docs/convert.md).

RULER's scoring runs greedy generation one sample at a time (batch 1, transformers' cache, a host
sync per token), which leaves a GPU mostly idle with a 0.5B model: one `msakit eval` process
reaches a few samples per second at best.  This script runs `--workers` `msakit eval` processes
side by side, each on its own share of the tasks (the tasks dealt round-robin in order of their
expected cost), every one into its own folder under OUT/shards/ (resumable), with a shared
deadline: at `--time-limit` seconds the workers still running are stopped (each result line is
written whole, and the runner takes the sample index outermost, so a cut run leaves every cell
with about the same number of samples; the next call with the same OUT resumes them).  The
shards' records are then merged into OUT/merged/ (results.jsonl, summary.json, table.md,
ruler.png: `msakit.eval.report.write_report`) and the samples per second are printed.

Every shard makes the same samples as one process would (each sample is seeded by (seed, task,
length, index)), so the merged folder equals one `msakit eval` run of the whole grid.

    python benchmarks/ruler_gpu.py --model DIR --out DIR [--tasks ruler] [--lengths 4096,...]
        [--policies dense,window0,oracle,msa] [--budget block128-top16] [--ruler-samples 25]
        [--workers 8] [--time-limit 480] [--loss-samples 4] [-- EXTRA msakit eval ARGS]
    python benchmarks/ruler_gpu.py --merge FOLDER_OR_JSONL ... --out DIR   (merge earlier runs only)

`--loss-samples N` adds one more worker for the loss-by-position task (N documents per length).
Arguments after `--` go to every `msakit eval` (e.g. `--rope-scaling yarn:4`, `--ruler-data W...`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from msakit.eval import EvalConfig  # noqa: E402
from msakit.eval.report import write_report  # noqa: E402
from msakit.eval.ruler import RULER_TASKS, expand_tasks  # noqa: E402
from msakit.eval.runner import RESULTS, TASKS, parse_policy, read_records  # noqa: E402
from msakit.jsonl import append_jsonl  # noqa: E402
from msakit.ops.index_topk import Selection  # noqa: E402

# generated tokens per task (RULER's budgets): the round-robin deals the costliest tasks first
_COST = {"cwe": 120, "fwe": 50, "qa_1": 32, "qa_2": 32, "ruler_vt": 30}


def deal(tasks: list[str], workers: int) -> list[list[str]]:
    """`tasks` dealt to at most `workers` groups, costliest first (NIAH's 128 tokens usually stop
    early, once the answer is out: counted as 40)."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    order = sorted(tasks, key=lambda t: -_COST.get(t, 40))
    groups: list[list[str]] = [[] for _ in range(min(workers, len(order)))]
    load = [0] * len(groups)
    for t in order:
        i = load.index(min(load))
        groups[i].append(t)
        load[i] += _COST.get(t, 40)
    return groups


def _results_file(p: Path) -> Path:
    return p / RESULTS if p.is_dir() else p


def grid_config(records: list[dict]) -> EvalConfig:
    """The evaluation grid of `records` (their tasks, lengths, policies, sample counts and their
    one budget; ValueError for records of several budgets)."""
    budgets = sorted({r["budget"] for r in records if r.get("budget")})
    if len(budgets) != 1:
        raise ValueError(f"the records must be of one budget, found {budgets}")
    named = {r["task"] for r in records}
    return EvalConfig(tasks=[t for t in TASKS if t in named],
                      lengths=sorted({int(r["length"]) for r in records}),
                      policies=list(dict.fromkeys(r["policy"] for r in records)), budget=Selection.parse(budgets[0]),
                      samples=max([1] + [int(r["index"]) + 1 for r in records if r["task"] not in RULER_TASKS]),
                      ruler_samples=max([1] + [int(r["index"]) + 1 for r in records if r["task"] in RULER_TASKS]))


def merge(out: Path, shard_dirs: list[Path]) -> dict:
    """The records of `shard_dirs` (folders holding a results.jsonl, or such files; deduplicated
    by key, the first seen kept) in OUT/merged/, with its report (`grid_config`'s grid)."""
    merged = out / "merged"
    merged.mkdir(parents=True, exist_ok=True)
    seen, records = set(), []
    for d in shard_dirs:
        f = _results_file(d)
        for r in read_records(f) if f.is_file() else []:
            if r.get("key") not in seen:
                seen.add(r.get("key"))
                records.append(r)
    path = merged / RESULTS
    path.unlink(missing_ok=True)
    if records:
        append_jsonl(path, *records, sort_keys=True)
        write_report(records, grid_config(records), merged, model_name=cfg_model_name(shard_dirs))
    return {"records": len(records), "folder": str(merged)}


def cfg_model_name(shard_dirs: list[Path]) -> str | None:
    for d in shard_dirs:
        s = (d if d.is_dir() else d.parent) / "settings.json"
        if s.is_file():
            return json.loads(s.read_text()).get("model")
    return None


def merge_only(out: Path, paths: list[Path]) -> int:
    """`--merge`: the grid and budget from the records themselves."""
    missing = [str(p) for p in paths if not _results_file(p).is_file()]
    if missing:
        print(f"ruler_gpu.py: no results.jsonl at {', '.join(missing)}", file=sys.stderr)
        return 2
    try:
        info = merge(out, paths)
    except ValueError as e:
        print(f"ruler_gpu.py: --merge: {e}", file=sys.stderr)
        return 2
    print(json.dumps(info))
    table = out / "merged" / "table.md"
    if table.is_file():
        print(table.read_text(), end="")
    return 0


def stop(procs: dict[str, subprocess.Popen]) -> None:
    for p in procs.values():
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    t0 = time.time()
    while any(p.poll() is None for p in procs.values()) and time.time() - t0 < 20:
        time.sleep(0.5)
    for p in procs.values():
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="the model folder (not with --merge)")
    ap.add_argument("--merge", nargs="+", type=Path, default=None, metavar="PATH",
                    help="only merge these result folders / results.jsonl files into OUT/merged (no evaluation)")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--tasks", default="ruler")
    ap.add_argument("--lengths", default="4096,8192,16384,32768")
    ap.add_argument("--policies", default="dense,window0,oracle,msa")
    ap.add_argument("--budget", default="block128-top16")
    ap.add_argument("--ruler-samples", type=int, default=25)
    ap.add_argument("--loss-samples", type=int, default=0)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--time-limit", type=float, default=480.0, help="seconds before running workers are stopped")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    args = ap.parse_args(argv)
    if args.ruler_samples < 1 or args.loss_samples < 0 or args.time_limit <= 0:
        print("ruler_gpu.py: --ruler-samples >= 1, --loss-samples >= 0, --time-limit > 0", file=sys.stderr)
        return 2
    if args.merge:
        return merge_only(args.out, args.merge)
    if not args.model:
        print("ruler_gpu.py: --model is required (or --merge)", file=sys.stderr)
        return 2
    try:  # the arguments every worker gets, checked once here
        tasks = [t for t in expand_tasks(args.tasks.split(",")) if t in RULER_TASKS]
        for p in args.policies.split(","):
            parse_policy(p)
        Selection.parse(args.budget)
        [int(n) for n in args.lengths.split(",")]
    except ValueError as e:
        print(f"ruler_gpu.py: {e}", file=sys.stderr)
        return 2
    if not tasks and not args.loss_samples:
        print("ruler_gpu.py: --tasks names no RULER task and --loss-samples is 0: nothing to run", file=sys.stderr)
        return 2
    groups = [(f"w{i:02d}", g, ["--ruler-samples", str(args.ruler_samples)])
              for i, g in enumerate(deal(tasks, args.workers))]
    if args.loss_samples:
        groups.append(("loss", ["loss"], ["--samples", str(args.loss_samples)]))
    shards = args.out / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    # expandable segments: many processes share the card, and a 32K prefill's transient blocks fragment it
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               PYTORCH_CUDA_ALLOC_CONF=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"))
    dirs = [shards / name for name, _, _ in groups]

    def counts() -> dict[str, int]:
        return {name: len(read_records(d / RESULTS)) if (d / RESULTS).is_file() else 0
                for (name, _, _), d in zip(groups, dirs)}

    before = counts()
    procs: dict[str, subprocess.Popen] = {}
    logs = {}
    t0 = time.time()
    for name, group, more in groups:
        d = shards / name
        cmd = [sys.executable, "-m", "msakit", "eval", "--model", args.model, "--tasks", ",".join(group),
               "--lengths", args.lengths, "--policies", args.policies, "--budget", args.budget, "--out", str(d),
               "--device", args.device, "--dtype", args.dtype, "--no-progress", *more, *extra]
        if (d / RESULTS).is_file():
            cmd.append("--resume")
        logs[name] = open(shards / f"{name}.log", "a")
        logs[name].write(f"$ {' '.join(cmd)}\n")
        logs[name].flush()
        procs[name] = subprocess.Popen(cmd, stdout=logs[name], stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                       start_new_session=True)
        print(f"[ruler_gpu] {name}: {','.join(group)}", flush=True)
    cut = False
    try:
        while any(p.poll() is None for p in procs.values()):
            if time.time() - t0 > args.time_limit:
                cut = True
                print(f"[ruler_gpu] time limit {args.time_limit:.0f}s: stopping the running workers", flush=True)
                break
            time.sleep(2)
    finally:
        stop(procs)
        for f in logs.values():
            f.close()
    wall = time.time() - t0
    after = counts()
    new = {name: after[name] - before[name] for name in after}
    codes = {name: p.returncode for name, p in procs.items()}
    info = merge(args.out, dirs)
    for name, group, _ in groups:
        if codes[name] not in (0, None) and not cut:
            tail = (shards / f"{name}.log").read_text().splitlines()[-5:]
            print(f"[ruler_gpu] {name} exited {codes[name]}:\n  " + "\n  ".join(tail), flush=True)
    stats = dict(wall_s=round(wall, 1), cut=cut, records=after, new_records=new, exit_codes=codes, merged=info,
                 samples_per_s=round(sum(new.values()) / max(wall, 1e-9), 3), workers=args.workers)
    (args.out / "ruler_gpu.json").write_text(json.dumps(stats, indent=2) + "\n")
    print(json.dumps(stats), flush=True)
    table = args.out / "merged" / "table.md"
    if table.is_file():
        print(table.read_text(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
