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

    python benchmarks/packed_gemm.py --decode-ab        (about 3 minutes)

only the NVFP4 decode A/B at M3's expert shapes (hidden 6144, expert width 3072; w13 [3072, 6144]
and w2 [6144, 3072]; A = 4 or 32 active experts of 128, t = 1, 2, 4, 8, 16 tokens each):
  new       packed_grouped_mm (the byte-table kernel the library runs)
  old       the per-element decode (`_grouped_kernel` with bfloat16 x, the library's kernel
            before it; kept here for the comparison)
  bf16      msakit.nn.moe.grouped_mm on BF16 weights
  dequant   unpack_weight of the active experts, then grouped_mm
Each captured call reads a different set of active experts (the sets rotate over the 128), so that
the packed weights are not served from L2 (4 experts are 42 MB packed, L2 is 50 MB).  Also a small
tile and split-K sweep of the new kernel (w13 at 32 experts, t = 1 and 16; both projections at
4 experts, t = 1 and 4), and a bit-exact check of its dequantized weights (x =
identity).  Writes packed_gemm_decode_ab_<gpu>.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import add_run_args, bench_ms, env_info, gpu_tag, print_rows, rel_err, save_json  # noqa: E402
from msakit.nn.moe import grouped_mm  # noqa: E402
from msakit.ops.packed_gemm import dequantize_reference, mxfp8_scaled_mm, packed_grouped_mm, packed_linear  # noqa: E402
from msakit.ops.packed_gemm import triton as packed_triton  # noqa: E402
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


# ---------------------------------------------------------------------------------------------
# --decode-ab: the NVFP4 decode kernels side by side (one GPU call, about 3 minutes)
# ---------------------------------------------------------------------------------------------

AB_ACTIVE = (4, 32)  # one token's top-4; 8 tokens' top-4 on distinct experts
AB_TOKENS = (1, 2, 4, 8, 16)
AB_ROTATIONS = 8


def old_grouped_mm(x: torch.Tensor, counts: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                   global_scale: torch.Tensor) -> torch.Tensor:
    """The previous NVFP4 path for bfloat16 x: `_grouped_kernel` (per-element integer decode, two
    dots over even / odd columns) with its previous tile heuristic (16 x 64 x 256, 4 warps)."""
    import triton

    M, K = x.shape
    G, N = weight.shape[0], weight.shape[1]
    bm, bn, bk = 16, 64, 256
    active = max(1, min(G, M))
    programs = active * triton.cdiv(N, bn)
    split, steps = 1, triton.cdiv(K, bk)
    while programs * split <= torch.cuda.get_device_properties(x.device).multi_processor_count and split * 4 <= steps:
        split *= 2
    k_per_split = triton.cdiv(triton.cdiv(K, split), bk) * bk
    split = triton.cdiv(K, k_per_split)
    y = torch.empty((split, M, N), dtype=torch.float32, device=x.device)
    slots = triton.cdiv(M, bm) + min(G, M)
    packed_triton._grouped_kernel[(slots, triton.cdiv(N, bn), split)](
        x, weight, scales.view(torch.uint8), global_scale, counts, y, G, M, N, K, k_per_split,
        x.stride(0), weight.stride(0), weight.stride(1), scales.stride(0), scales.stride(1), y.stride(0), y.stride(1),
        FMT=0, DT=1, OUT_F32=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_G=max(2, 1 << (G - 1).bit_length()),
        num_warps=4, num_stages=3)
    return (y.sum(0) if split > 1 else y[0]).to(x.dtype)


def ab_sweep_configs() -> list[GemmConfig]:
    """The tiles and K splits timed at the sweep shapes (4 active experts: few programs, so the
    split and the narrower tiles are the levers there)."""
    return [GemmConfig(16, bn, bk, sp, 4, 3) for bn, bk, splits in ((128, 256, (1, 2)), (64, 256, (1, 2, 4)),
                                                                    (32, 256, (1, 2)), (128, 128, (1, 2)))
            for sp in splits]


