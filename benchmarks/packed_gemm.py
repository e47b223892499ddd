"""Packed NVFP4 / MXFP8 GEMMs at MiniMax-M3's shapes (msakit.ops.packed_gemm) against BF16 and
against dequantize-then-matmul.

Routed experts (128 experts, hidden 6144, width 3072): the gate/up projection w1 / w3 [E, 3072,
6144] and the down projection w2 [E, 6144, 3072], with A active experts of t rows each
(A = 8: a decode batch of 2 tokens; A = 128: every expert busy, batch >= 32), t = 1, 2, 4, 8, 16
(decode) and 128, 1024 (prefill: 4K and 32K tokens x top-4 over 128 experts).  Methods:
  nvfp4        packed_grouped_mm (Triton, W4A16, the library's tile heuristic)
  bf16_grouped the faster of torch._grouped_mm and a loop of cuBLAS matmuls over the active
               experts, BF16 weights
  dequant      today's path: unpack_weight of the active experts, then torch._grouped_mm
MXFP8 linears (q 6144->8192, o 8192->6144, shared expert up 6144->3072 / down 3072->6144, kv
6144->1024) at 1-16 and 4096 / 16384 rows:
  w8a16        fake-quantize x (1x32), packed_linear (weights dequantized in registers)
  scaled       quantize x (1x32) to E4M3 + E8M0, mxfp8_scaled_mm (FP8 tensor cores)
  module       PackedLinear.forward (the dispatch the model runs)
  bf16         F.linear with BF16 weights (cuBLAS)
  dequant      fake-quantize x, unpack_weight, F.linear
Each call is timed as CUDA-graph replays (20 calls per graph: no launch overhead, as in a graphed
decode step), median of the repetitions.  GB/s counts the packed bytes read (weights + scales of
the active experts); the HBM ceiling is a 2 GiB device-to-device copy measured here (and the
datasheet figure).  A correctness check at every shape comes first (kernel vs dequantize-then-
matmul, relative error).  --sweep also times a grid of tile configurations of the grouped kernel
at the decode shapes and reports the best (docs/packed.md).

    python benchmarks/packed_gemm.py [--quick] [--sweep]

Writes benchmarks/results/packed_gemm_<gpu>.json (and $OUT/) and prints the tables.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import add_run_args, bench_ms, env_info, gpu_tag, print_rows, rel_err, save_json  # noqa: E402
from msakit.ops.packed_gemm import mxfp8_scaled_mm, packed_grouped_mm, packed_linear  # noqa: E402
from msakit.ops.packed_gemm.triton import GemmConfig, grouped_mm_triton  # noqa: E402
from msakit.quant.formats import mxfp8_quantize  # noqa: E402
from msakit.quant.linear import PackedLinear, mxfp8_fake_quantize_to, pack_weight, unpack_weight  # noqa: E402

E, H, I = 128, 6144, 3072
DATASHEET_TBS = {"H200": 4.8, "H100": 3.35}
EXPERT_PROJ = {"w13": (I, H), "w2": (H, I)}  # (N, K)
LINEARS = {"q": (8192, 6144), "o": (6144, 8192), "shared_up": (3072, 6144), "shared_down": (6144, 3072),
           "kv": (1024, 6144)}


def graph_ms(fn, calls: int = 20) -> float:
    """Median milliseconds of one fn() replayed from a CUDA graph of `calls` calls (falls back to
    event timing of eager calls when the capture fails)."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                fn()
    except Exception:  # e.g. a host sync inside fn
        return bench_ms(fn)
    return bench_ms(g.replay) / calls


def copy_gbs() -> float:
    a = torch.empty(2**30, dtype=torch.uint16, device="cuda")
    b = torch.empty_like(a)
    ms = bench_ms(lambda: b.copy_(a))
    return 2 * a.numel() * 2 / ms / 1e6


