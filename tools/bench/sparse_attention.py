"""GPU check and benchmark of the KV-outer Triton `sparse_attention` (imports on CPU; runs on CUDA).

    from tools.bench.sparse_attention import check_and_bench
    rows = check_and_bench()        # T = 16K .. 1M at the M3 shape (Hq=64, G=4, D=128, bs=128, topk=16)

Per T: random bf16 inputs and a random valid selection (`random_block_idx`), the forward checked
against an fp32 evaluation of the reference's meaning (all rows at T <= full_check_T, sampled rows
above: `reference_rows`), the backward against fp32 autograd of the reference at T <= bwd_check_T,
every output poisoned with NaN first (and the kernels' internal partial buffers too) and checked
to be fully written, median times of the forward and of forward + backward, effective TFLOP/s
(forward 4*Hq*D*topk*bs*T, backward 2.5x that) and the peak extra memory, with the kernels'
default configurations (`FWD_CONFIG` / `BWD_CONFIG`).

`compile_report()` compiles the kernels for sm_90 without a GPU (registers, spills, shared
memory, SASS counts).
"""

from __future__ import annotations

import math

import torch

from tools.bench.common import peak_extra as _peak_extra
from tools.bench.common import rel_err
from tools.bench.common import time_ms as _time_ms
from msakit.ops.sparse_attention.reference import sparse_attention_reference

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
    seed: int = 0,
    verbose: bool = True,
) -> list[dict]:
    """One dict per T with: T, fwd_ms, fwd_tflops, fwdbwd_ms,
    bwd_ms (= fwdbwd - fwd), bwd_tflops, fwd_peak_extra_GiB (beyond q, k, v, block_idx, o, lse),
    fwdbwd_peak_extra_GiB (beyond those, dO and the three gradients), fwd_kernel_ms (the
    launcher alone, without the public op's checks), o_rel_err / lse_max_abs_err
    (vs fp32 reference; on `check_rows` sampled rows above full_check_T), dq/dk/dv_rel_err
    (T <= bwd_check_T), fwd_all_written / bwd_all_written (no NaN left in poisoned outputs),
    fwd_config / bwd_config, and error (a string) when something raised.
    """
    from msakit.ops.sparse_attention import sparse_attention
    from msakit.ops.sparse_attention import triton as kernels

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

    # ------------------------------------------------------------------ per T
    for T in T_list:
        row: dict = {"T": T, "fwd_config": repr(kernels.FWD_CONFIG), "bwd_config": repr(kernels.BWD_CONFIG)}
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


def compile_report(arch: int = 90, T: int = 131072, worklist: bool = True, sass: bool = False) -> list[dict]:
    """Compile the forward and backward kernels (FWD_CONFIG / BWD_CONFIG), the forward's slot
    merge, the dq reduce and the work-list kernels at the M3 shape for sm_<arch> WITHOUT a GPU
    (Triton's bundled ptxas; run with TRITON_INTERPRET unset) and report registers, spills
    (stack bytes) and shared memory; sass=True adds per kernel the SASS counts of global loads /
    stores, shared loads / stores and barriers."""
    import triton

    from msakit.ops.sparse_attention import triton as K
    from tools.cuda_compile import compile_cuda, cuobjdump, res_usage

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
                row.update(ldg=sa.count("LDG."), stg=sa.count("STG."), bar=sa.count("BAR.SYNC"),
                           lds=sa.count("LDS."), sts=sa.count("STS."))
        except Exception as ex:  # reported, not fatal
            row = {"kernel": name, "error": f"{type(ex).__name__}: {ex}"[:400]}
        print(row, flush=True)
        rows.append(row)

    cfg = K.FWD_CONFIG
    q_tile, bm, bn, bd, _ = K._tile(cfg, geo)
    sig = dict(Q="*bf16", K="*bf16", V="*bf16", OP="*bf16", LP="*fp32", ENT_Q="*i32", IT_KEY="*i64",
               IT_START="*i64", IT_COUNT="*i32", GRP_ENT="*i32", GRP_ITEM="*i32", N=T, n0=C, qk_scale=0.1, grp=1,
               max_items=C)
    consts = dict(HQ=Hq, G=G, D=D, KS=KS, BS=bs, HPG=geo.hpg, Q_TILE=q_tile, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd,
                  PREC="tf32", UPCAST=False, SKIP_EMPTY=False)
    build("fwd", K._sa_fwd_kernel, sig, consts, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    cfg = K.BWD_CONFIG
    q_tile, bm, bn, bd, _ = K._tile(cfg, geo)
    sig = dict(Q="*bf16", K="*bf16", V="*bf16", DO="*bf16", LSE2="*fp32", DELTA="*fp32", DQP="*bf16", DKA="*fp32",
               DVA="*fp32", ENT_Q="*i32", IT_KEY="*i64", IT_START="*i64", IT_COUNT="*i32", GRP_ENT="*i32",
               GRP_ITEM="*i32", N=T, n0=C, qk_scale=0.1, sm_scale=0.1, grp=1, max_items=C)
    consts = dict(HQ=Hq, G=G, D=D, KS=KS, BS=bs, HPG=geo.hpg, Q_TILE=q_tile, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd,
                  PREC="tf32", UPCAST=False, SKIP_EMPTY=False)
    build("bwd", K._sa_bwd_kernel, sig, consts, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    rbt, rbh, rbd = K._reduce_tile(geo.hpg, D)  # the merge runs per group
    sig = dict(P="*bf16", LP="*fp32", NV="*i32", INV="*i32", GRP_ENT="*i32", OUT="*bf16", LSE="*fp32", n0=C, C=C, T=T,
               grp=1)
    consts = dict(HQ=Hq, D=D, KS=KS, HPG=geo.hpg, BLOCK_T=rbt, BLOCK_H=rbh, BLOCK_D=rbd)
    build("fwd merge", K._sa_fwd_merge_kernel, sig, consts, num_warps=K.REDUCE_WARPS, num_stages=1)
    bhp = triton.next_power_of_2(geo.hpg)
    sig = dict(P="*bf16", NV="*i32", INV="*i32", GRP_ENT="*i32", OUT="*bf16", n0=C, C=C, grp=1)
    consts = dict(HQ=Hq, D=D, KS=KS, HPG=geo.hpg, BLOCK_T=max(1, 16 // bhp), BLOCK_HP=bhp, BLOCK_D=D,
                  NUM_STAGES=K.DQ_REDUCE_STAGES)
    build("dq reduce", K._sa_dq_reduce_kernel, sig, consts, num_warps=K.DQ_REDUCE_WARPS, num_stages=K.DQ_REDUCE_STAGES)
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


if __name__ == "__main__":  # pragma: no cover
    import json
    import sys

    Ts = tuple(int(x) for x in sys.argv[1:]) or (16384, 65536, 131072, 262144, 1048576)
    print(json.dumps(check_and_bench(Ts), indent=1))