def exact_check(p: dict) -> bool:
    """The new kernel's dequantized weights of two experts equal the reference's, bit for bit
    (x = identity: one nonzero product per output)."""
    K, dev = p["weight"].shape[2] * 2, p["weight"].device
    sub = {k: v[:2] for k, v in p.items()}
    x = torch.eye(K, device=dev, dtype=torch.bfloat16).repeat(2, 1)
    counts = torch.full((2,), K, device=dev, dtype=torch.int64)
    y = packed_grouped_mm(x, counts, sub["weight"], sub["weight_scale"], sub["weight_scale_2"], fmt="nvfp4")
    want = dequantize_reference(sub["weight"], sub["weight_scale"], sub["weight_scale_2"], "nvfp4", torch.bfloat16)
    return bool(torch.equal(y, want.transpose(1, 2).reshape(2 * K, -1)))


def ab_rows(ws: dict, N: int, K: int, A: int, t: int, sweep: bool) -> dict:
    p = ws["packed"]
    dev = p["weight"].device
    wt = ws["bf16"].transpose(1, 2)  # [E, K, N]
    args = (p["weight"], p["weight_scale"], p["weight_scale_2"])
    sets = []
    for r in range(AB_ROTATIONS):
        first = (r * A) % E if A * AB_ROTATIONS <= E else (r * (E // AB_ROTATIONS)) % (E - A + 1)
        idx = torch.arange(first, first + A, device=dev)
        counts = torch.zeros(E, dtype=torch.int64, device=dev)
        counts[idx] = t
        x = torch.randn(A * t, K, device=dev, dtype=torch.bfloat16)
        sets.append((x, counts, idx, counts.cumsum(0).to(torch.int32)))
    rot = [0]

    def cycle(f):
        def g():
            s = sets[rot[0] % AB_ROTATIONS]
            rot[0] += 1
            return f(*s)
        return g

    def new(x, counts, idx, offs):
        return packed_grouped_mm(x, counts, *args, fmt="nvfp4")

    def old(x, counts, idx, offs):
        return old_grouped_mm(x, counts, *args)

    def bf16(x, counts, idx, offs):
        return grouped_mm(x, wt, counts, offs)

    def dequant(x, counts, idx, offs):
        sub = {k: v[idx] for k, v in p.items()}
        w = unpack_weight(sub, "nvfp4", torch.bfloat16)
        c = counts[idx]
        return grouped_mm(x, w.transpose(1, 2), c, c.cumsum(0).to(torch.int32))

    x0, c0, i0, o0 = sets[0]
    ref = dequant(x0, c0, i0, o0).float()
    row = {"N": N, "K": K, "active": A, "tokens_per_expert": t, "rows": A * t,
           "rel_err_new": rel_err(new(x0, c0, i0, o0), ref), "rel_err_old": rel_err(old(x0, c0, i0, o0), ref),
           "rel_err_bf16_vs_dequant": rel_err(bf16(x0, c0, i0, o0), ref)}
    packed_bytes = A * (N * K // 2 + N * K // 16 + 4)
    row["packed_MB"] = packed_bytes / 1e6
    for name, fn in (("new", new), ("old", old), ("bf16", bf16), ("dequant", dequant)):
        rot[0] = 0
        row[name + "_ms"] = graph_ms(cycle(fn), calls=2 * AB_ROTATIONS)
        row[name + "_GBs_packed"] = packed_bytes / row[name + "_ms"] / 1e6
    row["bf16_GBs"] = A * N * K * 2 / row["bf16_ms"] / 1e6
    row["new_vs_bf16"] = row["bf16_ms"] / row["new_ms"]
    row["new_vs_old"] = row["old_ms"] / row["new_ms"]
    row["new_vs_dequant"] = row["dequant_ms"] / row["new_ms"]
    row["new_config"] = packed_triton.grouped_config(A * t, N, K, E, "nvfp4", dev).__dict__
    if sweep:
        res = []
        for cfg in ab_sweep_configs():
            def run(x, counts, idx, offs, cfg=cfg):
                return grouped_mm_triton(x, counts, *args, "nvfp4", cfg)
            try:
                err = rel_err(run(x0, c0, i0, o0), ref)
                rot[0] = 0
                ms = graph_ms(cycle(run), calls=2 * AB_ROTATIONS)
            except Exception as e:  # noqa: BLE001 - a config that does not compile (shared memory)
                res.append({"config": cfg.__dict__, "error": f"{type(e).__name__}: {e}"[:200]})
                continue
            res.append({"config": cfg.__dict__, "ms": ms, "GBs_packed": packed_bytes / ms / 1e6, "rel_err": err})
        row["sweep"] = res
    return row


def device_header() -> tuple[dict, float, float | None]:
    """(env_info, a device-to-device copy's GB/s measured now, the datasheet TB/s), printed."""
    torch.backends.cuda.matmul.allow_tf32 = False
    info = env_info()
    ceiling = copy_gbs()
    name = info["gpu"] or ""
    sheet = next((v for k, v in DATASHEET_TBS.items() if k in name), None)
    print(f"{name}: device-to-device copy {ceiling:.0f} GB/s (datasheet {sheet} TB/s)")
    return info, ceiling, sheet


def decode_ab(args) -> int:
    info, ceiling, sheet = device_header()
    rows, exact = [], {}
    for proj, (N, K) in EXPERT_PROJ.items():
        ws = experts(N, K, E)
        exact[proj] = exact_check(ws["packed"])
        print(f"  {proj}: new kernel's weights bit-exact: {exact[proj]}")
        for A in AB_ACTIVE:
            for t in AB_TOKENS:
                r = ab_rows(ws, N, K, A, t, sweep=(proj == "w13" and A == 32 and t in (1, 16))
                                                       or (A == 4 and t in (1, 4)))
                r["proj"] = proj
                r["new_frac_copy"] = r["new_GBs_packed"] / ceiling
                r["old_frac_copy"] = r["old_GBs_packed"] / ceiling
                r["new_frac_datasheet"] = r["new_GBs_packed"] / (sheet * 1e3) if sheet else None
                rows.append(r)
                print(f"  {proj} A={A} t={t}: new {r['new_ms']:.4f} ms ({r['new_GBs_packed']:.0f} GB/s, "
                      f"{r['new_frac_copy']:.0%} of copy), old {r['old_ms']:.4f}, bf16 {r['bf16_ms']:.4f}, dequant "
                      f"{r['dequant_ms']:.4f}; err new {r['rel_err_new']:.1e} old {r['rel_err_old']:.1e}")
                for sw in r.get("sweep", []):
                    print(f"    sweep {sw['config']}: " + (f"{sw['ms']:.4f} ms {sw['GBs_packed']:.0f} GB/s"
                                                           if "ms" in sw else sw["error"]))
        del ws
        torch.cuda.empty_cache()
    print_rows(rows, [("proj", "proj", ""), ("A", "active", "d"), ("t", "tokens_per_expert", "d"),
                      ("new ms", "new_ms", ".4f"), ("GB/s", "new_GBs_packed", ".0f"), ("%copy", "new_frac_copy", ".2f"),
                      ("old ms", "old_ms", ".4f"), ("bf16 ms", "bf16_ms", ".4f"), ("deq ms", "dequant_ms", ".4f"),
                      ("x bf16", "new_vs_bf16", ".2f"), ("x old", "new_vs_old", ".2f"),
                      ("x deq", "new_vs_dequant", ".2f")])
    bars = {
        "new_min_frac_copy": min(r["new_frac_copy"] for r in rows),
        "new_min_frac_datasheet": min((r["new_frac_datasheet"] or 0) for r in rows),
        "new_min_speedup_vs_bf16": min(r["new_vs_bf16"] for r in rows),
        "new_min_speedup_vs_old": min(r["new_vs_old"] for r in rows),
        "max_rel_err_new": max(r["rel_err_new"] for r in rows),
        "weights_bit_exact": all(exact.values()),
    }
    print("\nbars (issue: >= 0.70 of HBM, >= 2.5x bf16):", {k: (round(v, 3) if isinstance(v, float) else v)
                                                          for k, v in bars.items()})
    payload = {"env": info, "copy_GBs": ceiling, "datasheet_TBs": sheet, "rows": rows, "bars": bars,
               "exact": exact, "rotations": AB_ROTATIONS}
    path = save_json(f"packed_gemm_decode_ab_{gpu_tag(info)}{args.tag}.json", payload, args.out)
    print(f"wrote {path}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_args(ap, "fewer shapes")
    ap.add_argument("--sweep", action="store_true", help="time a grid of tile configs at the decode shapes")
    ap.add_argument("--decode-ab", action="store_true",
                    help="only the NVFP4 decode A/B: new vs old kernel vs bf16 vs dequantize (~3 min)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("packed_gemm.py needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.decode_ab:
        return decode_ab(args)
    info, ceiling, sheet = device_header()
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
