"""GPU check and benchmark of the KV-outer Triton `sparse_attention` (imports on CPU; runs on CUDA).

    from msakit.ops.sparse_attention.bench import check_and_bench
    rows = check_and_bench()        # T = 16K .. 1M at the M3 shape (Hq=64, G=4, D=128, bs=128, topk=16)

Per T: random bf16 inputs and a random valid selection (`random_block_idx`), the forward checked
against an fp32 evaluation of the reference's meaning (all rows at T <= full_check_T, sampled rows
above: `reference_rows`), the backward against fp32 autograd of the reference at T <= bwd_check_T,
every output poisoned with NaN first (and the kernels' internal partial buffers too) and checked
to be fully written, median times of the forward and of forward + backward, effective TFLOP/s
(forward 4*Hq*D*topk*bs*T, backward 2.5x that) and the peak extra memory.  With sweep=True the
kernel configs of `triton.FWD_CONFIGS` / `BWD_CONFIGS` are timed first at sweep_T and the fastest
are used for the rest (reported as rows with "sweep" set).

A/B of the session-3 variants (merge kernels, work-list builders, forward configs, overlap),
with correctness checks, one table per T (the lead's GPU call):

    from msakit.ops.sparse_attention.bench import ab_run
    ab_run((16384, 131072))

`compile_report()` compiles every kernel variant for sm_90 without a GPU (registers, spills,
shared memory, SASS counts).
"""

from __future__ import annotations

import math
import time

import torch

from .._bench import peak_extra as _peak_extra
from .._bench import rel_err
from .._bench import time_ms as _time_ms
from .reference import sparse_attention_reference

M3_SHAPE = dict(Hq=64, G=4, D=128, block_size=128, topk=16)


# ----------------------------------------------------------------------------- inputs

