"""Decode speed of msakit's MSA (paged KV cache, batched split-K `msa_decode`) against dense
decode and against msakit's own bytes-read floor, in one run on one GPU.

One layer of the M3 shape: Hq=64, G=4, D=128, Di=128, page = block 128, top-16, bf16 K/V, index
keys bf16 or fp8 e4m3; nq new tokens per sequence (1, or 2-8 for speculative verification); each
launch of `DecodeTiling.launch` ("split": the multi-launch path, "ticket": one launch)
timed in the same run.  Dense baseline: SDPA with a group's 16 query heads packed as 16 query
rows over that group's K/V (batch*G as the batch dim), the fastest backend that takes it.
Floor: bytes of all index keys + the top-k blocks of K and V, over 4.16 TB/s.  Calls are timed
inside CUDA graphs, with an L2 flush before each call ("cold", the headline: the flush writes a
256 MiB buffer) and back to back ("hot"); --read-flush also times cold calls after a read-only
flush (clean L2 lines: the write-back share of the headline), at B = 1.

    python benchmarks/decode.py [--B 1 8] [--N 16384 131072 1048576] [--idx bf16 fp8] [--nq 1 2 4 8]
                                [--launch split ticket] [--no-check] [--read-flush] [--quick]

`model.generate` tokens/s is benchmarks/generate.py.  Writes benchmarks/results/decode_<gpu>.json
(and --out / $OUT), a PNG, and prints a table.  Bars (H200): >= 7.6x dense at 1M B=1 (bf16 index
keys), >= 12x with fp8 index keys, never slower than dense at 16K B=1, within 1.3x of the floor at 1M;
verification of 4 tokens (nq = 4) <= 1.5x one token (the table's "x nq=1" column).  The check that
runs first (unless --no-check) compares every launch with the reference at the M3 shape, eager
and replayed from a CUDA graph, with NaN in the pool pages no sequence holds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import RESULTS, add_run_args, copy_out, env_info, gpu_tag, save_json  # noqa: E402
from tools.bench import decode as bench  # noqa: E402


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "speedup" in r and r["nq"] == 1]
    labels = sorted({(r["B"], r["N"]) for r in rows}, key=lambda x: (x[1], x[0]))
    kinds = sorted({(r["idx"], r.get("launch", "split")) for r in rows})
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(labels) + 2), 4))
    w = 0.8 / max(1, len(kinds) + 1)
    for j, (idx, launch) in enumerate(kinds):
        ys = [next((r["speedup"] for r in rows if (r["B"], r["N"]) == lab and r["idx"] == idx
                    and r.get("launch", "split") == launch), 0) for lab in labels]
        ax.bar([i + j * w for i in range(len(labels))], ys, w, label=f"msakit {launch}, {idx} index keys")
    floor = [next((r["dense_ms"] / r["floor_ms"] for r in rows if (r["B"], r["N"]) == lab and r["idx"] == "bf16"), 0)
             for lab in labels]
    ax.bar([i + len(kinds) * w for i in range(len(labels))], floor, w, color="lightgrey",
           label="bytes floor (bf16 idx)")
    ax.set_xticks([i + 0.4 - w / 2 for i in range(len(labels))])
    ax.set_xticklabels([f"B={b}\n{n // 1024}K" for b, n in labels], fontsize=8)
    ax.axhline(1, color="k", lw=0.5)
    ax.set_ylabel("speedup over dense decode (x)")
    ax.set_title(f"MSA decode vs dense, M3 layer, {torch.cuda.get_device_name()}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def read_flush_rows(Bs: list[int], Ns: list[int], idxs: list[str], launches: list[str]) -> list[dict]:
    """Cold times after a read-only L2 flush (msakit and dense), beside the write-flush headline."""
    out = []
    for N in Ns:
        for B in Bs:
            dense = bench.dense_ms(B, N, read_flush=True)
            for idx, launch in ((i, la) for i in idxs for la in launches):
                r = bench.bench_case(B, N, idx=idx, detail=False, read_flush=True, launch=launch)
                row = {"B": B, "N": N, "idx": idx, "launch": launch, "msa_ms": r["msa_ms"],
                       "msa_read_ms": r["msa_read_ms"],
                       "dense_ms": dense["dense_ms"], "dense_read_ms": dense["dense_read_ms"],
                       "speedup": dense["dense_ms"] / r["msa_ms"],
                       "speedup_read_flush": dense["dense_read_ms"] / r["msa_read_ms"]}
                print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
                out.append(row)
            torch.cuda.empty_cache()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--B", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--N", type=int, nargs="*", default=[16384, 131072, 1048576])
    ap.add_argument("--idx", nargs="*", default=["bf16", "fp8"])
    ap.add_argument("--nq", type=int, nargs="*", default=[1], help="new tokens per sequence (1-8), each timed")
    ap.add_argument("--launch", nargs="*", default=list(bench.LAUNCHES), choices=bench.LAUNCHES,
                    help="DecodeTiling.launch values to time (default: all, in one run)")
    ap.add_argument("--no-check", action="store_true", help="skip the graph == eager / reference check")
    ap.add_argument("--read-flush", action="store_true", help="also time cold calls after a read-only flush (B = 1)")
    add_run_args(ap, "smoke run: B 1, N 16K and 1M, no check")
    args = ap.parse_args(argv)
    if args.quick:
        args.B, args.N, args.no_check = [1], [16384, 1048576], True
    info = env_info()
    payload: dict = {"env": info, "shape": dict(Hq=bench.HQ, G=bench.G, D=bench.D, Di=bench.DI, block=bench.PS,
                                                 topk=bench.TOPK, kv="bf16", nq=args.nq),
                    "launches": args.launch, "read_bw": bench.READ_BW}
    if not args.no_check:
        payload["graph_check"] = bench.graph_check(launches=tuple(args.launch))
        print("graph_check ok:", payload["graph_check"]["ok"], flush=True)
    rows = bench.run(args.B, args.N, args.idx, nq=tuple(args.nq), launches=tuple(args.launch))
    payload["rows"] = rows
    if args.read_flush:
        payload["read_flush"] = read_flush_rows([1], [n for n in args.N if n >= 131072] or args.N, args.idx,
                                                args.launch)
    name = f"decode_{gpu_tag(info)}{args.tag}.json"
    save_json(name, payload, args.out)
    png = RESULTS / name.replace(".json", ".png")
    try:
        plot(rows, png)
        copy_out(png, args.out)
    except Exception as e:  # plotting is optional
        print("plot failed:", e)
    bench.print_table(rows)


if __name__ == "__main__":
    main()
