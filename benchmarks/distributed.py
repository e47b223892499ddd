"""Several GPUs: the overhead of the distributed code paths on one GPU, FSDP2 scaling, and
context-parallel MSA at 256K-1M tokens (issues #18 and #19).

    # one GPU (issue #18's bars)
    python benchmarks/distributed.py cp-overhead      # CP path at world size 1 vs the plain path (<= 3 %)
    python benchmarks/distributed.py fsdp-overhead    # FSDP2 at world size 1 vs none, small preset (<= 5 %)
    # several GPUs (issue #19), one call per configuration
    torchrun --nproc-per-node N benchmarks/distributed.py fsdp-scaling --preset small
    torchrun --nproc-per-node N benchmarks/distributed.py fsdp-scaling --preset msa-1b
    torchrun --nproc-per-node N benchmarks/distributed.py cp-scaling --tokens 262144 524288 1048576
    torchrun --nproc-per-node N benchmarks/distributed.py cp-check     # selections / KL / outputs vs one process

A CP step is forward + backward (KL included) of a stack of M3-shaped MSA layers (hidden 6144,
64 q / 4 kv heads of 128, index dim 128, blocks of 128, top-16) on one sequence split over the
ranks: per layer `MSAAttention.project`, `ContextParallel.attend`, `o_proj`, residual.  The
communication share comes from torch.profiler: the time of NCCL kernels and the part of it that
overlaps other kernels ("hidden").  Rank 0 writes benchmarks/results/distributed_<kind>_<gpu>_x<N>.json
(and --out / $OUT) with the GPU count, versions and commit.  `--device cpu` runs tiny shapes on
gloo (a smoke test of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import env_info, gpu_tag, save_json  # noqa: E402
from msakit.distributed import ContextParallel, comm_bytes_per_layer, init_distributed, make_parallel  # noqa: E402
from msakit.distributed.fsdp import shard_model  # noqa: E402
from msakit.distributed.step import loss_shares, reduce_sum  # noqa: E402
from msakit.cache import HeldKeys  # noqa: E402
from msakit.nn import MSAAttention, MSAConfig, attend  # noqa: E402
from msakit.ops.index_topk import Selection  # noqa: E402

M3_LAYER = dict(hidden_size=6144, num_heads=64, num_kv_heads=4, head_dim=128, index_dim=128, rotary_dim=64,
                block_size=128, topk=16, local_blocks=1, init_blocks=0)
TINY_LAYER = dict(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, index_dim=16, rotary_dim=8,
                  block_size=16, topk=4, local_blocks=1, init_blocks=0)
# a ~0.9B-parameter MSA preset for FSDP scaling (hidden 2048, 16 layers, 8 experts top-2)
MSA_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
              index_head_dim=128, rotary_dim=64, dense_intermediate_size=5632, intermediate_size=768,
              shared_intermediate_size=768, num_local_experts=8, num_experts_per_tok=2, index_block_size=128,
              index_topk_blocks=16, max_position_embeddings=8192)


# ------------------------------------------------------------------------------------ helpers
def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _time(fn: Callable[[], Any], dev: torch.device, *, warmup: int, steps: int) -> list[float]:
    """Wall seconds of each of `steps` calls after `warmup` (device-synchronised, barrier between)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(steps):
        _barrier()
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        out.append(time.perf_counter() - t0)
    return out


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def _peak_gib(dev: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None


def _one_rank_group(device: str) -> None:
    """A process group of one (FSDP2 needs one) when the script was not started by torchrun."""
    if "RANK" in os.environ or torch.distributed.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def _write(kind: str, payload: dict, args, env) -> None:
    if env.rank != 0:
        return
    info = env_info()
    payload = {"kind": kind, "world_size": env.world_size, "gpu_count": env.world_size if env.device.type == "cuda"
               else 0, "env": info, "args": vars(args), **payload}
    name = f"distributed_{kind}_{gpu_tag(info)}_x{env.world_size}{args.tag}.json"
    if env.device.type != "cuda":  # a CPU smoke run is not a result: only --out gets it
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / name).write_text(json.dumps(payload, indent=1, default=str))
        return
    print(f"wrote {save_json(name, payload, args.out)}")


