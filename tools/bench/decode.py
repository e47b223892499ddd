"""GPU correctness check and benchmark of `msa_decode` (for the lead's GPU run; CUDA only).

    from tools.bench.decode import graph_check, check_and_bench, compile_report
    graph_check()        # eager Triton vs reference, CUDA-graph capture / replay vs eager
    check_and_bench()    # the table of benchmarks/decode.py
    compile_report()     # no GPU needed: sm_90 compile of every kernel, registers / spills / smem

Shape: one layer of M3 (Hq 64, G 4, D 128, Di 128, page = block 128, top-16), bf16 K/V, index
keys bf16 or fp8 e4m3 (+ float32 per-token scales).  Baseline: dense decode through
`scaled_dot_product_attention`, the 16 query heads of a group packed as 16 query rows over that
group's K and V (batch * G as the batch dim, non-causal: one new token).  Floor: the bytes
msakit must read (all index keys + top-k blocks of K and V per group) over READ_BW.

Timing: each measured call is captured in a CUDA graph (decode runs in graphs), 10 calls per
graph; "cold" numbers put a 256 MiB L2 flush before every call and subtract the flush alone
(what a layer sees after the other layers ran), "hot" ones run back to back.
"""

from __future__ import annotations

import math
import random

import torch

from msakit.ops.decode.reference import FP8, PagedLayer

HQ, G, D, DI, PS, TOPK = 64, 4, 128, 128, 128, 16
LAUNCHES = ("split", "ticket")  # DecodeTiling.launch (without "auto", which picks one of them)
READ_BW = 4.16e12  # measured H200 read bandwidth (bytes / s)
REPS_IN_GRAPH = 10


# ------------------------------------------------------------------------------------- timing
_FLUSH = {}


