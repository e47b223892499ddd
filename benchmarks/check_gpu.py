"""GPU correctness and speed checks of every kernel, in one call on the device machine.

    python benchmarks/check_gpu.py --sections topk,sparse,kl,decode,quant [--quick]

Each section calls the op's own `bench.check_and_bench` (fresh random inputs, poisoned outputs,
comparison against float32/float64 references with METHOD.md's error norms) and keeps going when
one section fails.  Writes benchmarks/results/check_gpu_<gpu>.json (and $OUT/), prints a summary.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import env_info, save_json  # noqa: E402


def sec_topk(quick: bool) -> dict:
    from msakit.ops.index_topk.bench import CANDIDATE_CONFIGS, check_and_bench

    sweep = check_and_bench(T_list=(131072,), configs=CANDIDATE_CONFIGS, score_dtypes=("bf16", "fp8"))
    T = (16384, 131072) if quick else (16384, 65536, 131072, 262144, 1048576)
    return {"config_sweep": sweep, "rows": check_and_bench(T_list=T)}


def sec_sparse(quick: bool) -> dict:
    from msakit.ops.sparse_attention.bench import check_and_bench

    return {"rows": check_and_bench(T_list=(16384, 32768) if quick else (16384, 32768, 131072, 1048576))}


def sec_kl(quick: bool) -> dict:
    from msakit.ops.index_kl.bench import check_and_bench

    return {"rows": check_and_bench(T_list=(16384,) if quick else (16384, 65536, 131072))}


def sec_decode(quick: bool) -> dict:
    from msakit.ops.decode import bench

    out = {}
    if hasattr(bench, "graph_check"):
        out["graph_check"] = bench.graph_check()
    out["rows"] = bench.check_and_bench() if hasattr(bench, "check_and_bench") else None
    return out


def sec_quant(quick: bool) -> dict:
    import subprocess

    from msakit.quant.formats.bench import bench_formats, print_table

    t = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_quant_formats.py"],
                       capture_output=True, text=True, timeout=400)
    print(t.stdout[-3000:], t.stderr[-2000:], flush=True)
    rows = bench_formats()
    print_table(rows)
    x = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    from benchmarks.common import bench_ms

    ms = bench_ms(lambda: y.copy_(x), rep=20)
    return {"pytest_tail": t.stdout[-2000:], "pytest_rc": t.returncode, "rows": rows,
            "copy_rw_TBps": 2 * x.numel() / ms / 1e9, "read_TBps_est": x.numel() / ms / 1e9 * 2 / 2}


SECTIONS = {"topk": sec_topk, "sparse": sec_sparse, "kl": sec_kl, "decode": sec_decode, "quant": sec_quant}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    res = {"env": env_info(), "sections": {}}
    for name in args.sections.split(","):
        t0 = time.time()
        print(f"=== {name}", flush=True)
        try:
            res["sections"][name] = SECTIONS[name](args.quick)
        except Exception:
            tb = traceback.format_exc()
            print(tb, flush=True)
            res["sections"][name] = {"error": tb[-4000:]}
        res["sections"][name]["seconds"] = time.time() - t0
        torch.cuda.empty_cache()
        gpu = (res["env"].get("gpu") or "gpu").replace(" ", "_")
        save_json(f"check_gpu_{gpu}{args.tag}.json", res)
    print("=== done", {k: round(v.get("seconds", 0), 1) for k, v in res["sections"].items()})


if __name__ == "__main__":
    main()