class MSAStack(torch.nn.Module):
    """`layers` MSA layers (projections, attention, o_proj, residual) without MLPs."""

    def __init__(self, layers: int, shape: dict) -> None:
        super().__init__()
        sel = {k: shape[k] for k in ("block_size", "topk", "local_blocks", "init_blocks")}
        self.cfg = MSAConfig(selection=Selection(**sel), **{k: v for k, v in shape.items() if k not in sel})
        self.layers = torch.nn.ModuleList(MSAAttention(self.cfg, mode="sparse") for _ in range(layers))
        for m in self.layers:
            m.reset_parameters()

    def forward(self, h: torch.Tensor, positions: torch.Tensor, ctx: ContextParallel | None):
        kl = h.new_zeros((), dtype=torch.float32)
        sels = []
        B, L, _ = h.shape
        for attn in self.layers:
            q, k, v, qi, ki = attn.project(h, positions)
            core = attend if ctx is None else ctx.attend
            o, term, bi = core(q, qi, HeldKeys(k, v, ki), self.cfg.selection, mode="sparse", compute_kl=True,
                               need_block_idx=True)
            h = h + attn.o_proj(o.reshape(B, L, -1))
            kl = kl + term.float()
            sels.append(bi)
        return h, kl, sels


def _cp_inputs(T: int, hidden: int, dev: torch.device, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device=dev).manual_seed(seed)
    return torch.randn(1, T, hidden, device=dev, dtype=dtype, generator=g)


def _cp_step(stack: MSAStack, h_full: torch.Tensor | None, ctx: ContextParallel | None, dev, dtype,
             h_local: torch.Tensor | None = None):
    """One forward + backward of the stack; returns (loss share, KL share, selections)."""
    if ctx is None:
        h = h_full
        pos = torch.arange(h.shape[1], device=dev).unsqueeze(0)
        T = h.shape[1]
    else:
        h = h_local if h_local is not None else ctx.shard(h_full)
        pos = ctx.positions(dev)
        T = ctx.layout.seq_len
    h = h.detach().requires_grad_()
    with torch.autocast(dev.type, dtype=dtype, enabled=dev.type == "cuda" and dtype != torch.float32):
        out, kl, sels = stack(h, pos, ctx)
        # a share of the global mean square (padding rows stay 0): the shares of the ranks sum to it
        lm = out.float().pow(2).sum() * (1e-3 / (T * out.shape[-1]))
    (lm + kl).backward()
    return lm, kl, sels


def _profile_comm(fn: Callable[[], Any], dev: torch.device) -> dict:
    """NCCL kernel time of one call and the part of it overlapping other GPU kernels."""
    if dev.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        _sync(dev)
    comm, comp = [], []
    for e in prof.events():
        if e.device_type.name != "CUDA" or e.time_range.elapsed_us() <= 0:
            continue
        iv = (e.time_range.start, e.time_range.end)
        (comm if "nccl" in e.name.lower() else comp).append(iv)

    def union(ivs):
        out = []
        for s, e in sorted(ivs):
            if out and s <= out[-1][1]:
                out[-1][1] = max(out[-1][1], e)
            else:
                out.append([s, e])
        return out

    cu, pu = union(comm), union(comp)
    total = sum(e - s for s, e in cu)
    hidden = 0.0
    for s, e in cu:
        for ps, pe in pu:
            hidden += max(0.0, min(e, pe) - max(s, ps))
    return {"comm_ms": total / 1e3, "comm_hidden_ms": hidden / 1e3,
            "comm_hidden_share": hidden / total if total else None,
            "compute_busy_ms": sum(e - s for s, e in pu) / 1e3}


# ------------------------------------------------------------------------------------ commands
def cmd_cp_overhead(args) -> None:
    env = init_distributed(args.device)
    dev, dtype = env.device, torch.bfloat16
    shape = TINY_LAYER if dev.type == "cpu" else M3_LAYER
    T = args.tokens[0] if args.tokens else (256 if dev.type == "cpu" else 32768)
    torch.manual_seed(0)
    stack = MSAStack(args.layers, shape).to(dev)
    h = _cp_inputs(T, shape["hidden_size"], dev, torch.float32)
    ctx = ContextParallel(None, T, shape["block_size"])
    plain = _time(lambda: _cp_step(stack, h, None, dev, dtype), dev, warmup=args.warmup, steps=args.steps)
    cp = _time(lambda: _cp_step(stack, h, ctx, dev, dtype), dev, warmup=args.warmup, steps=args.steps)
    plain2 = _time(lambda: _cp_step(stack, h, None, dev, dtype), dev, warmup=0, steps=args.steps)
    p, c = _median(plain + plain2), _median(cp)
    res = {"tokens": T, "layers": args.layers, "shape": shape, "plain_step_s": p, "cp_step_s": c,
           "cp_over_plain": c / p, "bar": 1.03, "passes": c / p <= 1.03, "plain_runs_s": plain + plain2,
           "cp_runs_s": cp}
    print(f"cp-overhead T={T}: plain {p * 1e3:.1f} ms, CP at world size 1 {c * 1e3:.1f} ms ({c / p:.3f}x)")
    _write("cp_overhead", res, args, env)


