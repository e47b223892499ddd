"""GPU check and benchmark of the sm_90 CuTe DSL sparse-attention backward against the
reference's autograd and against msakit's Triton KV-outer backward, in the same run.

    OUT=out python tools/bench/sparse_sm90_bwd.py               # checks + bench at 16K and 128K
    OUT=out python tools/bench/sparse_sm90_bwd.py --quick       # small checks + 16K only (< 3 min)
    python tools/bench/sparse_sm90_bwd.py --compile-only DIR    # no GPU, no torch: PTX + cubin in DIR,
                                                                # registers / stack frame (spills)
    OUT=out python tools/bench/sparse_sm90_bwd.py --diag-only   # layout / pipeline diagnostics (< 1 min)
    OUT=out python tools/bench/sparse_sm90_bwd.py --diag --quick  # diagnostics, then the quick run

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



# ---------------------------------------------------------------------------------------------- --diag
# One GPU call that localises a layout / pipeline error of the kernel: hand-made work lists (one
# item of one m-block, causal + mask bits, 32 m-blocks over three items, the ragged tail), the
# kernel launched directly (`sm90._launch_bwd`: own lse2 and delta, distinct per row), the raw
# accumulators (dK without the softmax scale) against a float64 torch replay of the same items;
# relative L2 error per group of the MMA fragment coordinates (key half = consumer warpgroup,
# warp = 16-key slab, r = +8 row of the accumulator, v = 8-column chunk, c0 = column parity,
# qi = query of the m-block) and three one-hot probes that read an intermediate out exactly:
# dO[row, d] = [d == row] gives dV[key, row] = P^T (bf16), Q[row, d < 64] = [d == row] gives
# dK[key, row] = dS^T, K[key, d] = [d == key] gives dQ[row, key] = dS.  A wrong entry of a probe
# is matched to the reference entries of equal value: the most common (dkey, drow) offsets name
# the permutation (e.g. (+8, -1) / (-8, +1): r and c0 swapped).

DIAG_T, DIAG_G = 259, 2  # ragged: a partial last key block (keys 256..258) and m-block (query 259)
DIAG_HANG_S = 30  # the first launch compiles (outside this wait); a launch of < 300 tiles takes ms


class DiagHang(Exception):
    pass


def _diag_reference(q, k, v, do, lse2, delta, items, ent, scale_log2: float):
    """float64 replay of the kernel over (items, ent): (dq, dk, dv) without the softmax scale
    ([B, T, Hq, D], [B, T, G, D] x 2) and (P^T, dS^T) [128 keys, 64 rows] of the first entry."""
    import torch

    B, T, Hq, D = q.shape
    G = k.shape[2]
    f, dev = torch.float64, q.device
    dq = torch.zeros(B, T, Hq, D, dtype=f, device=dev)
    dk = torch.zeros(B, T, G, D, dtype=f, device=dev)
    dv = torch.zeros(B, T, G, D, dtype=f, device=dev)
    rows = torch.arange(64, device=dev)
    first = None
    for bg, blk, start, n in items.tolist():
        b, g = bg // G, bg % G
        keys = torch.arange(blk * 128, blk * 128 + 128, device=dev)
        inb = keys < T
        kk = torch.zeros(128, D, dtype=f, device=dev)
        vv = torch.zeros(128, D, dtype=f, device=dev)
        kk[inb], vv[inb] = k[b, keys[inb], g].double(), v[b, keys[inb], g].double()
        dkb, dvb = torch.zeros_like(kk), torch.zeros_like(vv)
        for e in ent[start:start + n].tolist():
            mb, mask = e >> 4, e & 15
            t = mb * 4 + rows // 16
            h = g * 16 + rows % 16
            ok_t = t < T
            tc = t.clamp(max=T - 1)
            qm = q[b, tc, h].double() * ok_t[:, None]
            dom = do[b, tc, h].double() * ok_t[:, None]
            l2 = lse2[b, tc, h].double() * ok_t
            dl = delta[b, tc, h].double() * ok_t
            st = kk @ qm.T
            ok = ((mask >> (rows // 16)) & 1).bool()[None, :] & (keys[:, None] <= t[None, :])
            pt = torch.where(ok, torch.exp2(st * scale_log2 - l2[None, :]), torch.zeros_like(st))
            dst = pt * (vv @ dom.T - dl[None, :])
            dvb += pt @ dom
            dkb += dst @ qm
            dq[b, t[ok_t], h[ok_t]] += (dst.T @ kk)[ok_t]
            if first is None:
                first = (pt, dst)
        dk[b, keys[inb], g] += dkb[inb]
        dv[b, keys[inb], g] += dvb[inb]
    return dq, dk, dv, first


def _diag_launch(q, k, v, do, lse2, delta, items, ent, scale: float):
    """The kernel on hand-made (items, ent): raw (dq, dk, dv) fp32 (dq, dk without the scale)."""
    import torch

    from msakit.ops.sparse_attention import sm90
    from msakit.ops.sparse_attention.sm90.worklist_bwd import dq_from_accum, mblock_count

    B, T, Hq, D = q.shape
    G = k.shape[2]
    nmb = mblock_count(T)
    dq_acc = torch.zeros(B * G * nmb * 16 * 4 * D, dtype=torch.float32, device=q.device)
    dk = torch.zeros(B, T, G, D, dtype=torch.float32, device=q.device)
    dv = torch.zeros_like(dk)
    sm90._launch_bwd(q, k, v, do, lse2, delta, dq_acc, dk, dv, items, ent, scale)
    done = torch.cuda.Event()
    done.record()
    t0 = time.time()
    while not done.query():  # a deadlocked kernel: say which case, not the device call's timeout
        if time.time() - t0 > DIAG_HANG_S:
            raise DiagHang(f"kernel not done after {DIAG_HANG_S} s")
        time.sleep(0.005)
    return dq_from_accum(dq_acc.view(B, G, nmb, 2, 64, 64), B, G, T, 16, D), dk, dv


def _group_errs(got, want, axis_labels: dict) -> str:
    """'name e0 e1 ..' per labelling: relative L2 error of got vs want [..., M, N] over the
    entries whose label (along axis -2 for 'm:' names, -1 for 'n:' names) is each value."""
    out = []
    for name, lab in axis_labels.items():
        ax = -2 if name.startswith("m:") else -1
        errs = []
        for val in range(int(lab.max()) + 1):
            sel = (lab == val)
            gg, ww = got.index_select(ax, sel.nonzero()[:, 0]), want.index_select(ax, sel.nonzero()[:, 0])
            errs.append(float((gg - ww).norm() / ww.norm().clamp(min=1e-30)))
        out.append(name[2:] + " " + " ".join(f"{x:.0e}" for x in errs))
    return "; ".join(out)


def _kv_tiles(x, items, G, T):
    """[I, 128, D] tiles (keys past T zero) of x [B, T, G, D] at each distinct item's (b, g, blk)."""
    import torch

    tiles = []
    for bg, blk in sorted({(r[0], r[1]) for r in items.tolist()}):
        t = torch.zeros(128, x.shape[-1], dtype=x.dtype, device=x.device)
        n = min(128, T - blk * 128)
        t[:n] = x[bg // G, blk * 128:blk * 128 + n, bg % G]
        tiles.append(t)
    return torch.stack(tiles)


def _q_tiles(x, items, ent, G, T):
    """[J, 64, D] m-block tiles (rows query-in-m-block * 16 + head; past T zero) of x [B, T, Hq, D]
    at each distinct (b, g, mb) of the work list."""
    import torch

    keys = set()
    for bg, blk, start, n in items.tolist():
        for e in ent[start:start + n].tolist():
            keys.add((bg, e >> 4))
    rows = torch.arange(64, device=x.device)
    tiles = []
    for bg, mb in sorted(keys):
        t, h = mb * 4 + rows // 16, (bg % G) * 16 + rows % 16
        ok = t < T
        tile = torch.zeros(64, x.shape[-1], dtype=x.dtype, device=x.device)
        tile[ok] = x[bg // G, t[ok], h[ok]]
        tiles.append(tile)
    return torch.stack(tiles)


def _outside(err_all, err_tiles) -> float:
    """L2 norm of the error outside the work list's tiles (writes where none belong)."""
    return max(0.0, float(err_all.norm()) ** 2 - float(err_tiles.norm()) ** 2) ** 0.5


def _votes(got, want, rel_tol: float = 2e-2) -> str:
    """Agreement of a probe's got vs want [M, N] (bf16-exact values); for the wrong entries the
    most common (dm, dn) from each to the reference entries of equal value (bf16 ulp)."""
    import torch

    scale = float(want.abs().max())
    bad = (got - want).abs() > rel_tol * want.abs() + 1e-3 * scale
    nbad = int(bad.sum())
    if nbad == 0:
        return "exact"
    M, N = want.shape
    zero = int(((got == 0) & bad).sum())
    wv, gv = want.flatten(), got.flatten()
    order = wv.argsort()
    ws = wv[order]
    p = bad.flatten().nonzero()[:, 0]
    g = gv[p]
    tol = g.abs() * 2.0 ** -8 + 1e-12 * scale
    lo = torch.searchsorted(ws, g - tol)
    hi = torch.searchsorted(ws, g + tol, right=True)
    cnt = (hi - lo).clamp(max=64)
    keep = cnt > 0
    p, lo, cnt = p[keep], lo[keep], cnt[keep]
    if p.numel() == 0:
        return f"{nbad}/{M * N} wrong ({zero} zero), no equal values in the reference"
    rep = torch.repeat_interleave(torch.arange(p.numel(), device=p.device), cnt)
    off = torch.arange(rep.numel(), device=p.device) - torch.repeat_interleave(torch.cumsum(cnt, 0) - cnt, cnt)
    qpos = order[lo[rep] + off]
    pp = p[rep]
    dm, dn = qpos // N - pp // N, qpos % N - pp % N
    pairs, counts = torch.unique(torch.stack([dm, dn], 1), dim=0, return_counts=True)
    top = counts.argsort(descending=True)[:4]
    modes = " ".join(f"({int(pairs[i, 0])},{int(pairs[i, 1])}):{float(counts[i]) / p.numel():.2f}" for i in top)
    return f"{nbad}/{M * N} wrong ({zero} zero); offsets to equal reference values {modes}"


def run_diag(device, res: list | None = None) -> list[dict]:
    """The --diag cases (module comment above); prints one compact block per case (the groups'
    errors only where a result is wrong), rows appended to res (kept when a launch hangs)."""
    import torch

    D, hpg, G, T, B = 128, 16, DIAG_G, DIAG_T, 1
    Hq = G * hpg
    scale = 1.0 / math.sqrt(D)
    sl2 = scale * 1.4426950408889634
    i32 = dict(dtype=torch.int32, device=device)
    full = [(mb << 4) | 15 for mb in range(32, 64)]
    cases = {
        "A one m-block (g 1, blk 0, queries 128-131, every key)": ([[1, 0, 0, 1]], [(32 << 4) | 15]),
        "B causal + mask 1011 (g 1, blk 1, queries 160-163)": ([[1, 1, 0, 1]], [(40 << 4) | 0b1011]),
        "C ragged (g 1, blk 2: keys 256-258, queries 256-259 mask 0111)": ([[1, 2, 0, 1]], [(64 << 4) | 0b0111]),
        "D 3 items x 32 m-blocks (g 0/1 blk 0, g 1 blk 1: stages, dQ reduce adds)":
            ([[0, 0, 0, 32], [1, 0, 32, 32], [1, 1, 64, 32]], full * 3),
    }
    gen = torch.Generator(device=device).manual_seed(7)

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * s)

    base = dict(q=rnd(B, T, Hq, D).bfloat16(), k=rnd(B, T, G, D).bfloat16(), v=rnd(B, T, G, D).bfloat16(),
                do=rnd(B, T, Hq, D).bfloat16(), lse2=(8.0 + rnd(B, T, Hq)).contiguous(),
                delta=rnd(B, T, Hq, s=4.0).contiguous())
    key_lab = torch.arange(128, device=device)
    row_lab = torch.arange(64, device=device)
    d_lab = torch.arange(D, device=device)
    kv_groups = {"m:keyhalf": key_lab // 64, "m:warp": (key_lab % 64) // 16, "m:r": (key_lab % 16) // 8,
                 "n:dhalf": d_lab // 64, "n:v": (d_lab % 64) // 8, "n:c0": d_lab % 2}
    q_groups = {"m:qi": row_lab // 16, "m:r": (row_lab % 16) // 8,  # warp w of a warpgroup holds rows of query w
                "n:dhalf": d_lab // 64, "n:v": (d_lab % 64) // 8, "n:c0": d_lab % 2}
    res = [] if res is None else res

    def one(name, t, items_l, ent_l, probe=None):
        items, ent = torch.tensor(items_l, **i32), torch.tensor(ent_l, **i32)
        row = {"diag": name}
        try:
            got = _diag_launch(t["q"], t["k"], t["v"], t["do"], t["lse2"], t["delta"], items, ent, scale)
            want_dq, want_dk, want_dv, first = _diag_reference(t["q"], t["k"], t["v"], t["do"], t["lse2"],
                                                               t["delta"], items, ent, sl2)
            lines = [f"== {name}"]
            for nm, g_, w_ in (("dV", got[2], want_dv), ("dK", got[1], want_dk)):
                gt, wt = _kv_tiles(g_.double(), items, G, T), _kv_tiles(w_, items, G, T)
                row[f"{nm}_rel"] = rel = float((gt - wt).norm() / wt.norm().clamp(min=1e-30))
                row[f"{nm}_finite"] = fin = bool(torch.isfinite(g_).all())
                outside = _outside(g_.double() - w_, gt - wt)
                lines.append(f"  {nm} rel {rel:.1e} finite {fin} outside {outside:.1e}"
                             + (" | " + _group_errs(gt, wt, kv_groups) if rel >= 2e-2 else ""))
            gq, wq = _q_tiles(got[0].double(), items, ent, G, T), _q_tiles(want_dq, items, ent, G, T)
            row["dQ_rel"] = rel = float((gq - wq).norm() / wq.norm().clamp(min=1e-30))
            row["dQ_finite"] = fin = bool(torch.isfinite(got[0]).all())
            outside = _outside(got[0].double() - want_dq, gq - wq)
            lines.append(f"  dQ rel {rel:.1e} finite {fin} outside {outside:.1e}"
                         + (" | " + _group_errs(gq, wq, q_groups) if rel >= 2e-2 else ""))
            if probe is not None:
                pt, dst = first
                bg, blk = items_l[0][0], items_l[0][1]
                b, g = bg // G, bg % G
                if probe == "P":  # dV[key, row] = P^T (bf16)
                    gp = got[2][b, blk * 128:blk * 128 + 128, g, :64].double()
                    wp = pt.to(torch.bfloat16).double()
                elif probe == "dS_dK":  # dK[key, row] = dS^T (bf16)
                    gp = got[1][b, blk * 128:blk * 128 + 128, g, :64].double()
                    wp = dst.to(torch.bfloat16).double()
                else:  # dQ[row, key] = dS (bf16), as [key, row]
                    gp = _q_tiles(got[0].double(), items, ent, G, T)[0].T
                    wp = dst.to(torch.bfloat16).double()
                row["probe"] = _votes(gp, wp)
                lines.append(f"  probe {probe} ({'key x row'}): {row['probe']}")
            row["ok"] = all(row[f"{x}_rel"] < 2e-2 and row[f"{x}_finite"] for x in ("dV", "dK", "dQ"))
            print("\n".join(lines), flush=True)
        except Exception as ex:
            row["error"] = f"{type(ex).__name__}: {ex}"[:1000]
            row["ok"] = False
            print(f"== {name}: ERROR {row['error']}", flush=True)
            if isinstance(ex, DiagHang):
                res.append(row)
                raise
        res.append(row)

    for name, (it, en) in cases.items():
        one(name, base, it, en)
    # one-hot probes on case A's item (b 0, g 1, blk 0, m-block 32): rows of the m-block
    it, en = cases[next(iter(cases))]
    rows = torch.arange(64, device=device)
    t_rows, h_rows = 32 * 4 + rows // 16, 16 + rows % 16
    eye = torch.eye(64, D, device=device)
    p = {**base, "do": base["do"].clone()}
    p["do"][0, t_rows, h_rows] = eye.bfloat16()
    one("probe P: dO one-hot -> dV = P^T", p, it, en, probe="P")
    p = {**base, "q": base["q"].clone()}
    qr = p["q"][0, t_rows, h_rows]
    qr[:, :64] = eye[:, :64].bfloat16()
    p["q"][0, t_rows, h_rows] = qr
    one("probe dS via dK: Q[:, :64] one-hot -> dK = dS^T", p, it, en, probe="dS_dK")
    p = {**base, "k": base["k"].clone()}
    p["k"][0, :128, 1] = torch.eye(128, D, device=device).bfloat16()
    one("probe dS via dQ: K one-hot -> dQ = dS", p, it, en, probe="dS_dQ")
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile-only", metavar="DIR", help="compile for sm_90a into DIR and stop (no GPU, no torch)")
    ap.add_argument("--quick", action="store_true", help="small checks, one 16K check and the 16K bench only")
    ap.add_argument("--T", type=int, nargs="+", default=None, help="benchmark lengths (default 16K 128K)")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--stages", type=int, default=None, help="Q / dO pipeline stages (default: sm90.CONFIG_BWD)")
    ap.add_argument("--diag", action="store_true", help="first the layout / pipeline diagnostics (hand-made work "
                    "lists, per-fragment-group errors, one-hot probes; < 1 min), then the rest")
    ap.add_argument("--diag-only", action="store_true", help="the diagnostics only")
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
    if args.diag or args.diag_only:
        rep["diag"] = []
        try:
            rep["diag"] = run_diag(dev, rep["diag"])
        except DiagHang:  # the context is stuck: record and leave without waiting for the device
            rep["diag_ok"] = False
            save()
            print("diag: kernel hang; json:", path, flush=True)
            os._exit(3)
        rep["diag_ok"] = all(r["ok"] for r in rep["diag"])
        print("diag ok:", rep["diag_ok"], flush=True)
        save()
        if args.diag_only:
            print("json:", path)
            return
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