def _capture(step):
    """One warm-up call of step() on a side stream, then a CUDA graph of it: (graph, its outputs)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    cg = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cg):
        out = step()
    return cg, out


def _flush_fn(mode: str = "write"):
    """The L2 flush before a cold call: "write" zeroes a 256 MiB buffer (the headline numbers;
    it leaves ~50 MB of dirty lines in L2 that the timed call pays to write back), "read" reads
    it (clean lines: a diagnostic of that write-back share)."""
    if "buf" not in _FLUSH:
        _FLUSH["buf"] = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
        _FLUSH["sink"] = torch.empty((), dtype=torch.int64, device="cuda")
    buf = _FLUSH["buf"]
    if mode == "read":
        words, sink = buf.view(torch.int64), _FLUSH["sink"]
        return lambda: torch.amax(words, dim=0, out=sink)
    return lambda: buf.zero_()


def graph_ms(fn, *, flush: bool = False, reps: int = REPS_IN_GRAPH, replays: int = 20, _subtract: bool = True,
             flush_mode: str = "write") -> float:
    """Median ms per call of fn() captured `reps` times in one CUDA graph (minus the L2 flush
    when flush=True; flush_mode: see _flush_fn)."""
    fl = _flush_fn(flush_mode) if flush else None
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            if fl:
                fl()
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            if fl:
                fl()
            fn()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / reps)
    times.sort()
    t = times[len(times) // 2]
    del g
    if flush and _subtract:
        key = ("flush_only", reps, flush_mode)
        if key not in _FLUSH:
            _FLUSH[key] = graph_ms(lambda: None, flush=True, reps=reps, replays=replays, _subtract=False,
                                   flush_mode=flush_mode)
        t -= _FLUSH[key]
    return t


# ------------------------------------------------------------------------------------- inputs
def make_pools(B: int, N: int, *, idx: str = "bf16", device: str = "cuda", seed: int = 0, kv: PagedLayer | None = None):
    """Random M3 pools for B sequences of N tokens (pages in a random physical order).  Pass kv=
    to reuse the K / V pools of an earlier call (only the index keys are regenerated)."""
    g = torch.Generator(device=device).manual_seed(seed)
    npg = -(-N // PS)
    P = B * npg
    if kv is None:
        k = torch.randn(P, G, PS, D, device=device, dtype=torch.bfloat16, generator=g)
        v = torch.randn(P, G, PS, D, device=device, dtype=torch.bfloat16, generator=g)
    else:
        k, v = kv.k, kv.v
    if idx == "fp8":
        ki = torch.empty(P, PS, DI, device=device, dtype=FP8)
        ks = torch.empty(P, PS, device=device, dtype=torch.float32)
        step = 4096
        for p0 in range(0, P, step):
            x = torch.randn(min(step, P - p0), PS, DI, device=device, generator=g)
            amax = x.abs().amax(-1, keepdim=True)
            sc = (amax / 448.0).clamp(min=torch.finfo(torch.float32).tiny)
            ki[p0:p0 + x.shape[0]] = (x / sc).clamp(-448, 448).to(FP8)
            ks[p0:p0 + x.shape[0]] = sc.squeeze(-1)
        pools = PagedLayer(k=k, v=v, k_idx=ki, k_idx_scale=ks)
    else:
        ki = torch.randn(P, PS, DI, device=device, dtype=torch.bfloat16, generator=g)
        pools = PagedLayer(k=k, v=v, k_idx=ki)
    perm = torch.randperm(P, device=device, generator=g).to(torch.int32)
    page_table = perm.view(B, npg).contiguous()
    seq_lens = torch.full((B,), N, dtype=torch.int32, device=device)
    return pools, page_table, seq_lens


def floor_bytes(B: int, N: int, idx: str = "bf16") -> int:
    per_tok = DI * (1 if idx == "fp8" else 2) + (4 if idx == "fp8" else 0)
    kv = G * min(TOPK, -(-N // PS)) * PS * D * 2 * 2
    return B * (N * per_tok + kv)


def dense_ms(B: int, N: int, *, device: str = "cuda", flush: bool = True, read_flush: bool = False) -> dict:
    """Dense decode through SDPA: q [B*G, 1, 16, D] over that group's K / V [B*G, 1, N, D].

    Every SDPA backend that takes the call is timed and the fastest is the baseline (`dense_ms`;
    each one's time is reported too): the default dispatch picks cuDNN here, which runs this shape
    ~20x slower than the flash backend (11.8 ms vs 0.55 ms at 1M, B = 1)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    hpg = HQ // G
    q = torch.randn(B * G, 1, hpg, D, device=device, dtype=torch.bfloat16)
    k = torch.randn(B * G, 1, N, D, device=device, dtype=torch.bfloat16)
    v = torch.randn(B * G, 1, N, D, device=device, dtype=torch.bfloat16)
    out: dict = {}
    best = None
    # (the memory-efficient backend measured 35 ms at 1M, B = 1: left out)
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        def fn(be=be):
            with sdpa_kernel([be]):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v)
        try:
            fn()
            t = graph_ms(fn, flush=flush)
        except Exception as e:  # a backend that does not take this shape
            out[f"dense_{name}_error"] = repr(e)[:200]
            continue
        out[f"dense_{name}_ms"] = t
        if best is None or t < out["dense_ms"]:
            best, out["dense_ms"], out["dense_backend"] = fn, t, name
    if best is None:
        raise RuntimeError(f"no SDPA backend ran dense decode at B={B}, N={N}: {out}")
    out["dense_hot_ms"] = graph_ms(best)
    if read_flush:
        out["dense_read_ms"] = graph_ms(best, flush=True, flush_mode="read")
    out["dense_GBps"] = 2 * k.numel() * 2 / out["dense_ms"] / 1e6
    del q, k, v
    torch.cuda.empty_cache()
    return out