def _train_model(preset: str, dev: torch.device, vocab: int):
    from msakit.models import M3Config, M3ForCausalLM

    cfg = M3Config.preset("small", vocab_size=vocab, **MSA_1B) if preset == "msa-1b" else \
        M3Config.preset(preset, vocab_size=vocab)
    torch.manual_seed(0)
    return M3ForCausalLM(cfg).to(dev)


def _fsdp_run(args, env, fsdp: bool) -> dict:
    from msakit.distributed.launch import Parallel

    dev = env.device
    par = make_parallel(env, 1, batch_size=args.batch) if env.distributed else \
        Parallel(env, dp=1, cp=1, dp_rank=0, cp_rank=0)
    model = _train_model(args.preset, dev, args.vocab)
    if fsdp:
        shard_model(model, par.fsdp_mesh, activation_checkpointing=args.activation_checkpointing)
    elif args.activation_checkpointing:
        model.gradient_checkpointing_enable(True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.context), generator=g).to(dev)
    model.set_attention_mode("sparse")

    def step():
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            sh = loss_shares(model, ids, ids, par, compute_kl=True)
            loss = (sh.lm + sh.kl) * par.world_size
        loss.backward()
        if not fsdp and env.distributed and env.world_size > 1:
            from msakit.distributed.fsdp import allreduce_gradients

            allreduce_gradients([p for p in model.parameters() if p.requires_grad])
        opt.step()
        opt.zero_grad(set_to_none=True)
        return sh

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    ts = _time(step, dev, warmup=args.warmup, steps=args.steps)
    sh = step()
    s = _median(ts)
    n = sum(p.numel() for p in model.parameters())
    return {"fsdp": fsdp, "step_s": s, "tokens_per_s": args.batch * args.context / s, "runs_s": ts,
            "peak_gib_per_gpu": _peak_gib(dev), "params": n, "loss": float(reduce_sum(sh.lm, par))}


def cmd_fsdp_overhead(args) -> None:
    _one_rank_group(args.device)
    env = init_distributed(args.device)
    plain = _fsdp_run(args, env, fsdp=False)
    fs = _fsdp_run(args, env, fsdp=True)
    ratio = plain["tokens_per_s"] / fs["tokens_per_s"]
    print(f"fsdp-overhead {args.preset}: {plain['tokens_per_s']:.0f} tok/s plain, {fs['tokens_per_s']:.0f} with FSDP2 "
          f"(plain / fsdp = {ratio:.3f})")
    _write("fsdp_overhead", {"plain": plain, "fsdp": fs, "plain_over_fsdp": ratio, "bar": 1.05,
                             "passes": ratio <= 1.05}, args, env)


def cmd_fsdp_scaling(args) -> None:
    env = init_distributed(args.device)
    res = _fsdp_run(args, env, fsdp=True)
    if env.is_main:
        print(f"fsdp-scaling {args.preset} x{env.world_size}: {res['tokens_per_s']:.0f} tok/s, "
              f"peak {res['peak_gib_per_gpu']} GiB per GPU")
    _write(f"fsdp_scaling_{args.preset}", {"global_batch": args.batch, "context": args.context, **res}, args, env)


def cmd_cp_scaling(args) -> None:
    env = init_distributed(args.device)
    dev = env.device
    par = make_parallel(env, env.world_size)
    shape = dict(TINY_LAYER if dev.type == "cpu" else M3_LAYER)
    if args.hidden:
        shape["hidden_size"] = args.hidden
    torch.manual_seed(0)
    stack = MSAStack(args.layers, shape).to(dev)
    rows = []
    for T in (args.tokens or ([512, 1024] if dev.type == "cpu" else [262144, 524288, 1048576])):
        ctx = ContextParallel(par.cp_group, T, shape["block_size"]) if env.distributed else \
            ContextParallel(None, T, shape["block_size"])
        # each rank draws only its own tokens (the whole sequence of 1M x 6144 would not fit every GPU)
        hdt = torch.bfloat16 if dev.type == "cuda" else torch.float32
        h_local = _cp_inputs(ctx.local_len, shape["hidden_size"], dev, hdt, seed=env.rank) if env.distributed else None
        h_full = None if env.distributed else _cp_inputs(T, shape["hidden_size"], dev, hdt)
        row: dict[str, Any] = {"tokens": T}
        try:
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            fn = lambda: _cp_step(stack, h_full, ctx, dev, torch.bfloat16, h_local=h_local)  # noqa: E731
            ts = _time(fn, dev, warmup=args.warmup, steps=args.steps)
            ctx.stats.reset()
            fn()
            row.update(step_s=_median(ts), runs_s=ts, peak_gib_per_gpu=_peak_gib(dev),
                       measured_comm=ctx.stats.as_dict(),
                       model_comm_per_layer=comm_bytes_per_layer(ctx.layout.padded_len, env.world_size,
                                                                 groups=shape["num_kv_heads"],
                                                                 head_dim=shape["head_dim"],
                                                                 index_dim=shape["index_dim"]))
            if args.profile:
                row.update(_profile_comm(fn, dev))
        except torch.OutOfMemoryError as e:
            row["error"] = f"OOM: {str(e).splitlines()[0]}"
        stack.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        rows.append(row)
        if env.is_main:
            print(f"cp-scaling x{env.world_size} T={T}: " + (f"{row['step_s'] * 1e3:.0f} ms/step, peak "
                  f"{row['peak_gib_per_gpu']} GiB" if "error" not in row else row["error"]))
    _write("cp_scaling", {"layers": args.layers, "shape": shape, "rows": rows}, args, env)


