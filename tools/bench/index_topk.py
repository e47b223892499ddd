"""GPU check and benchmark of the fused Triton `index_topk` (imports on CPU; runs on CUDA).

    from tools.bench.index_topk import check_and_bench, CANDIDATE_CONFIGS
    rows = check_and_bench()            # T = 16K .. 1M at the M3 shape, bf16 and fp8 scoring
    rows = check_and_bench(T_list=(131072,), configs=CANDIDATE_CONFIGS)   # config sweep

Correctness on long sequences uses `rows_reference`: the reference's meaning evaluated only for
a sample of (batch, group, query) rows (row i depends on tokens <= i only), O(rows * T) instead
of the full reference's O(T^2).  It is tested against `index_topk_reference` on CPU.
"""

from __future__ import annotations

import math

import torch

from tools.bench.common import peak_extra as _peak_extra
from tools.bench.common import time_ms
from msakit.ops.index_topk.reference import fp8_scoring_inputs

M3_SHAPE = dict(G=4, Di=128, block_size=128, topk=16)

# Kernel configurations worth timing on the GPU (check_and_bench(configs=CANDIDATE_CONFIGS)).
# TMA loads key tiles by tensor-map copies (no per-thread addresses); 2 CTAs per SM (128 rows x
# 8 warps capped at 128 registers, or x 4 warps, with 2 key stages) let one CTA's ALU work
# overlap the other's wgmma.  maxnreg caps the registers (fp8 then spills a little).  Registers /
# shared memory / CTAs per SM: compile_report(configs={"bf16": CANDIDATE_CONFIGS}).  Run 3's
# sweep at 128K (results/index_topk_sweep_NVIDIA_H200_run3.json) chose the defaults; every lane
# keeping a row's whole top-k (the former LANES=1) measured 397 TFLOP/s against 557-654 for the
# lane-split top-k and was removed.
CANDIDATE_CONFIGS = [
    dict(BLOCK_M=128, num_warps=8, num_stages=3, TMA=False),  # 0 1 CTA/SM, cp.async
    dict(BLOCK_M=128, num_warps=8, num_stages=3, TMA=True),  # 1 1 CTA/SM, TMA
    dict(BLOCK_M=128, num_warps=8, num_stages=2, TMA=False, maxnreg=128),  # 2 2 CTAs x 8 warps
    dict(BLOCK_M=128, num_warps=8, num_stages=2, TMA=True, maxnreg=128),  # 3 same, TMA (bf16 default)
    dict(BLOCK_M=128, num_warps=8, num_stages=2, TMA=True, maxnreg=128, SHFL=False),  # 4 = 3, gather
    dict(BLOCK_M=128, num_warps=4, num_stages=2, TMA=True),  # 5 2 CTAs x 4 warps, TMA
    dict(BLOCK_M=128, num_warps=4, num_stages=4, TMA=True),  # 6 fp8 default (2 CTAs); bf16: 1 CTA
    dict(BLOCK_M=64, num_warps=4, num_stages=3, TMA=True),  # 7 2 CTAs, 2x the key traffic
    dict(BLOCK_M=256, num_warps=8, num_stages=2, TMA=True),  # 8 1 CTA, half the key traffic
]


# ----------------------------------------------------------------------------- reference rows

