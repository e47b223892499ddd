"""GPU check and benchmark of the sm_90 CuTe DSL sparse-attention forward against the reference
and against msakit's Triton KV-outer forward, in the same run.

    OUT=out python tools/bench/sparse_sm90.py                       # check + bench (16K, 128K, 1M)
    OUT=out python tools/bench/sparse_sm90.py --T 16384 131072      # other lengths
    OUT=out python tools/bench/sparse_sm90.py --consumers 1         # another build (sm90.CONFIG's knobs)
    python tools/bench/sparse_sm90.py --compile-only DIR            # no GPU, no torch: PTX + cubin in DIR
    python tools/bench/sparse_sm90.py --union-stats                 # CPU: union size per tile (docs/kernels.md)

CuTe DSL wheels installed with `pip install --target ~/site` are found: ~/site is added to
sys.path (site.addsitedir) before `cutlass` is imported.

Checks (every output NaN-poisoned first and checked fully written; K and V of the blocks no query
selects poisoned with NaN, so a kernel that reads them fails): small shapes (B = 2, ragged T with
a partial last block and tile, -1 padding, repeated ids, rows that select nothing) and the M3 shape
(Hq 64, G 4, D 128, block 128, top-16) at 16K on the three selection kinds (uniform random,
trained-like, real-like), all rows against an fp32 evaluation of `sparse_attention_reference`;
sampled rows at the benchmark lengths.  Benchmark per T and kind: median ms of the sm_90 forward
(work list + kernel, and the kernel alone), of the Triton forward, useful TFLOP/s
(4 * Hq * D * topk * block * T, tools/bench/sparse_attention.py's convention), the union's MMA
work over the useful work, and the peak extra memory.  JSON under $OUT: GPU name, versions, commit.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import site
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if os.path.isdir(os.path.expanduser("~/site")):
    site.addsitedir(os.path.expanduser("~/site"))
M3 = dict(Hq=64, G=4, D=128, block_size=128, topk=16)
KINDS = ("uniform", "trained_like", "real_like")


def compile_only(dump: str) -> dict:
    """Compile the kernel for sm_90a without torch or a GPU (loads kernel.py without msakit's
    package __init__, which imports torch)."""
    for name in ("msakit", "msakit.ops", "msakit.ops.sparse_attention", "msakit.ops.sparse_attention.sm90"):
        if name not in sys.modules:
            mod = types.ModuleType(name)
            mod.__path__ = [str(ROOT / name.replace(".", "/"))]
            sys.modules[name] = mod
    from msakit.ops.sparse_attention.sm90.kernel import compile_check

    return {f"consumers={c},stages={s}": compile_check(os.path.join(dump, f"c{c}s{s}"), consumers=c, stages=s)
            for c, s in ((2, 2), (2, 3), (1, 2))}


def union_stats(Ts=(16384, 131072, 1048576), queries=(4, 8, 16)) -> dict:
    """Mean union size per tile of n queries over the mean valid slots per row, per selection kind
    (CPU, M3 shape)."""
    import torch

    from tools.bench.selection_stats import _canonical, _tile_unions

    out = {}
    for T in Ts:
        for kind in KINDS:
            bi = make_selection(kind, T, torch.device("cpu"), seed=0)
            sel = _canonical(bi.long().reshape(-1, T, bi.shape[-1]))
            slots = float((sel >= 0).sum(-1).float().mean())
            row = {"valid_slots": slots}
            for n in queries:
                u = _tile_unions(sel, n).float()
                row[str(n)] = {"union_mean": float(u.mean()), "over_slots": float(u.mean()) / slots}
            out[f"{kind}@{T}"] = row
            print(kind, T, json.dumps(row), flush=True)
    return out


def make_selection(kind: str, T: int, device, *, seed: int = 0, B: int = 1):
    import torch

    sys.path.insert(0, str(ROOT))
    from benchmarks.selections import real_like_block_idx, trained_like_block_idx
    from tools.bench.sparse_attention import random_block_idx

    G, bs, K = M3["G"], M3["block_size"], M3["topk"]
    if kind == "uniform":
        g = torch.Generator(device=device).manual_seed(seed)
        return random_block_idx(B, G, T, bs, K, g, device)
    if kind == "trained_like":
        return trained_like_block_idx(T, block_size=bs, topk=K, batch=B, groups=G, seed=seed, device=device)
    if kind == "real_like":
        return real_like_block_idx(T, block_size=bs, topk=K, batch=B, groups=G, seed=seed, device=device)
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def poison_unselected(k, v, block_idx, block_size):
    """NaN into K and V of every block no query of its (batch, group) selects (in place)."""
    import torch

    B, T, G, D = k.shape
    nb = -(-T // block_size)
    used = torch.zeros(B, G, nb + 1, dtype=torch.bool, device=k.device)
    flat = torch.where(block_idx >= 0, block_idx.long(), torch.full_like(block_idx.long(), nb)).view(B, G, -1)
    used.scatter_(2, flat, True)
    tok = (~used[:, :, :nb]).repeat_interleave(block_size, dim=2)[:, :, :T].transpose(1, 2)  # [B, T, G]
    k.masked_fill_(tok.unsqueeze(-1), float("nan"))
    v.masked_fill_(tok.unsqueeze(-1), float("nan"))
    return int(tok.sum())


def check_case(name, q, k, v, bi, bs, rows=None) -> dict:
    import torch

    from msakit.ops.sparse_attention import sm90
    from msakit.ops.sparse_attention.reference import sparse_attention_reference
    from tools.bench.common import rel_err
    from tools.bench.sparse_attention import reference_rows

    B, T, Hq, D = q.shape
    scale = 1.0 / math.sqrt(D)
    row = {"case": name, "shape": [B, T, Hq, k.shape[2], D], "block_size": bs}
    try:
        row["poisoned_tokens"] = poison_unselected(k, v, bi, bs)
        o = torch.full_like(q, float("nan"))
        lse = torch.full((B, Hq, T), float("nan"), device=q.device)
        sm90.sparse_attention_fwd_sm90(q, k, v, bi, bs, scale, out=o, lse_out=lse)
        torch.cuda.synchronize()
        row["all_written"] = bool(not torch.isnan(o).any() and not torch.isnan(lse).any())
        if rows is None:
            kf, vf = (torch.nan_to_num(t.float(), nan=0.0) for t in (k, v))  # unselected: never read
            ro, rlse = sparse_attention_reference(q.float(), kf, vf, bi, block_size=bs, return_lse=True)
            row["o_rel_err"] = rel_err(o, ro)
            fin = torch.isfinite(rlse)
            row["lse_inf_match"] = bool(torch.equal(fin, torch.isfinite(lse)))
            row["lse_max_abs_err"] = float((lse - rlse)[fin].abs().max()) if fin.any() else 0.0
        else:
            kf, vf = (torch.nan_to_num(t, nan=0.0) for t in (k, v))
            ro, rlse = reference_rows(q, kf, vf, bi, rows, block_size=bs)
            rr = rows.to(q.device)
            row["o_rel_err"] = rel_err(o[0, rr], ro)
            fin = torch.isfinite(rlse)
            row["lse_max_abs_err"] = float((lse[0][:, rr] - rlse)[fin].abs().max()) if fin.any() else 0.0
            row["check_rows"] = int(rows.numel())
        row["ok"] = bool(row["all_written"] and row["o_rel_err"] < 1e-2 and row["lse_max_abs_err"] < 1e-2
                         and row.get("lse_inf_match", True))
    except Exception as ex:  # report and go on
        row["error"] = f"{type(ex).__name__}: {ex}"[:1000]
        row["ok"] = False
    print(json.dumps(row), flush=True)
    return row


def small_selection(B, G, T, K, bs, gen):
    import torch

    own = (torch.arange(T) // bs).view(1, 1, T, 1)
    bi = (torch.rand(B, G, T, K, generator=gen) * (own + 1)).long()
    bi[..., -1:] = own[..., 0:1]  # forced own block
    bi = torch.where(torch.rand(B, G, T, K, generator=gen) < 0.3, torch.full_like(bi, -1), bi)  # -1 padding
    bi[..., 0] = bi[..., 1]  # repeated ids
    bi[:, :, T // 3] = -1  # a query that selects nothing
    return bi.int()


def run_checks(device) -> list[dict]:
    import torch

    res = []
    D, Hq, G, bs = M3["D"], M3["Hq"], M3["G"], M3["block_size"]
    for B, T, K in ((2, 1000, 16), (1, 333, 4), (2, 2048 + 77, 16)):  # ragged T: partial last block and tile
        gen = torch.Generator().manual_seed(T)
        q, k, v = (torch.randn(B, T, n, D, generator=gen).to(device, torch.bfloat16) for n in (Hq, G, G))
        bi = small_selection(B, G, T, K, bs, gen).to(device)
        res.append(check_case(f"small B={B} T={T} topk={K} (-1 pad, repeats, empty row, causal tail)", q, k, v, bi, bs))
    T = 16384
    for kind in KINDS:
        gen = torch.Generator(device=device).manual_seed(1)
        q = torch.randn(1, T, Hq, D, generator=gen, device=device, dtype=torch.bfloat16)
        k, v = (torch.randn(1, T, G, D, generator=gen, device=device, dtype=torch.bfloat16) for _ in range(2))
        bi = make_selection(kind, T, device)
        res.append(check_case(f"M3 {kind} T={T}", q, k, v, bi, bs))
    return res


def bench(Ts, device, n_rows: int = 128) -> list[dict]:
    import torch

    from msakit.ops.sparse_attention import sm90
    from msakit.ops.sparse_attention import triton as tk
    from tools.bench.common import peak_extra, time_ms
    from tools.bench.sparse_attention import sample_rows

    D, Hq, G, bs, K = M3["D"], M3["Hq"], M3["G"], M3["block_size"], M3["topk"]
    scale = 1.0 / math.sqrt(D)
    out = []
    for T in Ts:
        gen = torch.Generator(device=device).manual_seed(T)
        q = torch.randn(1, T, Hq, D, generator=gen, device=device, dtype=torch.bfloat16)
        k, v = (torch.randn(1, T, G, D, generator=gen, device=device, dtype=torch.bfloat16) for _ in range(2))
        flops = 4.0 * Hq * D * K * bs * T
        for kind in KINDS:
            row = {"T": T, "kind": kind, "config": dict(sm90.CONFIG)}
            try:
                bi = make_selection(kind, T, device)
                queries = 4 * sm90.CONFIG["consumers"]
                wl = sm90.union_worklist(bi, queries, sm90.tile_count(T, bs))
                row["union_over_useful"] = sm90.union_ratio(wl[1], bi)
                row["worklist_ms"] = time_ms(lambda: sm90.union_worklist(bi, queries, sm90.tile_count(T, bs)))
                row["sm90_kernel_ms"] = time_ms(lambda: sm90.sparse_attention_fwd_sm90(q, k, v, bi, bs, scale,
                                                                                       worklist=wl))
                row["sm90_ms"] = time_ms(lambda: sm90.sparse_attention_fwd_sm90(q, k, v, bi, bs, scale))
                peak, res = peak_extra(lambda: sm90.sparse_attention_fwd_sm90(q, k, v, bi, bs, scale))
                row["sm90_peak_extra_GiB"] = (peak - res[0].nbytes - res[1].nbytes) / 2**30
                rows = sample_rows(T, n_rows, bs, torch.Generator().manual_seed(0))
                chk = check_case(f"bench {kind} T={T} (sampled rows)", q, k.clone(), v.clone(), bi, bs, rows=rows)
                row.update({f"check_{key}": val for key, val in chk.items() if key not in ("case", "shape")})
                del res
                row["triton_ms"] = time_ms(lambda: tk.sparse_attention_fwd_triton(q, k, v, bi, None, bs, scale))
                for name in ("sm90", "sm90_kernel", "triton"):
                    row[f"{name}_tflops"] = flops / row[f"{name}_ms"] / 1e9
                row["sm90_speedup_vs_triton"] = row["triton_ms"] / row["sm90_ms"]
                del bi, wl
            except Exception as ex:
                row["error"] = f"{type(ex).__name__}: {ex}"[:1000]
            torch.cuda.empty_cache()
            print(json.dumps(row), flush=True)
            out.append(row)
        del q, k, v
    return out


def versions() -> dict:
    import torch

    v = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name()}
    for mod in ("triton", "cutlass"):
        try:
            v[mod] = getattr(__import__(mod), "__version__", "?")
        except Exception as ex:  # pragma: no cover
            v[mod] = f"unavailable ({type(ex).__name__})"
    try:
        from importlib.metadata import version

        v["nvidia-cutlass-dsl"] = version("nvidia-cutlass-dsl")
    except Exception:
        v["nvidia-cutlass-dsl"] = "?"
    try:
        v["commit"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                                     timeout=10).stdout.strip()
    except Exception:
        v["commit"] = "?"
    return v


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile-only", metavar="DIR", help="compile for sm_90a into DIR and stop (no GPU, no torch)")
    ap.add_argument("--union-stats", action="store_true", help="CPU: union size per tile of 4 / 8 / 16 queries")
    ap.add_argument("--T", type=int, nargs="+", default=[16384, 131072, 1048576], help="benchmark lengths")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--consumers", type=int, default=None, help="consumer warpgroups (default: sm90.CONFIG)")
    ap.add_argument("--stages", type=int, default=None, help="pipeline stages (default: sm90.CONFIG)")
    args = ap.parse_args(argv)
    if args.compile_only:
        print(json.dumps(compile_only(args.compile_only), indent=1))
        return
    sys.path.insert(0, str(ROOT))
    if args.union_stats:
        res = union_stats()
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "union_stats.json").write_text(json.dumps(res, indent=1))
        return
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --compile-only / --union-stats)")
    from msakit.ops.sparse_attention import sm90

    if args.consumers is not None:
        sm90.CONFIG["consumers"] = args.consumers
    if args.stages is not None:
        sm90.CONFIG["stages"] = args.stages
    run_build(args, sm90)


def run_build(args, sm90) -> None:
    """Checks and benchmark of the build sm90.CONFIG names; JSON under $OUT."""
    import torch

    dev = torch.device("cuda")
    rep = {"versions": versions(), "dsl_available": sm90.dsl_available(), "started": time.time()}
    print(json.dumps(rep["versions"]), flush=True)
    out_dir = Path(os.environ.get("OUT", "."))
    tag = f"c{sm90.CONFIG['consumers']}s{sm90.CONFIG['stages']}"
    path = out_dir / f"sparse_sm90_{rep['versions']['gpu'].replace(' ', '_')}_{tag}.json"

    def save():
        path.write_text(json.dumps(rep, indent=1))

    t0 = time.time()
    try:
        from msakit.ops.sparse_attention.sm90 import kernel  # noqa: F401  (import errors show here)
    except Exception as ex:
        rep["error"] = f"kernel import: {type(ex).__name__}: {ex}"
        save()
        raise
    if not args.skip_checks:
        rep["checks"] = run_checks(dev)
        rep["checks_ok"] = all(r["ok"] for r in rep["checks"])
        rep["check_s"] = time.time() - t0
        save()
    rep["bench"] = bench(args.T, dev)
    save()
    print(f"{'T':>8} {'kind':>13} {'union':>6} {'sm90 ms':>9} {'TF/s':>6} {'kernel TF/s':>11} {'triton ms':>9} "
          f"{'TF/s':>6} {'speedup':>7} {'ok':>3}")
    for r in rep["bench"]:
        if "error" in r:
            print(f"{r['T']:>8} {r['kind']:>13} error: {r['error'][:120]}")
            continue
        print(f"{r['T']:>8} {r['kind']:>13} {r['union_over_useful']:>6.2f} {r['sm90_ms']:>9.2f} {r['sm90_tflops']:>6.0f} "
              f"{r['sm90_kernel_tflops']:>11.0f} {r['triton_ms']:>9.2f} {r['triton_tflops']:>6.0f} "
              f"{r['sm90_speedup_vs_triton']:>7.2f} {str(r.get('check_ok')):>3}")
    print("results:", path)


if __name__ == "__main__":
    main()