def cmd_cp_check(args) -> None:
    """Selections, KL, outputs and input gradients of CP on every rank vs one process (float32)."""
    env = init_distributed(args.device)
    dev = env.device
    par = make_parallel(env, env.world_size)
    shape = dict(TINY_LAYER if dev.type == "cpu" else M3_LAYER)
    T = args.tokens[0] if args.tokens else (320 if dev.type == "cpu" else 32768 - 77)  # padded on purpose
    torch.manual_seed(0)
    stack = MSAStack(args.layers, shape).to(dev)
    h = _cp_inputs(T, shape["hidden_size"], dev, torch.float32)
    _, kl_ref, sel_ref = _cp_step(stack, h, None, dev, torch.float32)
    g_ref = {n: p.grad.clone() for n, p in stack.named_parameters() if p.grad is not None}
    stack.zero_grad(set_to_none=True)
    ctx = ContextParallel(par.cp_group if env.distributed else None, T, shape["block_size"])
    _, kl, sels = _cp_step(stack, h, ctx, dev, torch.float32)
    bad_rows = 0
    for a, b in zip(sels, sel_ref):
        full = ctx.unshard(a, dim=2)
        bad_rows += int((full.sort(dim=-1).values != b.sort(dim=-1).values).any(dim=-1).sum())
    kl_all = reduce_sum(kl, par) if env.distributed else kl.detach()
    errs = {}
    for n, p in stack.named_parameters():
        if p.grad is None or n not in g_ref:
            continue
        g = p.grad.clone()
        if env.distributed:
            torch.distributed.all_reduce(g)  # parameter gradients are per-rank partial sums under CP
        errs[n] = float((g - g_ref[n]).norm() / g_ref[n].norm().clamp_min(1e-30))
    res = {"tokens": T, "selection_rows_differing": bad_rows, "kl": float(kl_all), "kl_ref": float(kl_ref.detach()),
           "kl_rel_err": abs(float(kl_all) - float(kl_ref.detach())) / max(1e-30, abs(float(kl_ref.detach()))),
           "grad_rel_err_max": max(errs.values()) if errs else None, "grad_rel_err": errs}
    if env.is_main:
        print(f"cp-check x{env.world_size} T={T}: {bad_rows} selection rows differ, KL rel err "
              f"{res['kl_rel_err']:.2e}, max grad rel err {res['grad_rel_err_max']:.2e}")
    _write("cp_check", res, args, env)


COMMANDS = {"cp-overhead": cmd_cp_overhead, "fsdp-overhead": cmd_fsdp_overhead, "fsdp-scaling": cmd_fsdp_scaling,
            "cp-scaling": cmd_cp_scaling, "cp-check": cmd_cp_check}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=sorted(COMMANDS))
    p.add_argument("--device", default="auto", help="auto, cuda or cpu (cpu: tiny shapes on gloo, a smoke test)")
    p.add_argument("--tokens", type=int, nargs="+", default=None, help="sequence lengths (cp-*)")
    p.add_argument("--layers", type=int, default=2, help="MSA layers in the CP stack")
    p.add_argument("--hidden", type=int, default=None, help="hidden size of the CP stack (default 6144)")
    p.add_argument("--preset", default="small", help="fsdp-*: small or msa-1b")
    p.add_argument("--batch", type=int, default=8, help="fsdp-*: global batch (rows)")
    p.add_argument("--context", type=int, default=8192, help="fsdp-*: tokens per row")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--profile", action="store_true", help="cp-scaling: communication share from torch.profiler")
    p.add_argument("--tag", default="", help="suffix of the result file name")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.device == "cpu":
        args.context = min(args.context, 64)
    COMMANDS[args.command](args)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