def experts(N: int, K: int, A: int, seed: int = 0) -> dict:
    """A packed NVFP4 copy and a BF16 copy of E experts [E, N, K]; the first A are active."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16, generator=g) * K**-0.5
    t = pack_weight(w, "nvfp4")
    return {"packed": t, "bf16": w}


def grouped_rows(ws: dict, N: int, K: int, A: int, t: int, sweep: list[GemmConfig] | None) -> dict:
    counts = torch.zeros(E, dtype=torch.int64, device="cuda")
    counts[:A] = t
    M = A * t
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    p = ws["packed"]
    args = (p["weight"], p["weight_scale"], p["weight_scale_2"])
    offs = counts.cumsum(0).to(torch.int32)
    wt = ws["bf16"].transpose(1, 2)

    def nvfp4():
        return packed_grouped_mm(x, counts, *args, fmt="nvfp4")

    def bf16_grouped():
        return torch._grouped_mm(x, wt, offs=offs)

    def bf16_loop():
        return torch.cat([x[e * t:(e + 1) * t] @ ws["bf16"][e].T for e in range(A)])

    def dequant():
        sub = {k: v[:A] for k, v in p.items()}
        w = unpack_weight(sub, "nvfp4", torch.bfloat16)
        return torch._grouped_mm(x, w.transpose(1, 2), offs=offs[:A])

    ref = dequant()
    row = {"N": N, "K": K, "active": A, "tokens_per_expert": t, "rows": M,
           "rel_err_vs_dequant": rel_err(nvfp4(), ref)}
    packed_bytes = A * (N * K // 2 + N * K // 16 + 4)
    row["packed_MB"] = packed_bytes / 1e6
    for name, fn in (("nvfp4", nvfp4), ("bf16_grouped_mm", bf16_grouped), ("bf16_loop", bf16_loop),
                     ("dequant", dequant)):
        row[name + "_ms"] = graph_ms(fn)
    row["bf16_ms"] = min(row["bf16_grouped_mm_ms"], row["bf16_loop_ms"])
    row["nvfp4_GBs"] = packed_bytes / row["nvfp4_ms"] / 1e6
    row["speedup_vs_bf16"] = row["bf16_ms"] / row["nvfp4_ms"]
    row["speedup_vs_dequant"] = row["dequant_ms"] / row["nvfp4_ms"]
    if sweep:
        best = None
        for cfg in sweep:
            try:
                ms = graph_ms(lambda: grouped_mm_triton(x, counts, *args, "nvfp4", cfg))
            except Exception as e:  # a config that does not compile (shared memory)
                print(f"  config {cfg}: {type(e).__name__}")
                continue
            if best is None or ms < best[0]:
                best = (ms, cfg)
        if best:
            row["sweep_best_ms"] = best[0]
            row["sweep_best_GBs"] = packed_bytes / best[0] / 1e6
            row["sweep_best_config"] = best[1].__dict__
    return row


def linear_rows(N: int, K: int, M: int, name: str) -> dict:
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K**-0.5
    lin = torch.nn.Linear(K, N, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
    pl = PackedLinear.from_float(lin, "mxfp8", compute_dtype=torch.bfloat16)
    t = pl.packed_tensors()
    wq = unpack_weight(t, "mxfp8", torch.bfloat16)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)

    def w8a16():
        return packed_linear(mxfp8_fake_quantize_to(x, torch.bfloat16), t["weight"], t["weight_scale_inv"],
                             fmt="mxfp8")

    def scaled():
        c, s = mxfp8_quantize(x, check_finite=False)
        return mxfp8_scaled_mm(c, s, t["weight"], t["weight_scale_inv"], out_dtype=torch.bfloat16)

    def dequant():
        return F.linear(mxfp8_fake_quantize_to(x, torch.bfloat16), unpack_weight(t, "mxfp8", torch.bfloat16))

    ref = dequant()
    row = {"linear": name, "N": N, "K": K, "rows": M, "rel_err_w8a16": rel_err(w8a16(), ref),
           "rel_err_scaled": rel_err(scaled(), ref)}
    with torch.no_grad():
        for nm, fn in (("w8a16", w8a16), ("scaled", scaled), ("module", lambda: pl(x)),
                       ("bf16", lambda: F.linear(x, wq)), ("dequant", dequant)):
            row[nm + "_ms"] = graph_ms(fn)
    packed = min(row["w8a16_ms"], row["scaled_ms"])
    row["best_packed_ms"] = packed
    row["speedup_vs_bf16"] = row["bf16_ms"] / packed
    row["module_vs_bf16"] = row["bf16_ms"] / row["module_ms"]
    row["module_vs_dequant"] = row["dequant_ms"] / row["module_ms"]
    row["w8a16_GBs"] = (N * K + N * K // 32) / row["w8a16_ms"] / 1e6
    return row


def sweep_configs() -> list[GemmConfig]:
    return [GemmConfig(16, bn, bk, sp, w, st) for bn in (32, 64, 128) for bk in (128, 256, 512)
            for sp in (1, 2, 4, 8) for w in (4, 8) for st in (3,)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_args(ap, "fewer shapes")
    ap.add_argument("--sweep", action="store_true", help="time a grid of tile configs at the decode shapes")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("packed_gemm.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    info = env_info()
    ceiling = copy_gbs()
    name = info["gpu"] or ""
    sheet = next((v for k, v in DATASHEET_TBS.items() if k in name), None)
    print(f"{name}: device-to-device copy {ceiling:.0f} GB/s (datasheet {sheet} TB/s)")
    ts = (1, 4, 16) if args.quick else (1, 2, 4, 8, 16)
    big = (128,) if args.quick else (128, 1024)
    grouped = []
    for proj, (N, K) in EXPERT_PROJ.items():
        ws = experts(N, K, E)
        for A in (8, 128):
            for t in ts + (big if A == 128 else ()):
                sw = sweep_configs() if args.sweep and t in (1, 16) and A == 128 else None
                r = grouped_rows(ws, N, K, A, t, sw)
                r["proj"] = proj
                r["frac_copy"] = r["nvfp4_GBs"] / ceiling
                r["frac_datasheet"] = r["nvfp4_GBs"] / (sheet * 1e3) if sheet else None
                grouped.append(r)
                print(f"  {proj} A={A} t={t}: nvfp4 {r['nvfp4_ms']:.4f} ms ({r['nvfp4_GBs']:.0f} GB/s), bf16 "
                      f"{r['bf16_ms']:.4f}, dequant {r['dequant_ms']:.4f}, err {r['rel_err_vs_dequant']:.1e}")
        del ws
        torch.cuda.empty_cache()
    print_rows(grouped, [("proj", "proj", ""), ("A", "active", "d"), ("t", "tokens_per_expert", "d"),
                         ("nvfp4 ms", "nvfp4_ms", ".4f"), ("GB/s", "nvfp4_GBs", ".0f"), ("%copy", "frac_copy", ".2f"),
                         ("bf16 ms", "bf16_ms", ".4f"), ("x bf16", "speedup_vs_bf16", ".2f"),
                         ("dequant ms", "dequant_ms", ".4f"), ("x deq", "speedup_vs_dequant", ".2f")])
    linears = []
    rows = (1, 16, 4096) if args.quick else (1, 2, 4, 8, 16, 4096, 16384)
    for nm, (N, K) in LINEARS.items():
        for M in rows:
            r = linear_rows(N, K, M, nm)
            linears.append(r)
            print(f"  {nm} M={M}: w8a16 {r['w8a16_ms']:.4f} scaled {r['scaled_ms']:.4f} module {r['module_ms']:.4f} "
                  f"bf16 {r['bf16_ms']:.4f} dequant {r['dequant_ms']:.4f}")
        torch.cuda.empty_cache()
    print_rows(linears, [("linear", "linear", ""), ("M", "rows", "d"), ("w8a16", "w8a16_ms", ".4f"),
                         ("scaled", "scaled_ms", ".4f"), ("module", "module_ms", ".4f"), ("bf16", "bf16_ms", ".4f"),
                         ("dequant", "dequant_ms", ".4f"), ("x bf16", "speedup_vs_bf16", ".2f"),
                         ("mod/deq", "module_vs_dequant", ".2f")])
    dec = [r for r in grouped if r["tokens_per_expert"] <= 16]
    big_rows = [r for r in grouped if r["tokens_per_expert"] > 16]
    bars = {
        "nvfp4_decode_min_frac_datasheet": min((r["frac_datasheet"] or 0) for r in dec),
        "nvfp4_decode_min_frac_copy": min(r["frac_copy"] for r in dec),
        "nvfp4_decode_min_speedup_vs_bf16": min(r["speedup_vs_bf16"] for r in dec),
        "nvfp4_prefill_min_speedup_vs_dequant": min((r["speedup_vs_dequant"] for r in big_rows), default=None),
        "mxfp8_decode_min_speedup_vs_bf16": min(r["speedup_vs_bf16"] for r in linears if r["rows"] <= 16),
        "mxfp8_prefill_min_module_vs_dequant": min(r["module_vs_dequant"] for r in linears if r["rows"] >= 4096),
        "mxfp8_prefill_min_scaled_vs_bf16": min(r["bf16_ms"] / r["scaled_ms"] for r in linears if r["rows"] >= 4096),
        "max_rel_err": max([r["rel_err_vs_dequant"] for r in grouped]
                           + [max(r["rel_err_w8a16"], r["rel_err_scaled"]) for r in linears]),
    }
    print("\nbars:", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in bars.items()})
    payload = {"env": info, "copy_GBs": ceiling, "datasheet_TBs": sheet, "grouped": grouped, "linears": linears,
               "bars": bars, "quick": args.quick}
    path = save_json(f"packed_gemm_{gpu_tag(info)}{args.tag}.json", payload, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
