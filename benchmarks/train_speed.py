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
work it replaces).  --profile prints torch.profiler's top operators of one step per model.

    python benchmarks/train_speed.py [--contexts 8192 32768] [--tokens-per-step 65536] [--quick]

Writes benchmarks/results/train_speed_<gpu><tag>.json (and --out / $OUT) and prints a table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import add_run_args, env_info, gpu_tag, print_rows, save_json, wall_s  # noqa: E402

H200_BF16_TFLOPS = 989.0


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


def measure(context: int, tokens_per_step: int, mode: str, *, steps: int, warmup: int, dense_backend: str,
            peak: float, profile: bool, preset: str = "small", device: str = "cuda") -> dict:
    from msakit.models import M3Config, M3ForCausalLM

    torch.manual_seed(0)
    cfg = M3Config.preset(preset, vocab_size=4096, max_position_embeddings=context)
    model = M3ForCausalLM(cfg).to(device).train()
    model.set_attention_mode(mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    B = max(1, tokens_per_step // context)
    ids = torch.randint(0, cfg.vocab_size, (B, context), device=device)
    step = make_step(model, opt, ids, mode, dense_backend, torch.device(device).type)
    for _ in range(warmup):
        step()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t = wall_s(step, steps)
    tokens = B * context
    fl = model_flops_per_token(model, context, mode)
    row = {"context": context, "mode": mode, "batch": B, "tokens_per_step": tokens, "step_ms": t * 1e3,
           "tok_s": tokens / t, "model_tflop_per_step": fl * tokens / 1e12, "mfu": fl * tokens / t / (peak * 1e12),
           "active_params": active_params(model),
           "peak_GiB": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None}
    if mode == "sparse":
        row["mfu_dense_equiv"] = model_flops_per_token(model, context, "dense") * tokens / t / (peak * 1e12)
    if profile:
        from torch.profiler import ProfilerActivity, profile as tprofile

        with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        print(f"== {mode} step, context {context}, batch {B}\n"
              + prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60), flush=True)
    del model, opt, ids
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
    ap.add_argument("--profile", action="store_true")
    add_run_args(ap, "smoke run: context 8192, 3 timed steps")
    args = ap.parse_args(argv)
    if args.quick:
        args.contexts, args.steps, args.warmup = [8192], 3, 2
    info = env_info()
    rows = []
    for ctx in args.contexts:
        pair = {}
        for mode in ("dense", "sparse"):
            try:
                pair[mode] = measure(ctx, args.tokens_per_step, mode, steps=args.steps, warmup=args.warmup,
                                     dense_backend=args.dense_backend, peak=args.peak_tflops, profile=args.profile)
            except Exception as e:  # report and go on
                pair[mode] = {"context": ctx, "mode": mode, "error": repr(e)[:500]}
                torch.cuda.empty_cache()
        if "step_ms" in pair["dense"] and "step_ms" in pair["sparse"]:
            pair["sparse"]["speedup_vs_dense"] = pair["dense"]["step_ms"] / pair["sparse"]["step_ms"]
        for r in pair.values():
            print({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}, flush=True)
            rows.append(r)
    save_json(f"train_speed_{gpu_tag(info)}{args.tag}.json",
              {"env": info, "preset": "small", "dense_backend": args.dense_backend, "peak_tflops": args.peak_tflops,
               "rows": rows}, args.out)
    print_rows(rows, [("context", "context", "d"), ("mode", "mode", "s"), ("B", "batch", "d"), ("step ms", "step_ms", ".1f"),
                      ("tok/s", "tok_s", ".0f"), ("MFU", "mfu", ".1%"), ("vs dense", "speedup_vs_dense", ".2f")],
               lead=("context", "mode"))

if __name__ == "__main__":
    main()