def rows_scores(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    b: torch.Tensor,
    g: torch.Tensor,
    i: torch.Tensor,
    *,
    block_size: int,
    local_blocks: int = 1,
    init_blocks: int = 0,
) -> torch.Tensor:
    """The reference's ranked block scores M (forced +inf, invalid -inf) for rows (b, g, i).

    b, g, i: int tensors [R].  Returns float32 (float64 for float64 inputs) [R, nblocks].
    """
    B, T, G, Di = q_idx.shape
    dev = q_idx.device
    cdt = torch.float64 if q_idx.dtype == torch.float64 else torch.float32
    nb = (T + block_size - 1) // block_size
    b, g, i = b.long().to(dev), g.long().to(dev), i.long().to(dev)
    R = b.numel()
    out = torch.empty((R, nb), dtype=cdt, device=dev)
    chunk = max(1, (1 << 27) // max(1, nb * block_size))
    cols = torch.arange(nb * block_size, device=dev)
    blocks = torch.arange(nb, device=dev).view(1, -1)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for r0 in range(0, R, chunk):
            r1 = min(R, r0 + chunk)
            bb, gg, ii = b[r0:r1], g[r0:r1], i[r0:r1]
            q = q_idx[bb, ii, gg].to(cdt)  # [C, Di]
            s = torch.full((r1 - r0, nb * block_size), float("-inf"), dtype=cdt, device=dev)
            for bu in torch.unique(bb).tolist():
                sel = (bb == bu).nonzero().squeeze(1)
                s[sel, :T] = q[sel] @ k_idx[bu].to(cdt).T
            s = s.masked_fill(cols.view(1, -1) > ii.view(-1, 1), float("-inf"))
            M = s.view(r1 - r0, nb, block_size).amax(dim=-1)
            own = (ii // block_size).view(-1, 1)
            forced = ((blocks <= own) & (blocks > own - local_blocks)) | ((blocks < init_blocks) & (blocks <= own))
            M = M.masked_fill(forced, float("inf")).masked_fill(blocks > own, float("-inf"))
            out[r0:r1] = M
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    return out


def select_from_scores(M: torch.Tensor, topk: int) -> torch.Tensor:
    """Reference selection from ranked scores M [R, nb]: int32 [R, topk], -1 padded."""
    R, nb = M.shape
    order = torch.sort(M, dim=-1, descending=True, stable=True)
    kk = min(topk, nb)
    ids = order.indices[:, :kk].to(torch.int32).masked_fill(order.values[:, :kk] == float("-inf"), -1)
    out = torch.full((R, topk), -1, dtype=torch.int32, device=M.device)
    out[:, :kk] = ids
    return out


def rows_reference(q_idx, k_idx, b, g, i, *, block_size, topk, local_blocks=1, init_blocks=0):
    """index_topk_reference(q_idx, k_idx)[b, g, i] for the given rows only -> (ids [R, topk], M [R, nb])."""
    M = rows_scores(q_idx, k_idx, b, g, i, block_size=block_size, local_blocks=local_blocks, init_blocks=init_blocks)
    return select_from_scores(M, topk), M


# ----------------------------------------------------------------------------- agreement

def as_sets(sel: torch.Tensor) -> torch.Tensor:
    """Rows of a selection [..., topk] as sorted sets: valid ids ascending, then -1 (int64)."""
    s = sel.long()
    big = torch.iinfo(torch.int64).max
    s = torch.where(s < 0, torch.full_like(s, big), s).sort(dim=-1).values
    return s.masked_fill(s == big, -1)


def agreement_rate(sel: torch.Tensor, ref: torch.Tensor, M: torch.Tensor | None = None, rtol: float = 1e-3) -> dict:
    """Fraction of rows whose selected sets are equal (order ignored).

    sel, ref: [..., topk] selections of the same rows.  With M (the rows' ranked reference
    scores, [R, nb] for sel/ref flattened to [R, topk]), also `agree_tol`: rows equal, or whose
    selected scores equal the reference's as sorted multisets within rtol of the row's largest
    finite |score| (a swap at a near-tie).  Also `recall`: mean |sel & ref| / |ref|.
    """
    a = as_sets(sel).reshape(-1, sel.shape[-1])
    r = as_sets(ref).reshape(-1, ref.shape[-1])
    eq = (a == r).all(dim=-1)
    res = {"rows": int(eq.numel()), "agree": float(eq.float().mean()) if eq.numel() else 1.0}
    # recall of the reference's valid ids
    inter = ((a.unsqueeze(-1) == r.unsqueeze(-2)) & (r.unsqueeze(-2) >= 0)).any(dim=-1).sum(dim=-1)
    nref = (r >= 0).sum(dim=-1).clamp(min=1)
    res["recall"] = float((inter.float() / nref.float()).mean()) if eq.numel() else 1.0
    if M is not None:
        Mf = M.float()
        fin = torch.where(torch.isfinite(Mf), Mf.abs(), torch.zeros_like(Mf))
        tol = rtol * fin.amax(dim=-1, keepdim=True).clamp(min=1e-6)
        ninf = torch.full_like(Mf[:, :1], float("-inf"))
        Mp = torch.cat([Mf, ninf], dim=1)  # index -1 -> the appended -inf
        va = torch.gather(Mp, 1, torch.where(a < 0, Mf.shape[1], a)).sort(dim=-1, descending=True).values
        vr = torch.gather(Mp, 1, torch.where(r < 0, Mf.shape[1], r)).sort(dim=-1, descending=True).values
        same = (va == vr) | ((va - vr).abs() <= tol)
        ok = eq | same.all(dim=-1)
        res["agree_tol"] = float(ok.float().mean()) if ok.numel() else 1.0
    return res


def sample_rows(B: int, G: int, T: int, n: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """n (b, g, i) rows: the first and last query of each group plus uniform random ones."""
    fixed_i = torch.tensor([0, T - 1, min(T - 1, 127), min(T - 1, 128)])
    fb = torch.zeros(4 * G, dtype=torch.long)
    fg = torch.arange(G).repeat_interleave(4)
    fi = fixed_i.repeat(G)
    m = max(0, n - fb.numel())
    rb = torch.randint(0, B, (m,), generator=generator)
    rg = torch.randint(0, G, (m,), generator=generator)
    ri = torch.randint(0, T, (m,), generator=generator)
    return torch.cat([fb, rb])[:n], torch.cat([fg, rg])[:n], torch.cat([fi, ri])[:n]


# ----------------------------------------------------------------------------- entry point


def _time_ms(fn) -> float:
    return time_ms(fn, long_ms=100.0, rep=100)


def check_and_bench(
    T_list=(16384, 65536, 131072, 262144, 1048576),
    device="cuda",
    *,
    G: int = M3_SHAPE["G"],
    Di: int = M3_SHAPE["Di"],
    block_size: int = M3_SHAPE["block_size"],
    topk: int = M3_SHAPE["topk"],
    local_blocks: int = 1,
    init_blocks: int = 0,
    n_check_rows: int = 256,
    score_dtypes=("bf16", "fp8"),
    configs: list[dict] | None = None,
    seed: int = 0,
    verbose: bool = True,
) -> list[dict]:
    """For each T: correctness on sampled rows, agreement rate, time and TFLOP/s, peak memory.

    One dict per (T, score dtype[, config]) with: T, score_dtype, config, ms (median, whole op:
    fp8 includes the quantization), kernel_ms (fp8: the kernel alone on pre-quantized inputs),
    tflops (G*Di*T^2 / time, the causal half of 2*G*Di*T^2), agree / agree_tol / recall vs the
    reference on n_check_rows rows (fp8: vs the reference on the fp8-rounded inputs, plus
    agree_vs_bf16_ref / recall_vs_bf16_ref against the unquantized reference), peak_extra_bytes
    (max_memory_allocated delta during one call, output included) and out_bytes, ok (agree_tol
    >= 0.999), and for fp8 quant_ms (quantizing q_idx and k_idx).  `configs` (list of config
    dicts, e.g. CANDIDATE_CONFIGS) sweeps kernel configs.
    """
    from msakit.ops.index_topk import index_topk
    from msakit.ops.fp8 import quantize_fp8_reference as quantize_fp8_rows
    from msakit.ops.index_topk.triton import launch
    from msakit.ops.fp8_triton import quantize_fp8_triton as quantize_fp8

    dev = torch.device(device)
    sel_kw = dict(block_size=block_size, topk=topk, local_blocks=local_blocks, init_blocks=init_blocks)
    results = []
    for T in T_list:
        gen = torch.Generator().manual_seed(seed + T)
        q = torch.randn((1, T, G, Di), generator=gen).to(device=dev, dtype=torch.bfloat16)
        k = torch.randn((1, T, Di), generator=gen).to(device=dev, dtype=torch.bfloat16)
        b, g, i = sample_rows(1, G, T, n_check_rows, gen)
        ref_sel, ref_M = rows_reference(q, k, b, g, i, **sel_kw)
        flops = G * Di * float(T) * float(T)
        for sd in score_dtypes:
            fp8 = sd == "fp8"
            if fp8:
                qf, kf = fp8_scoring_inputs(q, k)
                chk_sel, chk_M = rows_reference(qf, kf, b, g, i, **sel_kw)
                q8, _ = quantize_fp8_rows(q)
                k8, ks = quantize_fp8_rows(k)
                del qf, kf
            else:
                chk_sel, chk_M = ref_sel, ref_M
            for cfg in (configs or [None]):
                row = {"T": T, "score_dtype": sd, "config": cfg, "G": G, "Di": Di, **sel_kw}
                try:
                    if cfg is None:
                        def op():
                            return index_topk(q, k, score_dtype="fp8" if fp8 else None, backend="triton", **sel_kw)
                    else:
                        from msakit.ops.index_topk import Selection
                        from msakit.ops.index_topk.triton import index_topk_triton

                        def op(cfg=cfg):
                            return index_topk_triton(q, k, Selection(**sel_kw), score_dtype="fp8" if fp8 else None,
                                                     config=cfg)
                    op()  # compile outside the memory measurement
                    peak, out = _peak_extra(op)
                    got = out[b.to(dev), g.to(dev), i.to(dev)]
                    row.update(agreement_rate(got, chk_sel, chk_M))
                    if fp8:
                        vs = agreement_rate(got, ref_sel, ref_M)
                        row["agree_vs_bf16_ref"] = vs["agree"]
                        row["recall_vs_bf16_ref"] = vs["recall"]
                    del out, got
                    ms = _time_ms(op)
                    row["ms"] = ms
                    if fp8:
                        row["kernel_ms"] = _time_ms(lambda: launch(q8, k8, ks, config=cfg, **sel_kw))
                        row["quant_ms"] = _time_ms(lambda: (quantize_fp8(q), quantize_fp8(k)))
                    else:
                        row["kernel_ms"] = ms
                    row["tflops"] = flops / (ms * 1e-3) / 1e12
                    row["kernel_tflops"] = flops / (row["kernel_ms"] * 1e-3) / 1e12
                    row["peak_extra_bytes"] = peak
                    row["out_bytes"] = G * T * topk * 4
                    row["ok"] = row.get("agree_tol", 0.0) >= 0.999
                except Exception as e:  # keep going: report the failure in the row
                    row["error"] = f"{type(e).__name__}: {e}"[:2000]
                    row["ok"] = False
                results.append(row)
                if verbose:
                    print(_fmt(row), flush=True)
            if fp8:
                del q8, k8, ks
        del q, k
        torch.cuda.empty_cache()
    return results


def _fmt(row: dict) -> str:
    if "error" in row:
        return f"index_topk T={row['T']} {row['score_dtype']} cfg={row['config']}: ERROR {row['error'][:300]}"
    s = (
        f"index_topk T={row['T']:>8} {row['score_dtype']:>4} cfg={row['config']}: "
        f"{row['ms']:9.3f} ms ({row['tflops']:6.1f} TFLOP/s; kernel {row['kernel_ms']:.3f} ms, "
        f"{row['kernel_tflops']:.1f}), agree {row['agree']:.4f} tol {row.get('agree_tol', math.nan):.4f} "
        f"recall {row['recall']:.5f}, peak +{row['peak_extra_bytes'] / 2**20:.0f} MiB "
        f"(out {row['out_bytes'] / 2**20:.0f} MiB)"
    )
    if "quant_ms" in row:
        s += f", fp8 quantization {row['quant_ms']:.3f} ms"
    if "agree_vs_bf16_ref" in row:
        s += f", vs bf16 ref agree {row['agree_vs_bf16_ref']:.4f} recall {row['recall_vs_bf16_ref']:.4f}"
    return s


# ----------------------------------------------------------------------------- ahead-of-time check

def compile_for(q, k, k_scale=None, *, capability: int = 90, **kw):
    """Compile (not run) the kernel a `launch` with these arguments would use, for a CUDA target.

    Needs no GPU (the triton wheel ships ptxas) and TRITON_INTERPRET unset.  Tensors may live on
    the CPU; integer arguments are specialised like the launcher does (== 1 -> constant,
    multiple of 16 -> divisibility hint; pointers are assumed 16-byte aligned).  Returns the
    triton CompiledKernel (asm["ttgir"], asm["ptx"], asm["cubin"], metadata.shared).
    """
    from msakit.ops.dispatch import interpret_mode
    from msakit.ops.index_topk import triton as K
    from tools.cuda_compile import compile_cuda

    if interpret_mode():
        raise RuntimeError("compile_for needs TRITON_INTERPRET unset (the kernel is interpreted otherwise)")
    _, _, args, constexprs, options = K._prepare(q, k, k_scale, **kw)
    return compile_cuda(K._index_topk_kernel, dict(zip(K._index_topk_kernel.arg_names, args)), constexprs,
                        capability=capability, **options)


def compile_report(T: int = 4096, G: int = 4, Di: int = 128, block_size: int = 128, topk: int = 16,
                   configs: dict | None = None) -> list[dict]:
    """sm_90 resource usage of the M3-shape kernels (bf16, fp8, varlen bf16), without a GPU.

    configs: {variant: [config dict or None (the default), ...]} for variants "bf16", "fp8",
    "bf16_varlen" (default: the default configuration of each).
    """
    q = torch.empty((1, T, G, Di), dtype=torch.bfloat16)
    k = torch.empty((1, T, Di), dtype=torch.bfloat16)
    q8, k8 = q.to(torch.float8_e4m3fn), k.to(torch.float8_e4m3fn)
    ks = torch.empty((1, T), dtype=torch.float32)
    cu = torch.tensor([0, T // 2, T], dtype=torch.int32)
    kw = dict(block_size=block_size, topk=topk, local_blocks=1, init_blocks=0)
    variants = [
        ("bf16", (q, k, None), {}),
        ("fp8", (q8, k8, ks), {}),
        ("bf16_varlen", (q, k, None), {"cu_seqlens": cu}),
    ]
    from tools.sass import resource_usage

    rows = []
    for name, (a, b, c), extra in variants:
        for cfg in (configs or {}).get(name, [None]):
            ck = compile_for(a, b, c, config=cfg, **kw, **extra)
            rows.append({"variant": name, "config": cfg, **resource_usage(ck)})
    return rows


if __name__ == "__main__":  # pragma: no cover - GPU only
    check_and_bench()
