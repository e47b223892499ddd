"""Training throughput of the "small" M3 preset (59M parameters, MoE) at long contexts: MSA
(sparse attention + the indexer KL) against the same model with dense attention through cuDNN
SDPA, on one GPU.

A step: forward under bf16 autocast (float32 master weights), LM loss (+ KL for MSA), backward,
fused AdamW.  Random tokens; batch = max(1, --tokens-per-step // context).  Reported per
context and model: step ms (median of --steps after --warmup), tokens/s, and model FLOP
utilisation against --peak-tflops (H200 bf16 dense: 989):

  model FLOPs per token = 6 x active parameters (routed experts x top_k / E, embeddings out)
                          + 3 x attention forward FLOPs
  attention forward per token and layer: dense 2 Hq D T (causal: T / 2 keys on average);
  MSA 4 Hq D min(topk x block, T / 2) + 2 H_idx D_idx T / 2 (index scoring)

`mfu` uses each model's own FLOPs; `mfu_dense_equiv` charges MSA the dense model's FLOPs (the
work it replaces).

--compile: each model also with its decoder layers under torch.compile
(`msakit.train.trainer.compile_layers`, what `msakit train --compile` does), in the same run:
rows with `compiled` false / true, the compiled row's `first_step_s` (compilation),
`speedup_vs_eager`, dynamo's graph and graph-break counts.

--profile: the kernels of one step (after the timed ones) by kind -- sparse_attn_fwd /
sparse_attn_bwd / index_topk / index_kl (what msakit's custom ops launch), sdpa (cuDNN), gemm,
grouped_gemm, moe_routing, norm, rope, elementwise, reduce, copy, optimizer (AdamW) -- with the
kernel count and device time of each, in the row's `profile` (torch.profiler; a kernel counts
for the custom op or optimizer step around its launch, else by its name).

    python benchmarks/train_speed.py [--contexts 8192 32768] [--tokens-per-step 65536] [--quick]
    python benchmarks/train_speed.py --profile [--compile]

Writes benchmarks/results/train_speed_<gpu><tag>.json (and --out / $OUT) and prints a table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import (  # noqa: E402
    KERNEL_KINDS, add_run_args, env_info, gpu_tag, kernel_table, print_rows, profiled_kernels, save_json, wall_s,
)

H200_BF16_TFLOPS = 989.0

# a kernel launched inside one of these CPU ops (regex on the op's name) is of that kind
TRAIN_OP_KINDS: tuple[tuple[str, str], ...] = (
    ("sparse_attn_fwd", r"msakit::sparse_attention_fwd"),
    ("sparse_attn_bwd", r"msakit::sparse_attention_bwd"),
    ("index_topk", r"msakit::index_topk"),
    ("index_kl", r"msakit::index_kl"),
    ("sdpa", r"scaled_dot_product|flash_attention|efficient_attention|cudnn_attention"),
    ("optimizer", r"Optimizer\.step|adamw"),
    ("grouped_gemm", r"_grouped_mm"),
)
# else by the kernel's name: msakit's Triton kernels, attention, inductor's kernels, then the
# decode profile's kinds (without its decode-only ones)
TRAIN_KERNEL_KINDS: tuple[tuple[str, str], ...] = (
    ("sparse_attn_fwd", r"_sa_fwd"),
    ("sparse_attn_bwd", r"_sa_bwd|_sa_dq"),
    ("index_topk", r"_index_topk_kernel|_quantize_fp8"),
    ("index_kl", r"_stats_kernel|_kl_kernel|^_merge_kernel"),
    ("sdpa", r"cudnn|fmha|flash|sdpa"),
    ("optimizer", r"adam|multi_tensor_apply"),
    ("gemm", r"^triton_tem"),
    ("elementwise", r"^triton_poi"),
    ("reduce", r"^triton_(red|per)"),
    *[k for k in KERNEL_KINDS if k[0] not in ("msa_decode", "sampling")],
)


def active_params(model) -> float:
    """Parameters a token multiplies: matrices except embeddings, routed experts scaled by top_k / E."""
    cfg = model.config
    E, k = cfg.num_local_experts, cfg.num_experts_per_tok
    n = 0.0
    for name, p in model.named_parameters():
        if "embed" in name or p.dim() < 2:
            continue
        n += p.numel() * (k / E if p.dim() == 3 and p.shape[0] == E else 1.0)
    return n


def attn_fwd_flops_per_token(cfg, T: int, mode: str) -> float:
    """Attention forward FLOPs per token summed over layers (see the module docstring)."""
    Hq, D, L = cfg.num_attention_heads, cfg.head_dim, cfg.num_hidden_layers
    if mode == "dense":
        return L * 2 * Hq * D * T
    keys = min(cfg.index_topk_blocks * cfg.index_block_size, T / 2)
    index = 2 * cfg.index_n_heads * cfg.index_head_dim * T / 2
    return L * (4 * Hq * D * keys + index)


def model_flops_per_token(model, T: int, mode: str) -> float:
    return 6 * active_params(model) + 3 * attn_fwd_flops_per_token(model.config, T, mode)


def make_step(model, opt, ids, mode: str, dense_backend: str, device_type: str = "cuda"):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"cudnn": [SDPBackend.CUDNN_ATTENTION], "flash": [SDPBackend.FLASH_ATTENTION]}

    def step():
        ctx = sdpa_kernel(backends[dense_backend]) if mode == "dense" and dense_backend in backends else None
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=device_type == "cuda"):
            if ctx is not None:
                with ctx:
                    out = model(ids, labels=ids, compute_kl=False)
            else:
                out = model(ids, labels=ids, compute_kl=mode == "sparse")
            loss = out.loss.float()
            if mode == "sparse" and out.kl is not None:
                loss = loss + torch.as_tensor(out.kl, device=loss.device, dtype=torch.float32)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def step_profile(step) -> dict:
    """The kernels of one step() by kind (TRAIN_OP_KINDS, then TRAIN_KERNEL_KINDS)."""
    ev, top = profiled_kernels(step, with_ops=True)
    kinds = kernel_table(ev, TRAIN_KERNEL_KINDS, TRAIN_OP_KINDS)
    return {"kernels": len(ev), "device_ms": round(sum(x[1] for x in ev) / 1e3, 3),
            "by_kind": {k: {"count": d["count"], "ms": round(d["us"] / 1e3, 3)}
                        for k, d in sorted(kinds.items(), key=lambda x: -x[1]["us"])},
            "top_kernels_us": [(n[:120], round(u, 1)) for n, u in top]}


def print_profile(row: dict) -> None:
    p = row["profile"]
    print(f"  profile ctx {row['context']} {row['mode']}{' compiled' if row.get('compiled') else ''}: "
          f"{p['kernels']} kernels, {p['device_ms']:.2f} ms of device time", flush=True)
    for kind, d in p["by_kind"].items():
        print(f"    {kind:16s} {d['count']:6d} kernels {d['ms']:9.3f} ms", flush=True)


def measure(context: int, tokens_per_step: int, mode: str, *, steps: int, warmup: int, dense_backend: str,
            peak: float, profile: bool, preset: str = "small", device: str = "cuda", compile: bool = False) -> dict:
    """One row: build the preset, (compile its layers,) warm up, time `steps` steps, (profile one)."""
    import time

    from msakit.models import M3Config, M3ForCausalLM

    torch.manual_seed(0)
    cfg = M3Config.preset(preset, vocab_size=4096, max_position_embeddings=context)
    model = M3ForCausalLM(cfg).to(device).train()
    model.set_attention_mode(mode)
    row: dict = {"context": context, "mode": mode, "compiled": bool(compile), "layers": "compiled" if compile else "eager"}
    if compile:
        from torch._dynamo.utils import counters

        from msakit.train.trainer import compile_layers

        torch._dynamo.reset()
        counters.clear()
        compile_layers(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    B = max(1, tokens_per_step // context)
    ids = torch.randint(0, cfg.vocab_size, (B, context), device=device)
    step = make_step(model, opt, ids, mode, dense_backend, torch.device(device).type)
    for i in range(max(warmup, 1 if compile else 0)):
        t0 = time.perf_counter()
        step()
        if i == 0 and compile:
            if device == "cuda":
                torch.cuda.synchronize()
            row["first_step_s"] = time.perf_counter() - t0
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t = wall_s(step, steps)
    tokens = B * context
    fl = model_flops_per_token(model, context, mode)
    row.update({"batch": B, "tokens_per_step": tokens, "step_ms": t * 1e3,
                "tok_s": tokens / t, "model_tflop_per_step": fl * tokens / 1e12, "mfu": fl * tokens / t / (peak * 1e12),
                "active_params": active_params(model),
                "peak_GiB": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None})
    if mode == "sparse":
        row["mfu_dense_equiv"] = model_flops_per_token(model, context, "dense") * tokens / t / (peak * 1e12)
    if compile:
        row["graphs"] = counters["stats"]["unique_graphs"]
        row["graph_breaks"] = sum(counters["graph_break"].values())
    if profile and device == "cuda":
        row["profile"] = step_profile(step)
        print_profile(row)
    del model, opt, ids, step
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="*", default=[8192, 32768])
    ap.add_argument("--tokens-per-step", type=int, default=65536)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--dense-backend", default="cudnn", choices=("cudnn", "flash", "default"))
    ap.add_argument("--peak-tflops", type=float, default=H200_BF16_TFLOPS)
    ap.add_argument("--profile", action="store_true", help="the kernels of one step by kind (in each row)")
    ap.add_argument("--compile", action="store_true", help="each model also with torch.compile'd decoder layers")
    add_run_args(ap, "smoke run: context 8192, 3 timed steps")
    args = ap.parse_args(argv)
    if args.quick:
        args.contexts, args.steps, args.warmup = [8192], 3, 2
    info = env_info()
    rows = []
    for ctx in args.contexts:
        got: dict[tuple[str, bool], dict] = {}
        for mode in ("dense", "sparse"):
            for comp in ((False, True) if args.compile else (False,)):
                try:
                    r = measure(ctx, args.tokens_per_step, mode, steps=args.steps, warmup=args.warmup,
                                dense_backend=args.dense_backend, peak=args.peak_tflops, profile=args.profile,
                                compile=comp)
                except Exception as e:  # report and go on
                    r = {"context": ctx, "mode": mode, "compiled": comp, "error": repr(e)[:500]}
                    torch.cuda.empty_cache()
                got[mode, comp] = r
        for (mode, comp), r in got.items():
            dense, eager = got.get(("dense", comp), {}), got.get((mode, False), {})
            if mode == "sparse" and "step_ms" in r and "step_ms" in dense:
                r["speedup_vs_dense"] = dense["step_ms"] / r["step_ms"]
            if comp and "step_ms" in r and "step_ms" in eager:
                r["speedup_vs_eager"] = eager["step_ms"] / r["step_ms"]
            print({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items() if k != "profile"}, flush=True)
            rows.append(r)
    save_json(f"train_speed_{gpu_tag(info)}{args.tag}.json",
              {"env": info, "preset": "small", "dense_backend": args.dense_backend, "peak_tflops": args.peak_tflops,
               "compile": args.compile, "rows": rows}, args.out)
    print_rows(rows, [("context", "context", "d"), ("mode", "mode", "s"), ("layers", "layers", "s"),
                      ("B", "batch", "d"), ("step ms", "step_ms", ".1f"), ("tok/s", "tok_s", ".0f"), ("MFU", "mfu", ".1%"),
                      ("vs dense", "speedup_vs_dense", ".2f"), ("vs eager", "speedup_vs_eager", ".2f"),
                      ("compile s", "first_step_s", ".0f")],
               lead=("context", "mode", "compiled"))


if __name__ == "__main__":
    main()