def random_block_idx(
    B: int, G: int, T: int, block_size: int, topk: int, generator: torch.Generator | None = None, device=None
) -> torch.Tensor:
    """A random valid selection, int32 [B, G, T, topk].

    Row (b, g, i): min(topk - 1, own) distinct random blocks among 0 .. own - 1 (own = i //
    block_size), then the own block (the last valid entry, as the top-k contract says), then -1.
    Floyd's sampling, vectorised over rows: O(rows * topk^2), fine at T = 1M on a GPU.
    """
    dev = torch.device(device) if device is not None else (generator.device if generator is not None else torch.device("cpu"))
    R = B * G * T
    own = (torch.arange(T, device=dev) // block_size).repeat(B * G)  # [R]
    m = topk - 1
    picks = torch.full((R, max(m, 1)), -1, dtype=torch.int64, device=dev)
    for kk in range(m):
        j = own - m + kk  # Floyd: draw t in [0, j]; if taken, take j
        u = torch.rand(R, generator=generator, device=dev)
        t = torch.minimum((u * (j + 1).clamp(min=1)).long(), j.clamp(min=0))
        taken = (picks[:, :kk] == t[:, None]).any(dim=1) if kk else torch.zeros_like(t, dtype=torch.bool)
        picks[:, kk] = torch.where(j >= 0, torch.where(taken, j, t), torch.full_like(t, -1))
    picks = picks[:, :m].sort(dim=1, descending=True).values  # valid first
    nvalid = (picks >= 0).sum(dim=1, keepdim=True)
    out = torch.full((R, topk), -1, dtype=torch.int64, device=dev)
    out[:, :m] = picks
    out.scatter_(1, nvalid, own[:, None])
    return out.view(B, G, T, topk).to(torch.int32)


# ----------------------------------------------------------------------------- reference rows

def reference_rows(q, k, v, block_idx, rows, *, block_size: int, softmax_scale: float | None = None, chunk: int = 32):
    """The reference's (o, lse) for the queries `rows` (int [R]) of batch 0 only, in fp32.

    Returns o [R, Hq, D] float32 and lse [Hq, R] float32.  Row i depends only on its own
    selection, so this is O(R * topk * block_size) instead of the full reference.
    """
    _, T, Hq, D = q.shape
    G = k.shape[2]
    hpg = Hq // G
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    rows = rows.long().to(q.device)
    offs = torch.arange(block_size, device=q.device)
    outs, lses = [], []
    kt = k[0].transpose(0, 1).float()  # [G, T, D]
    vt = v[0].transpose(0, 1).float()
    for r0 in range(0, rows.numel(), chunk):
        rr = rows[r0 : r0 + chunk]
        R = rr.numel()
        sel = block_idx[0][:, rr].long().sort(dim=-1).values  # [G, R, K]
        dup = torch.zeros_like(sel, dtype=torch.bool)
        dup[..., 1:] = sel[..., 1:] == sel[..., :-1]
        pos = sel.unsqueeze(-1) * block_size + offs  # [G, R, K, bs]
        valid = ((sel >= 0) & ~dup).unsqueeze(-1) & (pos <= rr.view(1, R, 1, 1)) & (pos >= 0)
        pos = pos.clamp(0, T - 1).reshape(G, R, -1)
        valid = valid.reshape(G, R, -1)
        kk = torch.stack([kt[g][pos[g]] for g in range(G)])  # [G, R, L, D]
        vv = torch.stack([vt[g][pos[g]] for g in range(G)])
        qq = q[0, rr].float().view(R, G, hpg, D).permute(1, 0, 2, 3)  # [G, R, hpg, D]
        s = torch.einsum("grhd,grld->grhl", qq, kk) * scale
        s = s.masked_fill(~valid.unsqueeze(2), float("-inf"))
        lse = torch.logsumexp(s, dim=-1)  # [G, R, hpg]
        p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
        o = torch.einsum("grhl,grld->grhd", p, vv)
        outs.append(o.permute(1, 0, 2, 3).reshape(R, Hq, D))
        lses.append(lse.permute(0, 2, 1).reshape(Hq, R))
    return torch.cat(outs, 0), torch.cat(lses, 1)


def sample_rows(T: int, n: int, block_size: int, generator: torch.Generator) -> torch.Tensor:
    """n query rows: the first, the last, a block boundary and uniform random ones."""
    fixed = torch.tensor(sorted({0, T - 1, min(T - 1, block_size - 1), min(T - 1, block_size)}))
    rnd = torch.randint(0, T, (max(0, n - fixed.numel()),), generator=generator)
    return torch.cat([fixed, rnd])[:n]


# ----------------------------------------------------------------------------- entry point

def check_and_bench(
    T_list=(16384, 65536, 131072, 262144, 1048576),
    device="cuda",
    *,
    Hq: int = M3_SHAPE["Hq"],
    G: int = M3_SHAPE["G"],
    D: int = M3_SHAPE["D"],
    block_size: int = M3_SHAPE["block_size"],
    topk: int = M3_SHAPE["topk"],
    dtype: torch.dtype = torch.bfloat16,
    full_check_T: int = 32768,
    bwd_check_T: int = 32768,
    n_check_rows: int = 256,
    bwd_max_T: int = 1 << 30,
    sweep: bool = True,
    sweep_T: int = 131072,
    seed: int = 0,
    verbose: bool = True,
) -> list[dict]:
    """One dict per T (plus one per swept config) with: T, fwd_ms, fwd_tflops, fwdbwd_ms,
    bwd_ms (= fwdbwd - fwd), bwd_tflops, fwd_peak_extra_GiB (beyond q, k, v, block_idx, o, lse),
    fwdbwd_peak_extra_GiB (beyond those, dO and the three gradients), fwd_kernel_ms (the
    launcher alone, without the public op's checks), o_rel_err / lse_max_abs_err
    (vs fp32 reference; on `check_rows` sampled rows above full_check_T), dq/dk/dv_rel_err
    (T <= bwd_check_T), fwd_all_written / bwd_all_written (no NaN left in poisoned outputs),
    fwd_config / bwd_config, and error (a string) when something raised.
    """
    from . import sparse_attention
    from . import triton as kernels

    dev = torch.device(device)
    scale = 1.0 / math.sqrt(D)
    flops_fwd = lambda T: 4.0 * Hq * D * topk * block_size * T  # noqa: E731
    results: list[dict] = []

    def make(T, seed_):
        g = torch.Generator(device=dev).manual_seed(seed_)
        q = torch.randn((1, T, Hq, D), generator=g, device=dev, dtype=dtype)
        k = torch.randn((1, T, G, D), generator=g, device=dev, dtype=dtype)
        v = torch.randn((1, T, G, D), generator=g, device=dev, dtype=dtype)
        bi = random_block_idx(1, G, T, block_size, topk, g, dev)
        return q, k, v, bi

    def time_fwd(q, k, v, bi):
        return _time_ms(lambda: sparse_attention(q, k, v, bi, block_size=block_size, backend="triton"))

    def time_fwdbwd(q, k, v, bi, do):
        qs, ks, vs = (t.detach().requires_grad_(True) for t in (q, k, v))

        def step():
            o = sparse_attention(qs, ks, vs, bi, block_size=block_size, backend="triton")
            o.backward(do)

        ms = _time_ms(step, grad_to_none=[qs, ks, vs])
        return ms

    # ------------------------------------------------------------------ config sweep
    if sweep and dev.type == "cuda":
        Ts = min(sweep_T, max(T_list))
        q, k, v, bi = make(Ts, seed + 1)
        do = torch.randn_like(q)
        best = {}
        for kind, table in (("fwd", kernels.FWD_CONFIGS), ("bwd", kernels.BWD_CONFIGS)):
            times = {}
            for name in table:
                row = {"T": Ts, "sweep": kind, "config": name}
                try:
                    if kind == "fwd":
                        kernels.FWD_DEFAULT = name
                        ms = time_fwd(q, k, v, bi)
                        row.update(ms=ms, tflops=flops_fwd(Ts) / ms / 1e9)
                    else:
                        kernels.BWD_DEFAULT = name
                        if "fwd_ms" not in best:
                            best["fwd_ms"] = time_fwd(q, k, v, bi)
                        ms = time_fwdbwd(q, k, v, bi, do) - best["fwd_ms"]
                        row.update(ms=ms, tflops=2.5 * flops_fwd(Ts) / ms / 1e9)
                    times[name] = ms
                except Exception as ex:  # a config that fails to compile or run is reported, not fatal
                    row["error"] = f"{type(ex).__name__}: {ex}"[:500]
                if verbose:
                    print(row, flush=True)
                results.append(row)
            if times:
                name = min(times, key=times.get)
                best[kind], best[f"{kind}_ms"] = name, times[name]
                if kind == "fwd":
                    kernels.FWD_DEFAULT = name
                else:
                    kernels.BWD_DEFAULT = name
        del q, k, v, bi, do
        torch.cuda.empty_cache()

    # ------------------------------------------------------------------ per T
    for T in T_list:
        row: dict = {"T": T, "fwd_config": kernels.FWD_DEFAULT, "bwd_config": kernels.BWD_DEFAULT}
        try:
            q, k, v, bi = make(T, seed + T)
            gen = torch.Generator().manual_seed(seed)
            # forward: poisoned outputs and partials, checked fully written, then checked
            o = torch.full_like(q, float("nan"))
            lse = torch.full((1, Hq, T), float("nan"), device=dev)
            peak, _ = _peak_extra(lambda: kernels.sparse_attention_fwd_triton(q, k, v, bi, None, block_size, scale, out=o, lse_out=lse, poison=True))
            row["fwd_all_written"] = bool(not torch.isnan(o).any() and not torch.isnan(lse).any())
            if T <= full_check_T:
                ro, rlse = sparse_attention_reference(q.float(), k.float(), v.float(), bi, block_size=block_size, return_lse=True)
                row["o_rel_err"] = rel_err(o, ro)
                row["lse_max_abs_err"] = float((lse - rlse).abs().nan_to_num().max())
                row["check_rows"] = T
                del ro, rlse
            else:
                rows = sample_rows(T, n_check_rows, block_size, gen)
                ro, rlse = reference_rows(q, k, v, bi, rows, block_size=block_size)
                row["o_rel_err"] = rel_err(o[0, rows.to(dev)], ro)
                row["lse_max_abs_err"] = float((lse[0][:, rows.to(dev)] - rlse).abs().nan_to_num().max())
                row["check_rows"] = int(rows.numel())
            del o, lse
            # forward timing and memory (through the public op)
            peak, out = _peak_extra(lambda: sparse_attention(q, k, v, bi, block_size=block_size, return_lse=True, backend="triton"))
            row["fwd_peak_extra_GiB"] = (peak - out[0].nbytes - out[1].nbytes) / 2**30
            del out
            row["fwd_ms"] = time_fwd(q, k, v, bi)
            row["fwd_tflops"] = flops_fwd(T) / row["fwd_ms"] / 1e9
            # the kernels alone (no argument checks: check_block_idx reads block_idx and syncs)
            row["fwd_kernel_ms"] = _time_ms(lambda: kernels.sparse_attention_fwd_triton(q, k, v, bi, None, block_size, scale))
            if T <= bwd_max_T:
                do = torch.randn_like(q)
                if T <= bwd_check_T:
                    # poisoned gradients, checked fully written and against fp32 autograd
                    of, lsef = kernels.sparse_attention_fwd_triton(q, k, v, bi, None, block_size, scale)
                    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
                    kernels.sparse_attention_bwd_triton(do, q, k, v, of, lsef, None, bi, None, block_size, scale,
                                                        dq_out=dq, dk_out=dk, dv_out=dv, poison=True)
                    row["bwd_all_written"] = bool(not any(torch.isnan(t).any() for t in (dq, dk, dv)))
                    qf, kf, vf = (t.float().requires_grad_(True) for t in (q, k, v))
                    ref = sparse_attention_reference(qf, kf, vf, bi, block_size=block_size)
                    rq, rk, rv = torch.autograd.grad(ref, (qf, kf, vf), do.float())
                    row.update(dq_rel_err=rel_err(dq, rq), dk_rel_err=rel_err(dk, rk), dv_rel_err=rel_err(dv, rv))
                    del of, lsef, dq, dk, dv, qf, kf, vf, ref, rq, rk, rv
                qs, ks, vs = (t.detach().requires_grad_(True) for t in (q, k, v))

                def fb():
                    o_ = sparse_attention(qs, ks, vs, bi, block_size=block_size, backend="triton")
                    o_.backward(do)
                    return o_

                peak, o_ = _peak_extra(fb)
                kept = o_.nbytes + sum(t.grad.nbytes for t in (qs, ks, vs))
                row["fwdbwd_peak_extra_GiB"] = (peak - kept) / 2**30
                del o_, qs, ks, vs
                row["fwdbwd_ms"] = time_fwdbwd(q, k, v, bi, do)
                row["bwd_ms"] = row["fwdbwd_ms"] - row["fwd_ms"]
                row["bwd_tflops"] = 2.5 * flops_fwd(T) / row["bwd_ms"] / 1e9
                del do
            del q, k, v, bi
        except Exception as ex:  # report and go on to the next T
            row["error"] = f"{type(ex).__name__}: {ex}"[:800]
        torch.cuda.empty_cache()
        if verbose:
            print(row, flush=True)
        results.append(row)
    return results


if __name__ == "__main__":  # pragma: no cover
    import json
    import sys

    Ts = tuple(int(x) for x in sys.argv[1:]) or (16384, 65536, 131072, 262144, 1048576)
    print(json.dumps(check_and_bench(Ts), indent=1))


# ----------------------------------------------------------------------------- quick sweep / ablations
# Ablation bits of `triton.sparse_attention_{fwd,bwd}_triton(ablate=...)` (results are wrong
# under any of them; timing only).  Forward: 1 = no partial o/lse stores, 2 = FIXED_Q (no Q
# gather), 4 = FIXED_STORE (stores to one row per program: no scattered stores), 8 = no merge.
# Backward: 1 = no dQ partial stores, 2 = FIXED_Q (no Q/dO/lse/delta gather), 4 = no dK/dV
# atomics, 8 = no dQ reduce.
# Each distinct kernel bit set is one more compile (~2-3 s): the default profiles keep to
# three per direction (fixed_store = 4 and no_atomics = 4 are there to add when needed).
FWD_ABLATIONS = {"base": 0, "no_partial_store": 1, "fixed_q": 2, "no_merge": 8, "compute_only": 1 | 2 | 8}
BWD_ABLATIONS = {"base": 0, "no_dq_store": 1, "fixed_q": 2, "no_reduce": 8, "compute_only": 15}


def _time_quick(fn, reps: int = 2) -> float:
    """Min of `reps` timed calls after one warm-up call (which also compiles), in ms."""
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    return float(min(ts))


def _m3_inputs(T: int, device="cuda", seed: int = 1, dtype=torch.bfloat16):
    dev = torch.device(device)
    s = M3_SHAPE
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn((1, T, s["Hq"], s["D"]), generator=g, device=dev, dtype=dtype)
    k = torch.randn((1, T, s["G"], s["D"]), generator=g, device=dev, dtype=dtype)
    v = torch.randn((1, T, s["G"], s["D"]), generator=g, device=dev, dtype=dtype)
    bi = random_block_idx(1, s["G"], T, s["block_size"], s["topk"], g, dev)
    do = torch.randn((1, T, s["Hq"], s["D"]), generator=g, device=dev, dtype=dtype)
    return q, k, v, bi, do


def _fwd_call(kernels, inp, cfg, ablate=0, out=None):
    q, k, v, bi, _ = inp
    bs = M3_SHAPE["block_size"]
    o, lse = out if out is not None else (None, None)
    return lambda: kernels.sparse_attention_fwd_triton(q, k, v, bi, None, bs, 1.0 / math.sqrt(q.shape[-1]), out=o, lse_out=lse, config=cfg, ablate=ablate)


def _bwd_call(kernels, inp, o, lse, cfg, ablate=0, grads=None):
    q, k, v, bi, do = inp
    bs = M3_SHAPE["block_size"]
    dq = grads[0] if grads is not None else None
    return lambda: kernels.sparse_attention_bwd_triton(do, q, k, v, o, lse, None, bi, None, bs, 1.0 / math.sqrt(q.shape[-1]), dq_out=dq, config=cfg, ablate=ablate)


def sweep_configs(T: int = 131072, inp=None, reps: int = 2, verbose: bool = True) -> dict:
    """Times every FWD_CONFIGS / BWD_CONFIGS entry (kernels alone, backward without the
    forward) at the M3 shape and sets triton.FWD_DEFAULT / BWD_DEFAULT to the fastest."""
    from . import triton as kernels

    inp = inp if inp is not None else _m3_inputs(T)
    flops = 4.0 * M3_SHAPE["Hq"] * M3_SHAPE["D"] * M3_SHAPE["topk"] * M3_SHAPE["block_size"] * T
    o = torch.empty_like(inp[0])
    lse = torch.empty((1, M3_SHAPE["Hq"], T), device=o.device, dtype=torch.float32)
    res = {"fwd": {}, "bwd": {}}
    for name in kernels.FWD_CONFIGS:
        try:
            ms = _time_quick(_fwd_call(kernels, inp, name, out=(o, lse)), reps)
            res["fwd"][name] = (round(ms, 2), round(flops / ms / 1e9, 1))
        except Exception as ex:  # reported, not fatal
            res["fwd"][name] = f"{type(ex).__name__}: {ex}"[:300]
        if verbose:
            print("fwd", name, res["fwd"][name], flush=True)
    ok = {n: v[0] for n, v in res["fwd"].items() if isinstance(v, tuple)}
    if ok:
        kernels.FWD_DEFAULT = min(ok, key=ok.get)
    kernels.sparse_attention_fwd_triton(inp[0], inp[1], inp[2], inp[3], None, M3_SHAPE["block_size"], 1.0 / math.sqrt(M3_SHAPE["D"]), out=o, lse_out=lse)
    dq = torch.empty_like(inp[0])
    for name in kernels.BWD_CONFIGS:
        try:
            ms = _time_quick(_bwd_call(kernels, inp, o, lse, name, grads=(dq,)), reps)
            res["bwd"][name] = (round(ms, 2), round(2.5 * flops / ms / 1e9, 1))
        except Exception as ex:
            res["bwd"][name] = f"{type(ex).__name__}: {ex}"[:300]
        if verbose:
            print("bwd", name, res["bwd"][name], flush=True)
    ok = {n: v[0] for n, v in res["bwd"].items() if isinstance(v, tuple)}
    if ok:
        kernels.BWD_DEFAULT = min(ok, key=ok.get)
    res["best"] = (kernels.FWD_DEFAULT, kernels.BWD_DEFAULT)
    return res


def profile_forward(T: int = 131072, config=None, inp=None, reps: int = 2, verbose: bool = True) -> dict:
    """Forward time (ms) at the M3 shape under each FWD_ABLATIONS entry (config: FWD_DEFAULT).
    Reading: base - no_merge = merge; no_merge - compute_only = what Q gathers + partial stores
    cost; fixed_q / no_partial_store / fixed_store split that between gather latency, store
    instructions and scattered (TLB / L2-miss) stores."""
    from . import triton as kernels

    cfg = config or kernels.FWD_DEFAULT
    inp = inp if inp is not None else _m3_inputs(T)
    o = torch.empty_like(inp[0])
    lse = torch.empty((1, M3_SHAPE["Hq"], T), device=o.device, dtype=torch.float32)
    res = {"config": cfg}
    for name, a in FWD_ABLATIONS.items():
        try:
            res[name] = round(_time_quick(_fwd_call(kernels, inp, cfg, a, out=(o, lse)), reps), 2)
        except Exception as ex:
            res[name] = f"{type(ex).__name__}: {ex}"[:300]
        if verbose:
            print("profile fwd", cfg, name, res[name], flush=True)
    return res


def profile_backward(T: int = 131072, config=None, inp=None, reps: int = 2, verbose: bool = True) -> dict:
    """Backward time (ms, the kernels alone) at the M3 shape under each BWD_ABLATIONS entry."""
    from . import triton as kernels

    cfg = config or kernels.BWD_DEFAULT
    inp = inp if inp is not None else _m3_inputs(T)
    o, lse = kernels.sparse_attention_fwd_triton(inp[0], inp[1], inp[2], inp[3], None, M3_SHAPE["block_size"], 1.0 / math.sqrt(M3_SHAPE["D"]))
    dq = torch.empty_like(inp[0])
    res = {"config": cfg}
    for name, a in BWD_ABLATIONS.items():
        try:
            res[name] = round(_time_quick(_bwd_call(kernels, inp, o, lse, cfg, a, grads=(dq,)), reps), 2)
        except Exception as ex:
            res[name] = f"{type(ex).__name__}: {ex}"[:300]
        if verbose:
            print("profile bwd", cfg, name, res[name], flush=True)
    return res


def gpu_run(T: int = 131072, check_T: int = 16384, device="cuda") -> dict:
    """The lead's one GPU call: config sweep + forward / backward ablation profiles at T (one
    set of inputs, ~30-40 s including compiles), then check_and_bench at check_T with the
    chosen configs (correctness of forward and backward + timings)."""
    import json

    t0 = time.perf_counter()
    inp = _m3_inputs(T, device)
    out = {"sweep": sweep_configs(T, inp)}
    out["profile_fwd"] = profile_forward(T, inp=inp)
    out["profile_bwd"] = profile_backward(T, inp=inp)
    out["sweep_profile_s"] = round(time.perf_counter() - t0, 1)
    del inp
    torch.cuda.empty_cache()
    out["check"] = check_and_bench((check_T,), device, sweep=False, full_check_T=check_T, bwd_check_T=check_T, verbose=False)
    print(json.dumps(out, default=str), flush=True)
    return out


# ----------------------------------------------------------------------------- compile report (no GPU)

def compile_report(arch: int = 90, T: int = 131072, fwd=None, merges=None, worklist: bool = True, sass: bool = False) -> list[dict]:
    """Compile the forward kernels (FWD_CONFIGS, or the names in `fwd`), the merge variants
    (MERGE_CONFIGS or `merges`) and the work-list kernels at the M3 shape for sm_<arch> WITHOUT
    a GPU (Triton's bundled ptxas; run with TRITON_INTERPRET unset) and report registers,
    spills (stack bytes) and shared memory; sass=True adds per kernel the SASS counts of global
    loads / stores, TMA stores and barriers."""
    import triton

    from msakit._cuda_compile import compile_cuda, cuobjdump, res_usage

    from . import triton as K

    s = M3_SHAPE
    Hq, G, D, bs, KS = s["Hq"], s["G"], s["D"], s["block_size"], s["topk"]
    geo = K._Geom(1, T, T, Hq, G, D, KS, Hq // G, bs, G * (T // bs + 2))
    C = K._chunk_rows(geo, 2, 4, None, K.CHUNK_BYTES)
    rows = []

    def build(name, fn, sig, consts, **opts):
        try:
            k = compile_cuda(fn, sig, consts, capability=arch, **opts)
            row = {"kernel": name, **res_usage(k)}
            if sass:
                _, sa = cuobjdump(k)
                row.update(ldg=sa.count("LDG."), stg=sa.count("STG."), tma_store=sa.count("UTMASTG"),
                           bar=sa.count("BAR.SYNC"), lds=sa.count("LDS."), sts=sa.count("STS."))
        except Exception as ex:  # reported, not fatal
            row = {"kernel": name, "error": f"{type(ex).__name__}: {ex}"[:400]}
        print(row, flush=True)
        rows.append(row)

    for name in fwd or K.FWD_CONFIGS:
        cfg = K.FWD_CONFIGS[name]
        q_tile, bm, bn, bd, _ = K._tile(cfg, geo)
        tma = cfg.tma_store and bm == q_tile * geo.hpg and bd == D
        sig = dict(Q="*bf16", K="*bf16", V="*bf16", OP="*bf16", LP="*fp32", ENT_Q="*i32", IT_KEY="*i64",
                   IT_START="*i64", IT_COUNT="*i32", N=T, n0=C, qk_scale=0.1, C_ROWS=C)
        consts = dict(HQ=Hq, G=G, D=D, KS=KS, BS=bs, HPG=geo.hpg, Q_TILE=q_tile, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd,
                      PREC="tf32", UPCAST=False, PREFETCH=cfg.prefetch, SKIP_EMPTY=False, QREG=cfg.qreg, ABL=0,
                      TMA_STORE=tma, SCALAR_DIAG=cfg.scalar_diag)
        if tma:
            sig["OP_DESC"] = f"tensordesc<bf16[{bm}, {bd}]>"
        else:
            consts["OP_DESC"] = None
        build(f"fwd {name}", K._sa_fwd_kernel, sig, consts, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    for name in merges or K.MERGE_CONFIGS:
        mc = K.MERGE_CONFIGS[name]
        sig = dict(P="*bf16", LP="*fp32", NV="*i32", INV="*i32", OUT="*bf16", LSE="*fp32", n0=C, C=C, T=T)
        if mc.version == 1:
            rbt, rbh, rbd = K._reduce_tile(Hq, D)
            consts = dict(HQ=Hq, D=D, KS=KS, HPG=geo.hpg, WEIGHTED=True, BLOCK_T=rbt, BLOCK_H=rbh, BLOCK_D=rbd)
            build(f"merge {name}", K._sa_slot_reduce_kernel, sig, consts, num_warps=K.REDUCE_WARPS, num_stages=1)
        else:
            bhp = triton.next_power_of_2(geo.hpg)
            consts = dict(HQ=Hq, D=D, KS=KS, HPG=geo.hpg, WEIGHTED=True, BLOCK_T=max(1, mc.block_t * 16 // bhp),
                          BLOCK_HP=bhp, BLOCK_D=D, BLOCK_K=triton.next_power_of_2(KS), NUM_STAGES=mc.num_stages,
                          EVICT=mc.evict)
            build(f"merge {name}", K._sa_slot_merge_kernel, sig, consts, num_warps=mc.num_warps, num_stages=mc.num_stages)
    if worklist:
        bk = triton.next_power_of_2(KS)
        sig = dict(SEL="*i32", s_g=T * KS, s_t=KS, s_k=1, DOC="*i64", KEY="*i32", NV="*i32",
                   n0=C, C=C, N=T, T=T, kspace=G * T)
        build("worklist canon", K._wl_canon_kernel, sig, dict(K=KS, BS=bs, HAS_DOC=False, BLOCK_R=max(1, min(32, 4096 // (bk * bk))), BLOCK_K=bk), num_warps=4)
        M = G * C * KS
        sig = dict(SKEY="*i32", ORDER="*i64", ENT_Q="*i32", INV="*i32", FIRST="*i32", M=M, n0=C, C=C, kspace=G * T,
                   item_q=64, NSTEPS=21)
        build("worklist entry", K._wl_entry_kernel, sig, dict(K=KS, BLOCK=1024), num_warps=4)
        sig = dict(SKEY="*i32", FIRST="*i32", CSUM="*i32", IT_KEY="*i64", IT_START="*i64", IT_COUNT="*i32", M=M,
                   item_q=64, NSTEPS=7)
        build("worklist item", K._wl_item_kernel, sig, dict(BLOCK=1024), num_warps=4)
    return rows


# ----------------------------------------------------------------------------- A/B of the session-3 variants

def _chunk_setup(kernels, inp, cfg_name: str = "m64w4p"):
    """A middle chunk of the forward at the M3 shape: (geo, cfg, n0, c, sel, item_q)."""
    q, k, v, bi, _ = inp
    K = kernels
    geo = K._geom(q, k, bi, M3_SHAPE["block_size"], None)
    cfg = K.FWD_CONFIGS[cfg_name]
    item_q = K._tile(cfg, geo)[4]
    C = K._chunk_rows(geo, q.dtype.itemsize, 4, None, cfg.chunk_bytes or K.CHUNK_BYTES)
    n0 = max(0, min((geo.N // 2) // C * C, geo.N - C))
    return geo, cfg, n0, min(C, geo.N - n0), K._selection_rows(bi, geo), item_q


def ab_run(
    T_list=(16384, 131072),
    merges=None,
    fwd_configs=None,
    reps: int = 3,
    n_check_rows: int = 256,
    apply: bool = False,
    verbose: bool = True,
) -> dict:
    """A/B of the forward's variants on the GPU at the M3 shape, per T:

    1. work list of one middle chunk: `_build_items` (torch) vs `_build_items_tl` (triton), ms
       per chunk and x chunks, fields compared (same);
    2. slot merge of that chunk (partials from the main kernel) for every MERGE_CONFIGS entry
       (or `merges`): ms per chunk, x chunks, effective TB/s of the partial reads, bit-equal to v1;
       also the backward's unweighted dq reduce (v1 vs the fastest v2);
    3. the whole forward (`sparse_attention_fwd_triton`): baseline (m64w4p / v1 / torch work
       list / no overlap) -> + triton work list -> + fastest merge -> + overlap, then every
       FWD_CONFIGS entry (or `fwd_configs`) with the best of those; each with its time, the gain
       over the baseline, bit equality with the baseline and the error against the fp32 reference
       on n_check_rows sampled rows (and all rows written: NaN-poisoned outputs).
    Prints one table per T and returns {T: rows}; apply=True sets FWD_DEFAULT, MERGE_DEFAULT,
    WORKLIST and OVERLAP to the fastest forward seen at the largest T."""
    from . import triton as K

    out: dict = {}
    best_all = None
    for T in T_list:
        rows: list[dict] = []

        def add(**r):
            rows.append(r)
            if verbose:
                print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)

        inp = _m3_inputs(T)
        q, k, v, bi, _ = inp
        dev = q.device
        bs = M3_SHAPE["block_size"]
        scale = 1.0 / math.sqrt(M3_SHAPE["D"])
        geo, cfg, n0, c, sel, item_q = _chunk_setup(K, inp)
        nchunks = -(-geo.N // (K._chunk_rows(geo, 2, 4, None, K.CHUNK_BYTES)))
        # 1. work list
        its = {}
        for wl in ("torch", "triton"):
            try:
                ms = _time_quick(lambda: K._items(sel, n0, c, geo, None, bs, item_q, dev, wl), reps)
                its[wl] = K._items(sel, n0, c, geo, None, bs, item_q, dev, wl)
                same = ""
                if wl != "torch" and "torch" in its:
                    a, b = its[wl], its["torch"]
                    real = b.it_count > 0
                    same = all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("ent_q", "inv", "nvalid", "it_count")) and all(
                        torch.equal(getattr(a, f)[real], getattr(b, f)[real]) for f in ("it_key", "it_start"))
                add(T=T, part="worklist", variant=wl, ms_chunk=ms, ms_total_est=ms * nchunks, same_as_base=same)
            except Exception as ex:  # reported, not fatal
                add(T=T, part="worklist", variant=wl, error=f"{type(ex).__name__}: {ex}"[:300])
        it = its["torch"]
        # 2. merge (and the backward's reduce) on the chunk's partials
        OP = torch.empty((c, geo.KS, geo.Hq, geo.D), dtype=q.dtype, device=dev)
        LP = torch.empty((c, geo.KS, geo.Hq), dtype=torch.float32, device=dev)
        K._fwd_main(q.contiguous(), k.contiguous(), v.contiguous(), OP, LP, None, it, geo, n0, c, cfg, scale * 1.4426950408889634, False)
        nval = int(it.nvalid.sum())
        gbytes = (nval * geo.hpg * (geo.D * 2 + 4) + c * geo.Hq * (geo.D * 2 + 4)) / 1e9
        ref_o, ref_l = torch.full_like(q, float("nan")), torch.full((1, geo.Hq, T), float("nan"), device=dev)
        K._merge(K.MERGE_CONFIGS["v1"], OP, LP, it, ref_o, ref_l, n0, c, geo, True)
        mtimes = {}
        for name in merges or K.MERGE_CONFIGS:
            mc = K.MERGE_CONFIGS[name]
            try:
                o_m, l_m = torch.full_like(q, float("nan")), torch.full_like(ref_l, float("nan"))
                ms = _time_quick(lambda: K._merge(mc, OP, LP, it, o_m, l_m, n0, c, geo, True), reps)
                same = bool(torch.equal(o_m[0, n0 : n0 + c], ref_o[0, n0 : n0 + c]) and torch.equal(l_m[..., n0 : n0 + c], ref_l[..., n0 : n0 + c]))
                mtimes[name] = ms
                add(T=T, part="merge", variant=name, ms_chunk=ms, ms_total_est=ms * nchunks, TBps=gbytes / ms, same_as_base=same)
            except Exception as ex:
                add(T=T, part="merge", variant=name, error=f"{type(ex).__name__}: {ex}"[:300])
        best_m = min(mtimes, key=mtimes.get) if mtimes else "v1"
        red_base = None
        for name in dict.fromkeys(("v1", best_m if best_m != "v1" else "v2s3t1")):
            try:
                dq = torch.full_like(q, float("nan"))
                ms = _time_quick(lambda: K._merge(K.MERGE_CONFIGS[name], OP, OP, it, dq, dq, n0, c, geo, False), reps)
                red_base = dq.clone() if red_base is None else red_base
                add(T=T, part="bwd reduce", variant=name, ms_chunk=ms, ms_total_est=ms * nchunks,
                    same_as_base=bool(torch.equal(dq[0, n0 : n0 + c], red_base[0, n0 : n0 + c])))
            except Exception as ex:
                add(T=T, part="bwd reduce", variant=name, error=f"{type(ex).__name__}: {ex}"[:300])
        del OP, LP, ref_o, ref_l, its, it
        torch.cuda.empty_cache()
        # 3. whole forward
        gen = torch.Generator().manual_seed(0)
        chk = sample_rows(T, n_check_rows, bs, gen).to(dev)
        r_o, r_l = reference_rows(q, k, v, bi, chk, block_size=bs)
        base = None
        base_ms = []
        o = torch.empty_like(q)
        lse = torch.empty((1, geo.Hq, T), dtype=torch.float32, device=dev)

        def run_fwd(label, **kw):
            nonlocal base
            try:
                o.fill_(float("nan"))
                lse.fill_(float("nan"))
                K.sparse_attention_fwd_triton(q, k, v, bi, None, bs, scale, out=o, lse_out=lse, **kw)
                written = bool(not torch.isnan(o).any() and not torch.isnan(lse).any())
                err = rel_err(o[0, chk], r_o)
                lerr = float((lse[0][:, chk] - r_l).abs().nan_to_num().max())
                same = ""
                if base is not None:
                    same = bool(torch.equal(o, base[0]) and torch.equal(lse, base[1]))
                else:
                    base = (o.clone(), lse.clone())
                ms = _time_quick(lambda: K.sparse_attention_fwd_triton(q, k, v, bi, None, bs, scale, out=o, lse_out=lse, **kw), reps)
                row = dict(T=T, part="forward", variant=label, ms=ms, same_as_base=same, all_written=written,
                           o_rel_err=err, lse_max_abs_err=lerr)
                if base_ms:
                    row["gain_ms"] = base_ms[0] - ms
                else:
                    base_ms.append(ms)
                add(**row)
                return ms
            except Exception as ex:
                add(T=T, part="forward", variant=label, error=f"{type(ex).__name__}: {ex}"[:300])
                return None

        steps = [
            ("baseline", dict(config="m64w4p", merge="v1", worklist="torch", overlap=False)),
            ("+wl", dict(config="m64w4p", merge="v1", worklist="triton", overlap=False)),
            (f"+wl+{best_m}", dict(config="m64w4p", merge=best_m, worklist="triton", overlap=False)),
            (f"+wl+{best_m}+overlap", dict(config="m64w4p", merge=best_m, worklist="triton", overlap=True)),
        ]
        ftimes = {}
        for label, kw in steps:
            ms = run_fwd(label, **kw)
            if ms is not None:
                ftimes[label] = (ms, kw)
        ovl = min((ftimes[l][0], ftimes[l][1]["overlap"]) for l in ftimes if l != "baseline")[1] if len(ftimes) > 1 else False
        for name in fwd_configs or K.FWD_CONFIGS:
            if name == "m64w4p":
                continue
            kw = dict(config=name, merge=best_m, worklist="triton", overlap=ovl)
            ms = run_fwd(f"{name}+{best_m}{'+overlap' if ovl else ''}", **kw)
            if ms is not None:
                ftimes[f"{name}"] = (ms, kw)
        if ftimes:
            lab = min(ftimes, key=lambda x: ftimes[x][0])
            best_all = ftimes[lab][1]
            if verbose:
                print(f"T={T}: fastest forward {lab} {ftimes[lab][0]:.2f} ms ({ftimes[lab][1]})", flush=True)
        out[T] = rows
        _print_table(rows)
        del inp, q, k, v, bi, o, lse, base
        torch.cuda.empty_cache()
    if apply and best_all is not None:
        K.FWD_DEFAULT, K.MERGE_DEFAULT = best_all["config"], best_all["merge"]
        K.WORKLIST, K.OVERLAP = best_all["worklist"], best_all["overlap"]
    out["best"] = best_all
    return out


def _print_table(rows: list[dict]) -> None:
    cols = ["T", "part", "variant", "ms", "ms_chunk", "ms_total_est", "gain_ms", "TBps", "same_as_base", "all_written",
            "o_rel_err", "lse_max_abs_err", "error"]
    cols = [c for c in cols if any(c in r for r in rows)]

    def fmt(x):
        if isinstance(x, float):
            return f"{x:.3g}" if abs(x) < 0.01 else f"{x:.3f}"
        return str(x)

    table = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    w = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w[i]) for i, c in enumerate(cols)))
    for t in table:
        print("  ".join(x.ljust(w[i]) for i, x in enumerate(t)), flush=True)
