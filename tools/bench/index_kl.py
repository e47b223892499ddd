"""GPU check and benchmark of the Triton `index_kl_loss` (forward + backward).

    from tools.bench.index_kl import check_and_bench
    for row in check_and_bench():          # T = 16K, 64K, 128K at the M3 shape
        print(row)

Inputs: random bf16 at the M3 shape (B = 1, Hq = 64, G = 4, D = Di = 128, block 128, topk 16),
a random valid selection (the query's own block forced and last, valid ids ascending, -1
padded).  At T <= check_max_T the loss and the gradients are compared with the float32
reference (relative norm errors) and `selected_lse` with its reference.  Timings are medians
of `triton.testing.do_bench`; effective TFLOP/s count 2*Hq*D*topk*bs*T (the recomputed S)
+ 4*G*Di*topk*bs*T (the index logits and the two gradient products) per forward+backward.
Importable on CPU (triton and CUDA are touched only inside the functions).
"""

from __future__ import annotations

import math

import torch

from tools.bench.common import peak_extra, rel_err

M3 = dict(Hq=64, G=4, D=128, Di=128, block_size=128, topk=16)


def random_block_idx(
    B: int, G: int, T: int, block_size: int, topk: int, device="cuda", generator: torch.Generator | None = None
) -> torch.Tensor:
    """int32 [B, G, T, topk]: own block i // block_size always selected (the last valid entry),
    plus min(topk - 1, own) distinct earlier blocks drawn at random; ascending, -1 padded."""
    own = torch.arange(T, device=device) // block_size  # [T]
    k1 = topk - 1
    if k1 > 0:
        span = (own - k1 + 1).clamp(min=1).view(1, 1, T, 1)
        u = torch.rand((B, G, T, k1), device=device, generator=generator)
        r = (u * span).floor().long().clamp(max=span - 1).sort(dim=-1).values
        r = r + torch.arange(k1, device=device)  # strictly increasing, < own when own >= k1
        few = (own < k1).view(1, 1, T, 1)
        r = torch.where(few, torch.arange(k1, device=device).expand_as(r), r)
        r = torch.where(r < own.view(1, 1, T, 1), r, torch.full_like(r, -1))
        sel = torch.cat([r, own.view(1, 1, T, 1).expand(B, G, T, 1)], dim=-1)
    else:
        sel = own.view(1, 1, T, 1).expand(B, G, T, 1).clone()
    big = torch.iinfo(torch.int64).max
    sel = torch.where(sel < 0, torch.full_like(sel, big), sel).sort(dim=-1).values
    return sel.masked_fill(sel == big, -1).to(torch.int32)


def flops(T: int, Hq: int, G: int, D: int, Di: int, block_size: int, topk: int) -> float:
    return 2.0 * Hq * D * topk * block_size * T + 4.0 * G * Di * topk * block_size * T


def _peak_extra_gib(fn) -> float:
    return peak_extra(fn)[0] / 2**30


# Tilings of the KL kernel timed against the default (`check_and_bench(sweep=...)`): run 2 at
# 128K (results/check_gpu_NVIDIA_H200_run2.json, forward with gradients, with / without the saved
# lse): sm90 37.1 / 84.6 ms, hc4 43.2 / 90.8, st8 37.0 / 104.3, tpp16 35.6 / 102.4, tpp4 39.6 / 107.3.
SWEEP_CONFIGS: dict[str, dict] = {
    "sm90": None,  # the default (msakit.ops.index_kl.triton.CONFIGS["sm90"])
    "sm90_hc4": dict(QT=16, TPP=8, HC=4, num_warps=8, num_stages=3),
    "sm90_st8": dict(QT=16, TPP=8, HC=8, num_warps=8, num_stages=2, ST_HC=8, ST_STAGES=2),
    "sm90_tpp16": dict(QT=16, TPP=16, HC=8, num_warps=8, num_stages=2),
    "sm90_tpp4": dict(QT=16, TPP=4, HC=8, num_warps=8, num_stages=2),
}


def _config(name: str):
    """A SWEEP_CONFIGS entry as index_kl_fwd_triton's config (a dict, or a CONFIGS name)."""
    return SWEEP_CONFIGS[name] if SWEEP_CONFIGS.get(name) is not None else name