def bench_case(B: int, N: int, *, idx: str = "bf16", nq: int = 1, pools=None, flush: bool = True,
               detail: bool = True, read_flush: bool = False, launch: str = "split") -> dict:
    """Times msa_decode (CUDA graph, cold and hot) and, for the multi-launch path, its selection
    phase alone (read_flush: also cold after a read-only flush, msa_read_ms, see _flush_fn).
    launch: `DecodeTiling.launch` ("split", "ticket" or "auto")."""
    from msakit.ops.decode import DecodeTiling, msa_decode, plan_decode
    from msakit.ops.decode import triton as kernels

    own = pools is None
    if own:
        pools, page_table, seq_lens = make_pools(B, N, idx=idx)
    else:
        pools, page_table, seq_lens = pools
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(B, nq, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    qi = torch.randn(B, nq, G, DI, device="cuda", dtype=torch.bfloat16, generator=g)
    plan = plan_decode(pools, batch=B, nq=nq, num_heads=HQ, width=page_table.shape[1], topk=TOPK,
                       tiling=DecodeTiling(launch=launch))
    fn = lambda: msa_decode(q, qi, pools, page_table, seq_lens, plan=plan)  # noqa: E731
    sel = lambda: kernels.launch(plan, q, qi, pools, page_table, seq_lens, 1 / math.sqrt(D), False,  # noqa: E731
                                 phases="select")
    fn()
    torch.cuda.synchronize()
    row = {"B": B, "N": N, "idx": idx, "nq": nq, "launch": launch, "splits": plan.score_splits,
           "attn_splits": plan.attn_splits, "score_stages": plan.score_stages, "score_warps": plan.score_warps,
           "score_impl": plan.score_impl, "fuse_combine": plan.fuse_combine, "programs": plan.programs,
           "one_launch_warps": plan.one_warps}
    row["msa_ms"] = graph_ms(fn, flush=flush)
    row["floor_ms"] = floor_bytes(B, N, idx) / READ_BW * 1e3
    row["vs_floor"] = row["msa_ms"] / row["floor_ms"]
    if detail:
        row["msa_hot_ms"] = graph_ms(fn)
    if detail and launch == "split":
        row["select_ms"] = graph_ms(sel, flush=flush)
        idx_bytes = B * N * (DI * (1 if idx == "fp8" else 2) + (4 if idx == "fp8" else 0))
        row["select_GBps"] = idx_bytes / row["select_ms"] / 1e6
    if read_flush:
        row["msa_read_ms"] = graph_ms(fn, flush=True, flush_mode="read")
    if own:
        del pools, page_table, seq_lens
        torch.cuda.empty_cache()
    return row


def _pools_bytes(B: int, N: int) -> int:
    """Bytes of the bf16 paged K / V pools and index keys of B sequences of N tokens."""
    return B * -(-N // PS) * PS * G * D * 2 * 2 + B * N * DI * 2


def _skip_unfit(B: int, N: int) -> bool:
    """True (and a line saying so) when those pools do not fit in free device memory (5% slack)."""
    if _fits(int(_pools_bytes(B, N) * 1.05)):
        return False
    print(f"skip B={B} N={N}: {_pools_bytes(B, N) / 2**30:.1f} GiB does not fit", flush=True)
    return True


def _fits(nbytes: int) -> bool:
    free, _ = torch.cuda.mem_get_info()
    return nbytes < 0.92 * free


def run(Bs=(1, 8, 32), Ns=(16384, 131072, 1 << 20), idxs=("bf16", "fp8"), nq: int | tuple[int, ...] = 1,
        launches: tuple[str, ...] = ("split",)) -> list[dict]:
    """Every (N, B, idx, nq, launch) row, dense timed once per (N, B) in the same run; each row's
    nq_ratio is its time over the same (N, B, idx, launch) at nq = 1 when that was timed."""
    nqs = (nq,) if isinstance(nq, int) else tuple(nq)
    rows = []
    for N in Ns:
        for B in Bs:
            dense = {}
            dense_bytes = B * G * N * D * 2 * 2
            if _fits(int(dense_bytes * 1.05)):
                dense = dense_ms(B, N)
            if _skip_unfit(B, N):
                continue
            kv = None
            for idx in idxs:
                case = make_pools(B, N, idx=idx, kv=kv)
                kv = PagedLayer(k=case[0].k, v=case[0].v)
                one = {}
                for q_n in nqs:
                    for launch in launches:
                        r = bench_case(B, N, idx=idx, nq=q_n, pools=case, launch=launch)
                        r.update(dense)
                        if dense:
                            r["speedup"] = dense["dense_ms"] / r["msa_ms"]
                        if q_n == 1:
                            one[launch] = r["msa_ms"]
                        if launch in one:
                            r["nq_ratio"] = r["msa_ms"] / one[launch]
                        rows.append(r)
                        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
                del case
                torch.cuda.empty_cache()
            del kv
            torch.cuda.empty_cache()
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"\n{'B':>3} {'N':>8} {'idx':>5} {'nq':>3} {'launch':>10} {'dense ms':>9} {'msa ms':>8} {'hot ms':>7} "
          f"{'select ms':>9} {'floor ms':>8} {'speedup':>8} {'x floor':>7} {'x nq=1':>7}")
    nan = float("nan")
    for r in rows:
        print(f"{r['B']:>3} {r['N']:>8} {r['idx']:>5} {r['nq']:>3} {r.get('launch', 'split'):>10} "
              f"{r.get('dense_ms', nan):>9.4f} {r['msa_ms']:>8.4f} {r.get('msa_hot_ms', nan):>7.4f} "
              f"{r.get('select_ms', nan):>9.4f} {r['floor_ms']:>8.4f} {r.get('speedup', nan):>8.2f} "
              f"{r['vs_floor']:>7.2f} {r.get('nq_ratio', nan):>7.2f}", flush=True)


def check_and_bench(quick: bool = False) -> dict:
    """The decode benchmark of the issue in one call (graph_check() is separate): M3 layer timings
    for B in {1, 8, 32} x N in {16K, 128K, 1M} (bf16 and fp8 index keys, nq=1, every launch) against
    dense decode and the bytes floor, plus nq=4 at B=1."""
    out: dict = {}
    Bs, Ns = ((1,), (16384, 1 << 20)) if quick else ((1, 8, 32), (16384, 131072, 1 << 20))
    out["rows"] = run(Bs, Ns, launches=LAUNCHES)
    out["rows_nq4"] = run((1,), (131072, 1 << 20), idxs=("bf16",), nq=(1, 4), launches=LAUNCHES)
    print_table(out["rows"] + out["rows_nq4"])
    return out


# ------------------------------------------------------------------------------------- checks
def graph_check(small: bool = False, device: str = "cuda", launches: tuple[str, ...] = LAUNCHES) -> dict:
    """Eager Triton vs the reference, and CUDA-graph capture / replay vs eager (also after the
    lengths, the page tables and the queries change), for bf16 index keys (v1 scoring) and fp8
    ones (v2 scoring), nq 1 and 4, every launch (`DecodeTiling.launch`).  The pool pages no
    sequence holds are NaN (the pages the sequences grow into too: their unwritten slots stay
    NaN).  Returns {"ok": bool, "cases": [...]}."""
    from msakit.cache import PagedKVCache

    from msakit.ops.decode import DecodeTiling, msa_decode, msa_decode_reference, plan_decode

    lens = [300, 2100, 129, 0] if small else [1000, 20000, 5000, 130, 0]
    cases = []
    ok = True
    for idx in ("bf16", "fp8"):
        torch.manual_seed(0)
        need = sum(-(-(L + 16) // PS) for L in lens) + 8
        cache = PagedKVCache(1, need, num_kv_heads=G, head_dim=D, index_dim=DI, page_size=PS,
                             kv_dtype=torch.bfloat16, index_dtype=FP8 if idx == "fp8" else torch.bfloat16, device=device)
        random.Random(0).shuffle(cache._free)  # scattered physical pages
        sids = []
        for L in lens:
            s = cache.allocate()
            if L:
                cache.prefill(s, torch.randn(L, G, D, device=device), torch.randn(L, G, D, device=device),
                              torch.randn(L, DI, device=device))
            sids.append(s)
        width = max(len(cache.pages(s)) for s in sids) + 2
        pools = cache.layer(0)
        _poison_free_pages(pools, cache._free)
        live = [s for s, L in zip(sids, lens) if L]
        for nq, launch in ((nq, launch) for nq in (1, 4) for launch in launches):
            meta = cache.decode_metadata(sids, width=width)
            B = len(sids)
            plan = plan_decode(pools, batch=B, nq=nq, num_heads=HQ, width=width, topk=TOPK,
                               seq_lens=meta.seq_lens_host, page_table=meta.page_table_host,
                               tiling=DecodeTiling(launch=launch))
            qs = torch.randn(B, nq, HQ, D, device=device, dtype=torch.bfloat16)
            qis = torch.randn(B, nq, G, DI, device=device, dtype=torch.bfloat16)

            def step():
                return msa_decode(qs, qis, pools, meta.page_table, meta.seq_lens, plan=plan, return_lse=True,
                                  return_block_idx=True)

            rec = {"idx": idx, "nq": nq, "launch": launch, "score_impl": plan.score_impl}
            for phase in ("first", "grown"):
                _poison(plan)
                o, lse, bi = step()
                o, lse, bi = o.clone(), lse.clone(), bi.clone()
                ro, rlse, rbi = msa_decode_reference(qs, qis, pools, meta.page_table, meta.seq_lens_host, topk=TOPK)
                same = _set_agreement(bi, rbi)
                written = bool((bi != -7).all() and torch.isfinite(o).all())
                err = float((o.float() - ro.float()).abs().max())
                rel = float((o.double() - ro.double()).norm() / ro.double().norm().clamp_min(1e-30))
                lerr = float((lse - rlse)[torch.isfinite(rlse)].abs().max())
                if phase == "first":
                    g = torch.cuda.CUDAGraph()
                    s = torch.cuda.Stream()
                    s.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(s):
                        step()
                    torch.cuda.current_stream().wait_stream(s)
                    with torch.cuda.graph(g):
                        go, glse, gbi = step()
                _poison(plan)
                g.replay()
                torch.cuda.synchronize()
                graph_equal = bool(torch.equal(go, o) and torch.equal(gbi, bi) and torch.equal(glse, lse))
                counters_zero = bool((plan.cnt1 == 0).all() and (plan.cnt2 == 0).all() and (plan.cnt3 == 0).all()
                                     and (plan.work == 0).all())
                rec[phase] = dict(selection_agreement=same, o_rel_err=rel, o_max_err=err, lse_max_err=lerr,
                                  all_written=written, graph_equals_eager=graph_equal, counters_zero=counters_zero)
                ok &= (same >= 0.995 and rel < 1e-2 and lerr < 1e-2 and written and graph_equal
                       and counters_zero)
                if phase == "first":
                    # grow every live sequence by nq + 5 tokens, new queries, refill the static metadata
                    for sid in live:
                        n = nq + 5
                        cache.append(sid, torch.randn(n, G, D, device=device), torch.randn(n, G, D, device=device),
                                     torch.randn(n, DI, device=device))
                    cache.decode_metadata(sids, out=meta)
                    qs.copy_(torch.randn_like(qs))
                    qis.copy_(torch.randn_like(qis))
            del g
            cases.append(rec)
            print(rec, flush=True)
    return {"ok": bool(ok), "cases": cases}


def _poison_free_pages(pools: PagedLayer, free: list[int]) -> None:
    """NaN into every pool page in `free` (fp8 e4m3fn codes: 0x7f), scales included."""
    idx = torch.tensor(free, dtype=torch.long, device=pools.k.device)
    for t in (pools.k, pools.v, pools.k_idx, pools.k_scale, pools.v_scale, pools.k_idx_scale):
        if t is None:
            continue
        if t.dtype == FP8:
            t.view(torch.uint8)[idx] = 0x7F
        else:
            t[idx] = float("nan")


def _poison(plan) -> None:
    """Fill the plan's workspace and selection with garbage: anything a call fails to write shows."""
    plan.block_idx.fill_(-7)
    plan.o_part.fill_(float("nan"))
    plan.lse_part.fill_(float("nan"))
    plan.cand.fill_(-(2**62))
    plan.cand2.fill_(-(2**62))
    if plan.bmax is not None:
        plan.bmax.fill_(float("nan"))


def _set_agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.cpu(), b.cpu()
    hit = tot = 0
    for x, y in zip(a.reshape(-1, a.shape[-1]).tolist(), b.reshape(-1, b.shape[-1]).tolist()):
        sx, sy = {t for t in x if t >= 0}, {t for t in y if t >= 0}
        hit += len(sx & sy)
        tot += max(len(sx), len(sy))
    return hit / max(tot, 1)


# ------------------------------------------------------------------------------------- no-GPU check
def compile_report(arch: int = 90) -> list[dict]:
    """Compile every kernel at the M3 shape for sm_<arch> WITHOUT a GPU (Triton + its bundled
    ptxas; run with TRITON_INTERPRET unset) and report shared memory, registers and spills.
    Pointer arguments are marked 16-byte aligned, as the JIT does for real tensors (without
    that Triton does not software-pipeline the loads)."""
    import triton

    from tools.cuda_compile import compile_cuda, res_usage

    from msakit.ops.decode import triton as K

    def build(name, fn, sig, consts, **opts):
        k = compile_cuda(fn, sig, consts, aligned=("pt_stride",), capability=arch, **opts)
        row = {"kernel": name, **res_usage(k), "pipelined_loads": k.asm["ttgir"].count("async_copy_global_to_local")}
        print(row, flush=True)
        return row

    rows = []
    for idx in ("bf16", "fp8"):  # v1 scores bf16 index keys, v2 fp8 ones
        for nq in (1, 8):
            mr = triton.next_power_of_2(nq * G)
            sig = dict(qi_ptr="*bf16", pt_ptr="*i32", pt_stride="i32", sl_ptr="*i32", cand_ptr="*i64",
                       cand2_ptr="*i64", cnt1_ptr="*i32", cnt2_ptr="*i32", bidx_ptr="*i32", S="i32", NC="i32")
            consts = dict(NQ=nq, G=G, DI=DI, PS=PS, TOPK=TOPK, KP=16, MP=max(16, mr), MR=mr, LOCAL=1, INIT=0,
                          CL=16, NC_PAD=16, RB1=K._rows_per_merge(mr, 256), RB2=K._rows_per_merge(mr, 256))
            if idx == "bf16":
                rows.append(build(f"score v1 {idx} nq={nq}", K._score_kernel, dict(sig, kidx_ptr="*bf16"),
                                  dict(consts, CODE=0, NUM_STAGES=5), num_warps=8, num_stages=5))
            else:
                for tma in (True, False):
                    sig2 = dict(sig, kidx_ptr="*fp8e4nv", kscale_ptr="*fp32", bmax_ptr="*fp32", W="i32",
                                kdesc=f"tensordesc<fp8e4nv[{PS}, {DI}]>" if tma else "*i32")
                    rows.append(build(f"score v2 {idx} nq={nq} {'tma' if tma else 'pointer loads'}", K._score2_kernel,
                                      sig2, dict(consts, CODE=3, TMA=tma, PCH=32, NUM_STAGES=7), num_warps=4,
                                      num_stages=7))
            hpg = HQ // G
            qc = min(nq, 128 // hpg)
            ma = max(16, triton.next_power_of_2(qc * hpg))
            kv = "*bf16"
            sig = dict(q_ptr="*bf16", k_ptr=kv, v_ptr=kv, ks_ptr="*fp32", vs_ptr="*fp32", pt_ptr="*i32",
                       pt_stride="i32", sl_ptr="*i32", bidx_ptr="*i32", op_ptr="*fp32", lp_ptr="*fp32",
                       o_ptr="*bf16", lse_ptr="*fp32", cnt3_ptr="*i32", qk_scale="fp32", NSA="i32")
            fuse = idx == "fp8"  # the combine kernel follows v1, the fused combine v2
            consts = dict(NQ=nq, G=G, HPG=hpg, D=D, PS=PS, TOPK=TOPK, KP=16, QC=qc, NQC=-(-nq // qc), MA=ma,
                          KV_FP8=False, CODE=0, FUSE_COMBINE=fuse, NSA_PAD=16, RETURN_LSE=False)
            rows.append(build(f"attn nq={nq}{' fused combine' if fuse else ''}", K._attn_kernel, sig, consts,
                              num_warps=4 if ma <= 64 else 8, num_stages=1))
            rows.append(_compile_ticket(build, K, idx, nq))
    return rows


def _compile_ticket(build, K, idx: str, nq: int) -> dict:
    """`_ticket_kernel` at the M3 shape with the warps and stages that plan_decode gives launch
    "ticket"."""
    import triton

    fp8 = idx == "fp8"
    mr = triton.next_power_of_2(nq * G)
    hpg = HQ // G
    qc = min(nq, 128 // hpg)
    ma = max(16, triton.next_power_of_2(qc * hpg))
    warps = (4 if ma <= 32 else 8) if fp8 else 8
    stages = 7 if fp8 else 5
    sig = dict(qi_ptr="*bf16", kidx_ptr="*fp8e4nv" if fp8 else "*bf16",
               kdesc=f"tensordesc<fp8e4nv[{PS}, {DI}]>" if fp8 else "*i32", kscale_ptr="*fp32", pt_ptr="*i32",
               pt_stride="i32", sl_ptr="*i32", bmax_ptr="*fp32", cand_ptr="*i64", cand2_ptr="*i64", cnt1_ptr="*i32",
               cnt2_ptr="*i32", bidx_ptr="*i32", S="i32", NC="i32", W="i32", q_ptr="*bf16", k_ptr="*bf16",
               v_ptr="*bf16", ks_ptr="*fp32", vs_ptr="*fp32", op_ptr="*fp32", lp_ptr="*fp32", o_ptr="*bf16",
               lse_ptr="*fp32", cnt3_ptr="*i32", qk_scale="fp32", NSA="i32", work_ptr="*i32", B="i32")
    consts = dict(NQ=nq, G=G, DI=DI, PS=PS, TOPK=TOPK, KP=16, MP=max(16, mr), MR=mr, LOCAL=1, INIT=0,
                  CODE_IDX=3 if fp8 else 0, V2=fp8, TMA=fp8, PCH=32, CL=16, NC_PAD=16,
                  RB1=K._rows_per_merge(mr, 256), RB2=K._rows_per_merge(mr, 256), NUM_STAGES=stages, HPG=hpg, D=D,
                  QC=qc, NQC=-(-nq // qc), MA=ma, KV_FP8=False, CODE_KV=0, NSA_PAD=16, RETURN_LSE=False)
    return build(f"ticket {idx} nq={nq}", K._ticket_kernel, sig, consts, num_warps=warps, num_stages=stages)
