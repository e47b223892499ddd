"""GPU check and benchmark of the sm_90 CuTe DSL sparse-attention backward against the
reference's autograd and against msakit's Triton KV-outer backward, in the same run.

    OUT=out python tools/bench/sparse_sm90_bwd.py               # checks + bench at 16K and 128K
    OUT=out python tools/bench/sparse_sm90_bwd.py --quick       # small checks + 16K only (< 3 min)
    python tools/bench/sparse_sm90_bwd.py --compile-only DIR    # no GPU, no torch: PTX + cubin in DIR,
                                                                # registers / stack frame (spills)

CuTe DSL wheels installed with `pip install --target ~/site` are found: ~/site is added to
sys.path (site.addsitedir) before `cutlass` is imported.

Checks (each case on its own, an error or a timeout recorded and the run goes on): small shapes
(B = 2, ragged T with a partial last block and m-block, -1 padding, repeated ids, a row that
selects nothing, K and V of every unselected block NaN-poisoned) and the M3 shape (Hq 64, G 4,
D 128, block 128, top-16) at 16K on the three selection kinds; dq, dk, dv of the sm_90 kernel
(given o and lse of the fp32 reference) against the reference's fp32 autograd, relative L2
error and finiteness.  Benchmark per T and kind: median ms of the sm_90 backward (work list +
preprocessing + kernel + conversions, and with the work list prebuilt), of the Triton backward
(`sparse_attention_bwd_triton`), useful TFLOP/s (2.5 x the forward's 4 * Hq * D * topk * block *
T, tools/bench/sparse_attention.py's convention), the work list's m-blocks over the useful rows,
and the sm_90 result against the Triton one (relative L2).  JSON under $OUT.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import site
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if os.path.isdir(os.path.expanduser("~/site")):
    site.addsitedir(os.path.expanduser("~/site"))
sys.path.insert(0, str(ROOT))
M3 = dict(Hq=64, G=4, D=128, block_size=128, topk=16)
KINDS = ("uniform", "trained_like", "real_like")


def cubin_resources(path: str) -> dict:
    """Registers (the launch allotment: with setmaxnreg, 65536 / threads) and stack frame bytes
    (> 0: spills) of each kernel of a cubin, from its .nv.info attributes (EIATTR_REGCOUNT 0x2f,
    EIATTR_FRAME_SIZE 0x11)."""
    import struct

    data = open(path, "rb").read()
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    secs = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    stro = secs[shstrndx][4]
    out = {}
    for name, _, _, _, off, size in secs:
        n = data[stro + name:data.index(b"\0", stro + name)].decode()
        if n != ".nv.info":
            continue
        p = off
        while p < off + size:
            fmt, attr = data[p], data[p + 1]
            p += 2
            if fmt == 4:
                sz, = struct.unpack_from("<H", data, p)
                val = data[p + 2:p + 2 + sz]
                p += 2 + sz
                if attr in (0x2F, 0x11) and sz == 8:
                    fn, v = struct.unpack("<II", val)
                    out.setdefault(f"function {fn}", {})["registers" if attr == 0x2F else "stack_frame_bytes"] = v
            elif fmt == 3:
                p += 2
            elif fmt == 2:
                p += 1
    return out


def compile_only(dump: str) -> dict:
    """Compile the kernel for sm_90a without torch or a GPU (loads kernel_bwd.py without msakit's
    package __init__, which imports torch); registers and spills from the cubin, and from ptxas -v
    where a ptxas is on PATH."""
    import glob
    import shutil
    import subprocess

    for name in ("msakit", "msakit.ops", "msakit.ops.sparse_attention", "msakit.ops.sparse_attention.sm90"):
        if name not in sys.modules:
            mod = types.ModuleType(name)
            mod.__path__ = [str(ROOT / name.replace(".", "/"))]
            sys.modules[name] = mod
    from msakit.ops.sparse_attention.sm90.kernel_bwd import compile_check_bwd

    res = {}
    for stages in (2,):
        d = os.path.join(dump, f"s{stages}")
        r = compile_check_bwd(d, stages=stages)
        for f in glob.glob(os.path.join(d, "*.cubin")):
            r["cubin"] = cubin_resources(f)
        ptxas = shutil.which("ptxas")
        for f in glob.glob(os.path.join(d, "*.ptx")):
            text = open(f).read()
            r["wgmma"] = text.count("wgmma.mma_async")
            if ptxas:
                p = subprocess.run([ptxas, "-arch=sm_90a", "-v", f, "-o", os.devnull], capture_output=True, text=True)
                r["ptxas_v"] = [ln.strip() for ln in p.stderr.splitlines() if "registers" in ln or "spill" in ln]
        res[f"stages={stages}"] = r
    return res


class CaseTimeout(Exception):
    pass


def _alarm(seconds: int):
    def handler(signum, frame):
        raise CaseTimeout(f"case over {seconds} s")

    signal.signal(signal.SIGALRM, handler)
    signal.alarm(seconds)


def check_case(name, q, k, v, do, bi, bs, timeout_s: int = 240) -> dict:
    import torch

    from msakit.ops.sparse_attention import sm90
    from msakit.ops.sparse_attention.reference import sparse_attention_reference
    from tools.bench.common import rel_err
    from tools.bench.sparse_sm90 import poison_unselected

    B, T, Hq, D = q.shape
    scale = 1.0 / math.sqrt(D)
    row = {"case": name, "shape": [B, T, Hq, k.shape[2], D], "block_size": bs}
    t0 = time.time()
    try:
        _alarm(timeout_s)
        row["poisoned_tokens"] = poison_unselected(k, v, bi, bs)
        qf = q.float().requires_grad_(True)
        kf, vf = (torch.nan_to_num(t.float(), nan=0.0).requires_grad_(True) for t in (k, v))  # unselected: never read
        ro, rlse = sparse_attention_reference(qf, kf, vf, bi, block_size=bs, softmax_scale=scale, return_lse=True)
        rdq, rdk, rdv = torch.autograd.grad(ro, (qf, kf, vf), do.float())
        o = ro.detach().to(torch.bfloat16)
        lse = rlse.detach()
        del ro, rlse, qf, kf, vf
        dq, dk, dv = sm90.sparse_attention_bwd_sm90(do, q, k, v, o, lse, bi, bs, scale)
        torch.cuda.synchronize()
        row["finite"] = bool(torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all())
        for nm, got, want in (("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
            row[f"{nm}_rel_err"] = rel_err(got, want)
        row["ok"] = bool(row["finite"] and all(row[f"{nm}_rel_err"] < 2e-2 for nm in ("dq", "dk", "dv")))
    except Exception as ex:  # report and go on
        row["error"] = f"{type(ex).__name__}: {ex}"[:1000]
        row["ok"] = False
    finally:
        signal.alarm(0)
    row["seconds"] = time.time() - t0
    print(json.dumps(row), flush=True)
    return row


def run_checks(device, quick: bool) -> list[dict]:
    import torch

    from tools.bench.sparse_sm90 import make_selection, small_selection

    res = []
    D, Hq, G, bs = M3["D"], M3["Hq"], M3["G"], M3["block_size"]
    small = ((2, 1000, 16), (1, 333, 4), (2, 2048 + 77, 16))
    for B, T, K in small:  # ragged T: a partial last block and m-block
        gen = torch.Generator().manual_seed(T)
        q, k, v, do = (torch.randn(B, T, n, D, generator=gen).to(device, torch.bfloat16) for n in (Hq, G, G, Hq))
        bi = small_selection(B, G, T, K, bs, gen).to(device)
        res.append(check_case(f"small B={B} T={T} topk={K} (-1 pad, repeats, empty row, NaN unselected)",
                              q, k, v, do, bi, bs))
    T = 16384
    for kind in KINDS[:1] if quick else KINDS:
        gen = torch.Generator(device=device).manual_seed(1)
        q, do = (torch.randn(1, T, Hq, D, generator=gen, device=device, dtype=torch.bfloat16) for _ in range(2))
        k, v = (torch.randn(1, T, G, D, generator=gen, device=device, dtype=torch.bfloat16) for _ in range(2))
        res.append(check_case(f"M3 {kind} T={T}", q, k, v, do, make_selection(kind, T, device), bs))
        q = k = v = do = None
        torch.cuda.empty_cache()
    return res


def bench(Ts, device, timeout_s: int = 300) -> list[dict]:
    import torch

    from msakit.ops.sparse_attention import sm90
    from msakit.ops.sparse_attention import triton as tk
    from msakit.ops.sparse_attention.sm90.worklist_bwd import bwd_worklist
    from tools.bench.common import rel_err, time_ms
    from tools.bench.sparse_sm90 import make_selection

    D, Hq, G, bs, K = M3["D"], M3["Hq"], M3["G"], M3["block_size"], M3["topk"]
    scale = 1.0 / math.sqrt(D)
    out = []
    for T in Ts:
        gen = torch.Generator(device=device).manual_seed(T)
        q, do = (torch.randn(1, T, Hq, D, generator=gen, device=device, dtype=torch.bfloat16) for _ in range(2))
        k, v = (torch.randn(1, T, G, D, generator=gen, device=device, dtype=torch.bfloat16) for _ in range(2))
        flops = 2.5 * 4.0 * Hq * D * K * bs * T
        nb = -(-T // bs)
        for kind in KINDS:
            row = {"T": T, "kind": kind, "config": dict(sm90.CONFIG_BWD)}
            t0 = time.time()
            try:
                _alarm(timeout_s)
                bi = make_selection(kind, T, device)
                o, lse = tk.sparse_attention_fwd_triton(q, k, v, bi, None, bs, scale)
                wl = bwd_worklist(bi, nb)
                row["mblocks_over_useful"] = float(wl[0][:, 3].sum()) * 4 / max(1.0, float((bi >= 0).sum()))
                row["items"] = int(wl[0].shape[0])
                row["worklist_ms"] = time_ms(lambda: bwd_worklist(bi, nb))
                row["sm90_kernel_ms"] = time_ms(lambda: sm90.sparse_attention_bwd_sm90(do, q, k, v, o, lse, bi, bs,
                                                                                      scale, worklist=wl))
                row["sm90_ms"] = time_ms(lambda: sm90.sparse_attention_bwd_sm90(do, q, k, v, o, lse, bi, bs, scale))
                row["triton_ms"] = time_ms(lambda: tk.sparse_attention_bwd_triton(do, q, k, v, o, lse, None, bi, None,
                                                                                 bs, scale))
                for name in ("sm90", "sm90_kernel", "triton"):
                    row[f"{name}_tflops"] = flops / row[f"{name}_ms"] / 1e9
                row["sm90_speedup_vs_triton"] = row["triton_ms"] / row["sm90_ms"]
                got = sm90.sparse_attention_bwd_sm90(do, q, k, v, o, lse, bi, bs, scale, worklist=wl)
                want = tk.sparse_attention_bwd_triton(do, q, k, v, o, lse, None, bi, None, bs, scale)
                for nm, a, b in zip(("dq", "dk", "dv"), got, want):
                    row[f"{nm}_rel_err_vs_triton"] = rel_err(a, b)
                bi = o = lse = wl = got = want = None  # free before the next case
            except Exception as ex:
                row["error"] = f"{type(ex).__name__}: {ex}"[:1000]
            finally:
                signal.alarm(0)
            row["seconds"] = time.time() - t0
            torch.cuda.empty_cache()
            print(json.dumps(row), flush=True)
            out.append(row)
        q = k = v = do = None
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile-only", metavar="DIR", help="compile for sm_90a into DIR and stop (no GPU, no torch)")
    ap.add_argument("--quick", action="store_true", help="small checks, one 16K check and the 16K bench only")
    ap.add_argument("--T", type=int, nargs="+", default=None, help="benchmark lengths (default 16K 128K)")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--stages", type=int, default=None, help="Q / dO pipeline stages (default: sm90.CONFIG_BWD)")
    args = ap.parse_args(argv)
    if args.compile_only:
        print(json.dumps(compile_only(args.compile_only), indent=1))
        return
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --compile-only)")
    from msakit.ops.sparse_attention import sm90
    from tools.bench.sparse_sm90 import versions

    if args.stages is not None:
        sm90.CONFIG_BWD["stages"] = args.stages
    Ts = args.T or ([16384] if args.quick else [16384, 131072])
    dev = torch.device("cuda")
    rep = {"versions": versions(), "dsl_available": sm90.dsl_available(), "started": time.time(), "quick": args.quick}
    print(json.dumps(rep["versions"]), flush=True)
    out_dir = Path(os.environ.get("OUT", "."))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"sparse_sm90_bwd_{rep['versions']['gpu'].replace(' ', '_')}_s{sm90.CONFIG_BWD['stages']}.json"

    def save():
        path.write_text(json.dumps(rep, indent=1))

    try:
        from msakit.ops.sparse_attention.sm90 import kernel_bwd  # noqa: F401  (import errors show here)
    except Exception as ex:
        rep["error"] = f"kernel import: {type(ex).__name__}: {ex}"
        save()
        raise
    t0 = time.time()
    if not args.skip_checks:
        rep["checks"] = run_checks(dev, args.quick)
        rep["checks_ok"] = all(r["ok"] for r in rep["checks"])
        rep["check_s"] = time.time() - t0
        save()
    rep["bench"] = bench(Ts, dev)
    save()
    print(f"{'T':>8} {'kind':>13} {'mb/useful':>9} {'sm90 ms':>9} {'TF/s':>6} {'kernel TF/s':>11} {'triton ms':>9} "
          f"{'TF/s':>6} {'speedup':>7} {'dq err':>8}")
    for r in rep["bench"]:
        if "error" in r:
            print(f"{r['T']:>8} {r['kind']:>13} error: {r['error'][:120]}")
            continue
        print(f"{r['T']:>8} {r['kind']:>13} {r['mblocks_over_useful']:>9.2f} {r['sm90_ms']:>9.3f} "
              f"{r['sm90_tflops']:>6.1f} {r['sm90_kernel_tflops']:>11.1f} {r['triton_ms']:>9.3f} "
              f"{r['triton_tflops']:>6.1f} {r['sm90_speedup_vs_triton']:>7.2f} {r['dq_rel_err_vs_triton']:>8.1e}")
    if "checks" in rep:
        print("checks ok:", rep["checks_ok"], [(r["case"], r["ok"]) for r in rep["checks"]])
    print("json:", path)


if __name__ == "__main__":
    main()