def check_and_bench(
    T_list=(16384, 65536, 131072),
    device="cuda",
    *,
    check_max_T: int = 16384,
    sweep: tuple[str, ...] = tuple(SWEEP_CONFIGS),
    sweep_T: int | None = None,
    seed: int = 0,
    shape: dict | None = None,
    timing: bool = True,
    dtype: torch.dtype = torch.bfloat16,
) -> list[dict]:
    """One dict per T: errors vs the float32 reference (T <= check_max_T), median times (ms) of
    forward+backward with the selected-token `lse` given (sparse training) and without it (dense
    warm-up: includes the selected_lse pass), of the k2q build and of `selected_lse` alone,
    effective TFLOP/s, peak extra memory (GiB beyond the inputs).  `sweep`: configs of
    SWEEP_CONFIGS timed (forward with gradients, with and without lse) at sweep_T
    (default: the largest T) for tuning; pass () to skip.  `shape` overrides M3's entries;
    timing=False only checks (e.g. on CPU under TRITON_INTERPRET=1 with a tiny shape and
    dtype=torch.float16: the interpreter's bf16 dot is wrong)."""
    import triton

    from msakit.ops.index_kl import index_kl_loss, selected_lse
    from msakit.ops.k2q import build_k2q
    from msakit.ops.index_kl.reference import index_kl_loss_reference, selected_lse_reference
    from msakit.ops.index_kl.triton import index_kl_fwd_triton, pick_config

    dev = torch.device(device)
    shp = dict(M3, **(shape or {}))
    Hq, G, D, Di, bs, topk = (shp[k] for k in ("Hq", "G", "D", "Di", "block_size", "topk"))
    scale, iscale = 1.0 / math.sqrt(D), 1.0 / math.sqrt(Di)
    sweep_T = sweep_T if sweep_T is not None else max(T_list)
    rows = []
    for T in T_list:
        gen = torch.Generator(device=dev).manual_seed(seed + T)
        q = torch.randn(1, T, Hq, D, device=dev, generator=gen).to(dtype)
        k = torch.randn(1, T, G, D, device=dev, generator=gen).to(dtype)
        q_idx = torch.randn(1, T, G, Di, device=dev, generator=gen).to(dtype).requires_grad_(True)
        k_idx = torch.randn(1, T, Di, device=dev, generator=gen).to(dtype).requires_grad_(True)
        bi = random_block_idx(1, G, T, bs, topk, dev, generator=gen)
        lse = selected_lse(q, k, bi, block_size=bs, backend="triton")
        row: dict = dict(T=T, Hq=Hq, G=G, D=D, Di=Di, block_size=bs, topk=topk,
                         config=pick_config(dev, Hq // G, None, dtype))

        def step(with_lse: bool):
            loss = index_kl_loss(q, k, q_idx, k_idx, bi, block_size=bs, lse=lse if with_lse else None,
                                 backend="triton")
            loss.backward()
            return loss

        if T <= check_max_T:
            loss = step(True).detach()
            dq, dk = q_idx.grad.clone(), k_idx.grad.clone()
            q_idx.grad = k_idx.grad = None
            loss_nolse = step(False).detach()
            dq2, dk2 = q_idx.grad.clone(), k_idx.grad.clone()
            q_idx.grad = k_idx.grad = None
            qr = q_idx.detach().float().requires_grad_(True)
            kr = k_idx.detach().float().requires_grad_(True)
            ref = index_kl_loss_reference(q.float(), k.float(), qr, kr, bi, block_size=bs)
            ref.backward()
            ref = ref.detach()
            lref = selected_lse_reference(q.float(), k.float(), bi, block_size=bs)
            row.update(
                loss=float(loss), loss_ref=float(ref),
                loss_rel_err=abs(float(loss) - float(ref)) / abs(float(ref)),
                loss_rel_err_no_lse=abs(float(loss_nolse) - float(ref)) / abs(float(ref)),
                dq_rel_err=rel_err(dq, qr.grad), dk_rel_err=rel_err(dk, kr.grad),
                dq_rel_err_no_lse=rel_err(dq2, qr.grad), dk_rel_err_no_lse=rel_err(dk2, kr.grad),
                lse_max_abs_err=float((lse - lref).abs().max()),
            )
            row["ok"] = bool(
                row["loss_rel_err"] < 1e-3 and row["loss_rel_err_no_lse"] < 1e-3 and row["dq_rel_err"] < 2e-2
                and row["dk_rel_err"] < 2e-2 and row["dq_rel_err_no_lse"] < 2e-2 and row["dk_rel_err_no_lse"] < 2e-2
                and row["lse_max_abs_err"] < 1e-2
            )
            del qr, kr, ref, lref
        if not timing:
            rows.append(row)
            continue
        f = flops(T, Hq, G, D, Di, bs, topk)
        ms = triton.testing.do_bench(lambda: step(True), grad_to_none=[q_idx, k_idx], return_mode="median")
        ms_nolse = triton.testing.do_bench(lambda: step(False), grad_to_none=[q_idx, k_idx], return_mode="median")
        with torch.no_grad():
            ms_fwd_only = triton.testing.do_bench(
                lambda: index_kl_loss(q, k, q_idx, k_idx, bi, block_size=bs, lse=lse, backend="triton"),
                return_mode="median")
        cfg = row["config"]
        ms_k2q = triton.testing.do_bench(lambda: build_k2q(bi, bs, cfg["QT"] * cfg["TPP"]), return_mode="median")
        ms_lse = triton.testing.do_bench(lambda: selected_lse(q, k, bi, block_size=bs, backend="triton"),
                                         return_mode="median")
        q_idx.grad = k_idx.grad = None
        row.update(
            ms_fwd_bwd=ms, ms_fwd_bwd_no_lse=ms_nolse, ms_fwd_no_grad=ms_fwd_only, ms_k2q=ms_k2q,
            ms_selected_lse=ms_lse,
            tflops=f / ms * 1e-9, tflops_no_lse=f / ms_nolse * 1e-9,
            tflops_selected_lse=2.0 * Hq * D * topk * bs * T / ms_lse * 1e-9,
            peak_extra_gib=_peak_extra_gib(lambda: step(True)),
            peak_extra_gib_no_lse=_peak_extra_gib(lambda: step(False)),
        )
        q_idx.grad = k_idx.grad = None
        if sweep and T == sweep_T:
            for key, given in (("sweep_ms_fwd_with_grads", lse), ("sweep_ms_fwd_with_grads_no_lse", None)):
                res = {}
                for name in sweep:
                    try:
                        res[name] = triton.testing.do_bench(
                            lambda: index_kl_fwd_triton(q, k, q_idx, k_idx, bi, given, None, bs, scale, iscale,
                                                        True, config=_config(name)),
                            return_mode="median")
                    except Exception as e:  # a config that does not fit is reported, not fatal
                        res[name] = f"{type(e).__name__}: {e}"[:200]
                row[key] = res
        rows.append(row)
        del q, k, q_idx, k_idx, bi, lse
        torch.cuda.empty_cache()
    return rows


def ptxas_report(configs=("sm90",), arch: int = 90, T: int = 131072, shape: dict | None = None) -> list[dict]:
    """Compile the kernels for sm_{arch} without a GPU (Triton's bundled ptxas) with the argument
    specialisation the JIT would apply at the M3 shape, and report registers / spills / shared
    memory per kernel and config.  A kernel over 255 registers spills; over 227 KB of shared
    memory (sm_90) it cannot launch."""
    from tools.cuda_compile import compile_cuda, res_usage

    from msakit.ops.index_kl import triton as K

    shp = dict(M3, **(shape or {}))
    G, D, Di, bs, topk = (shp[k] for k in ("G", "D", "Di", "block_size", "topk"))
    hpg = shp["Hq"] // G
    Hq = shp["Hq"]
    args = dict(q_ptr="*bf16", k_ptr="*bf16", qi_ptr="*bf16", ki_ptr="*bf16", q_index_ptr="*i32", q_slot_ptr="*i32",
                tile_key_ptr="*i32", tile_start_ptr="*i32", tile_count_ptr="*i32", blk_start_ptr="*i64",
                blk_end_ptr="*i64", lse_ptr="*fp32", lsei_ptr="*fp32", kl_part_ptr="*fp32", dq_ptr="*fp32",
                dk_ptr="*fp32", part_h_ptr="*fp32", part_i_ptr="*fp32", part_ptr="*fp32", out_ptr="*fp32",
                T=T, NB=T // bs, bsz=bs, K=topk, n_items=T * Hq,
                sq_b=T * Hq * D, sq_t=Hq * D, sq_h=D, sk_b=T * G * D, sk_t=G * D, sk_g=D,
                sqi_b=T * G * Di, sqi_t=G * Di, sqi_g=Di, ski_b=T * Di, ski_t=Di,
                scale_log2=0.1, iscale=0.1, iscale_log2=0.1, grad_scale=0.1)  # pointers, ints, floats

    def build(fn, consts, num_warps, num_stages):
        k = compile_cuda(fn, args, consts, capability=arch, num_warps=num_warps, num_stages=num_stages)
        u = res_usage(k)
        return dict(registers=u["registers"], spill_bytes=u["stack"], smem_bytes=u["shared"])

    rows = []
    for name in configs:
        cfg = K.pick_config(torch.device("cuda"), hpg, _config(name))
        common = dict(G=G, HPG=hpg, QT=cfg["QT"], D=D, DI=Di, BS=K._np2(bs), BD=K._np2(D), BDI=K._np2(Di),
                      VARLEN=False, PREC_QK="tf32", PREC_IDX="tf32")
        rows.append(dict(config=name, kernel="kl", **build(
            K._kl_kernel, dict(common, HC=cfg["HC"], GRAD=True), cfg["num_warps"],
            cfg["num_stages"])))
        rows.append(dict(config=name, kernel="stats_heads", **build(
            K._stats_kernel, dict(common, HC=cfg["ST_HC"], HEADS=True, IDX=True), cfg["num_warps"],
            cfg["ST_STAGES"])))
        rows.append(dict(config=name, kernel="stats_idx", **build(
            K._stats_kernel, dict(common, HC=1, HEADS=False, IDX=True), cfg["num_warps"], cfg["ST_STAGES"])))
    return rows


if __name__ == "__main__":  # pragma: no cover - GPU only
    for r in check_and_bench():
        print(r)
