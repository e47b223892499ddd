"""Decode speed of msakit's MSA (paged KV cache, batched split-K `msa_decode`) against dense
decode and against msakit's own bytes-read floor, in one run on one GPU (issue: Decode).

One layer of the M3 shape: Hq=64, G=4, D=128, Di=128, page = block 128, top-16, bf16 K/V, index
keys bf16 or fp8 e4m3.  Dense baseline: SDPA with a group's 16 query heads packed as 16 query
rows over that group's K/V (batch*G as the batch dim).  Floor: bytes of all index keys + the
top-k blocks of K and V, over 4.16 TB/s.  Calls are timed inside CUDA graphs, with an L2 flush
before each call ("cold", the headline) and back to back ("hot").

    python benchmarks/decode.py [--B 1 8 32] [--N 16384 131072 1048576] [--idx bf16 fp8] [--nq 1]
                                [--no-check] [--no-tune] [--generate 32768 131072] [--skip-layer]

--generate also times `model.generate` of the "small" preset (random weights, bf16, sparse mode)
after prompts of those lengths, paged (msa_decode) and contiguous caches (tokens/s, prefill
taken out).

Writes benchmarks/results/decode_<gpu>.json (and $OUT/ when set), a PNG, and prints a table.
Bars (H200): >= 7.6x dense at 1M B=1 (bf16 index keys), >= 12x with fp8 index keys, never slower
than dense at 16K B=1, within 1.3x of the floor at 1M.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import RESULTS, env_info, save_json  # noqa: E402
from msakit.ops.decode import bench  # noqa: E402


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "speedup" in r]
    labels = sorted({(r["B"], r["N"]) for r in rows}, key=lambda x: (x[1], x[0]))
    idxs = sorted({r["idx"] for r in rows})
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(labels) + 2), 4))
    w = 0.8 / max(1, len(idxs) + 1)
    for j, idx in enumerate(idxs):
        ys = [next((r["speedup"] for r in rows if (r["B"], r["N"]) == lab and r["idx"] == idx), 0) for lab in labels]
        ax.bar([i + j * w for i in range(len(labels))], ys, w, label=f"msakit, {idx} index keys")
    floor = [next((r["dense_ms"] / r["floor_ms"] for r in rows if (r["B"], r["N"]) == lab and r["idx"] == "bf16"), 0)
             for lab in labels]
    ax.bar([i + len(idxs) * w for i in range(len(labels))], floor, w, color="lightgrey", label="bytes floor (bf16 idx)")
    ax.set_xticks([i + 0.4 - w / 2 for i in range(len(labels))])
    ax.set_xticklabels([f"B={b}\n{n // 1024}K" for b, n in labels], fontsize=8)
    ax.axhline(1, color="k", lw=0.5)
    ax.set_ylabel("speedup over dense decode (x)")
    ax.set_title(f"MSA decode vs dense, M3 layer, {torch.cuda.get_device_name()}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def generate_speed(contexts: list[int], new_tokens: int = 64, batch: int = 1) -> list[dict]:
    """Tokens/s of `model.generate` for the "small" M3 preset (random weights, bf16, sparse MSA
    mode) after a prompt of each context length: the paged cache (`msa_decode`, the default on
    CUDA) and the contiguous one, greedy, timed after a short warm-up generation."""
    import time

    from msakit.models import M3Config, M3ForCausalLM

    rows = []
    for ctx in contexts:
        cfg = M3Config.preset("small", vocab_size=4096, max_position_embeddings=ctx + new_tokens + 8)
        model = M3ForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
        model.set_attention_mode("sparse")
        ids = torch.randint(0, 4096, (batch, ctx), device="cuda")
        row = {"context": ctx, "batch": batch, "new_tokens": new_tokens, "params": sum(p.numel() for p in model.parameters())}
        for cache in ("paged", "contiguous"):
            try:
                with torch.no_grad():
                    model.generate(ids, 4, temperature=0.0, cache=cache)  # warm-up (compiles, allocator)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    model.generate(ids, new_tokens, temperature=0.0, cache=cache)
                    torch.cuda.synchronize()
                    dt = time.perf_counter() - t0
                # the prompt's prefill is inside dt: time it alone and take it out
                with torch.no_grad():
                    torch.cuda.synchronize()
                    t1 = time.perf_counter()
                    model.generate(ids, 1, temperature=0.0, cache=cache)
                    torch.cuda.synchronize()
                    pre = time.perf_counter() - t1
                row[f"{cache}_prefill_s"] = pre
                row[f"{cache}_tok_s"] = batch * (new_tokens - 1) / max(1e-9, dt - pre)
            except Exception as e:  # report and go on
                row[f"{cache}_error"] = repr(e)[:300]
        print(row, flush=True)
        rows.append(row)
        del model
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, nargs="*", default=[1, 8, 32])
    ap.add_argument("--N", type=int, nargs="*", default=[16384, 131072, 1048576])
    ap.add_argument("--idx", nargs="*", default=["bf16", "fp8"])
    ap.add_argument("--nq", type=int, default=1)
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--no-tune", action="store_true")
    ap.add_argument("--tag", default="")
    ap.add_argument("--generate", type=int, nargs="*", default=None, metavar="CTX",
                    help="also time model.generate of the small preset at these contexts (e.g. 32768 131072)")
    ap.add_argument("--skip-layer", action="store_true", help="only the --generate timings")
    args = ap.parse_args()
    info = env_info()
    payload: dict = {"env": info, "shape": dict(Hq=bench.HQ, G=bench.G, D=bench.D, Di=bench.DI, block=bench.PS,
                                                 topk=bench.TOPK, kv="bf16", nq=args.nq), "read_bw": bench.READ_BW}
    if not args.no_check:
        payload["graph_check"] = bench.graph_check()
        print("graph_check ok:", payload["graph_check"]["ok"], flush=True)
    plan_kw = None
    if not args.no_tune:
        payload["tune"] = bench.tune()
        plan_kw = bench.best_plan_kw(payload["tune"])
        payload["chosen"] = plan_kw
        print("chosen scoring launch:", plan_kw, flush=True)
    rows = [] if args.skip_layer else bench.run(args.B, args.N, args.idx, nq=args.nq, plan_kw=plan_kw)
    payload["rows"] = rows
    if args.generate:
        payload["generate"] = generate_speed(args.generate)
    gpu = (info.get("gpu") or "gpu").replace(" ", "_")
    name = f"decode_{gpu}{args.tag}.json"
    save_json(name, payload)
    png = RESULTS / name.replace(".json", ".png")
    try:
        plot(rows, png)
        if os.environ.get("OUT"):
            shutil.copy(png, os.environ["OUT"])
    except Exception as e:  # plotting is optional
        print("plot failed:", e)
    bench.print_table(rows)


if __name__ == "__main__":
    main()
