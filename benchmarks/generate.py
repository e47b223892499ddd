"""Tokens/s of `model.generate` on the "small" M3 preset (59M parameters, hidden 512, 8 layers,
MoE, sparse MSA; random weights, bf16, greedy) after prompts of several lengths, on one GPU.

For each context, `model.generate` (its default cache on CUDA: paged, `msa_decode`, CUDA-graphed
step) runs m = 1, n and 2n new tokens after a warm-up at those lengths (first-call costs per
shape stay out), median of --reps calls each:

  tok_s           B n / (t(2n) - t(n)): the steady decode rate (prefill and per-call one-time
                  costs such as graph capture cancel)
  tok_s_per_call  B (n - 1) / (t(n) - t(1)): a call's decode rate with its one-time costs
  tok_s_e2e       B n / t(n): end to end, prefill included
  prefill_ms      t(1)

--profile: kernels of one decode step, by kind (msa_decode, MoE routing, grouped GEMMs, GEMMs,
norms, RoPE, sampling, elementwise, copies), from torch.profiler over calls of 8 and 40 new
tokens (the difference over 32 steps: prefill cancels), with the CUDA-graph step and eagerly.

    python benchmarks/generate.py [--contexts 1024 32768 131072] [--new 64] [--batch 1] [--quick]
    python benchmarks/generate.py --profile [--contexts 4096 32768 131072]
    python benchmarks/generate.py --compile [--contexts 4096 32768 131072]

--compile: the CUDA-graphed step uncompiled ("eager") against the CUDA-graphed step under
torch.compile (`generate(..., compile=True)`: inductor fuses the step's elementwise work, msakit
captures the compiled step) in the same run: ms per token and tokens/s of each (as above), the
step's own milliseconds (`step_time`: 64 steps of the pooled decoder timed between two syncs,
median of 5; the headline, since the two-call difference carries the calls' prefill variance), the
first call's seconds (compilation and capture), and the kernels of one step of each by kind
(torch.profiler over 16 replayed steps of the pooled decoder, prefill outside the profile).
--inductor KEY=VALUE (repeatable, with --compile): an inductor option for the compiled step on
top of msakit's (`msakit.generate.COMPILE_OPTIONS`), e.g. `max_autotune=True` (Triton GEMM
templates tuned at M = 1), `freezing=True`, or a JSON value such as
`pre_grad_fusion_options={"batch_linear_lhs": {"min_fuse_set_size": 2, "max_fuse_search_depth": 64}}`
(one GEMM for the linears that read the same input); recorded in the JSON.

Writes benchmarks/results/generate_<gpu><tag>.json (and --out / $OUT) and prints a table.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import (  # noqa: E402  (KERNEL_KINDS, kernel_kind: re-exported)
    KERNEL_KINDS, add_run_args, env_info, gpu_tag, kernel_kind, kernel_table, print_rows, profiled_kernels, save_json,
    wall_s,
)

def per_step(a: dict[str, dict], b: dict[str, dict], steps: int) -> dict[str, dict]:
    """(b - a) / steps per kind: the kernels of one step from two calls `steps` tokens apart."""
    out = {}
    for kind in sorted(set(a) | set(b)):
        c = (b.get(kind, {}).get("count", 0) - a.get(kind, {}).get("count", 0)) / steps
        us = (b.get(kind, {}).get("us", 0.0) - a.get(kind, {}).get("us", 0.0)) / steps
        out[kind] = {"count": round(c, 3), "us": round(us, 3)}
    return out


def build(context: int, new: int, batch: int, seed: int = 0):
    from msakit.models import M3Config, M3ForCausalLM

    torch.manual_seed(seed)
    cfg = M3Config.preset("small", vocab_size=4096, max_position_embeddings=context + 4 * new + 64)
    model = M3ForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    model.set_attention_mode("sparse")
    ids = torch.randint(0, cfg.vocab_size, (batch, context), device="cuda")
    return model, ids


def gen_fn(model, ids, *, cuda_graph: bool | None = None, cache: str | None = None, compile: bool | None = None):
    """n -> generate(model, ids, n, greedy) with the given options where generate takes them."""
    from msakit.generate import generate

    params = inspect.signature(generate).parameters
    kw = {}
    if compile is not None:
        if "compile" not in params:
            raise ValueError("this msakit's generate has no compile option")
        kw["compile"] = compile
    if cuda_graph is not None and "cuda_graph" in params:
        kw["cuda_graph"] = cuda_graph
    if cache is not None and "cache" in params:
        kw["cache"] = cache

    def gen(n: int):
        with torch.no_grad():
            return generate(model, ids, n, temperature=0.0, **kw)

    return gen


def speed_row(gen, context: int, new: int, batch: int, reps: int) -> dict:
    for n in (1, new, 2 * new):  # warm-up at every timed length
        gen(n)
    t1 = wall_s(lambda: gen(1), reps)
    tn = wall_s(lambda: gen(new), reps)
    t2n = wall_s(lambda: gen(2 * new), reps)
    nan = float("nan")
    row = {"context": context, "batch": batch, "new_tokens": new, "prefill_ms": t1 * 1e3,
           "tok_s": batch * new / (t2n - tn) if t2n > tn else nan,
           "tok_s_per_call": batch * (new - 1) / (tn - t1) if tn > t1 else nan,
           "tok_s_e2e": batch * new / tn}
    row["ms_per_token"] = 1e3 * batch / row["tok_s"]
    return row


def profile_row(gen, steps: tuple[int, int] = (8, 40)) -> dict:
    """Kernels per decode step from profiles of generations `steps` tokens long; the warnings
    raised meanwhile (a CUDA-graph fallback shows there) are kept."""
    a, b = steps
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gen(a), gen(b)
        ev_a, _ = profiled_kernels(lambda: gen(a))
        ev_b, top = profiled_kernels(lambda: gen(b))
    kinds = per_step(kernel_table(ev_a), kernel_table(ev_b), b - a)
    return {"kernels_per_step": round((len(ev_b) - len(ev_a)) / (b - a), 2),
            "device_us_per_step": round((sum(u for _, u in ev_b) - sum(u for _, u in ev_a)) / (b - a), 2),
            "by_kind": kinds, "top_kernels_us": [(n[:120], round(u, 1)) for n, u in top],
            "warnings": sorted({str(w.message)[:200] for w in caught})}


def step_profile(model, ids, max_len: int, compile: bool, steps: int = 16) -> dict:
    """Kernels per decode step of the CUDA-graphed paged step (compiled or not): the pooled
    decoder `generate` used for this shape, its prompt prefilled and 3 steps run (capture,
    compilation) outside the profile, then `steps` greedy steps profiled (argmax included)."""
    from msakit.generate import decoder_for

    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        with decoder_for(model, ids.shape[0], max_len, cuda_graph=ids.is_cuda, compile=compile) as dec:
            logits = dec.prefill(ids)
            for _ in range(3):
                logits = dec.step(logits.argmax(-1, keepdim=True))

            def run() -> None:
                lg = logits
                for _ in range(steps):
                    lg = dec.step(lg.argmax(-1, keepdim=True))

            ev, top = profiled_kernels(run)
            reasons = {"graph_disabled_reason": dec.graph_disabled_reason,
                       "compile_disabled_reason": dec.compile_disabled_reason}
    return {"kernels_per_step": round(len(ev) / steps, 2),
            "device_us_per_step": round(sum(u for _, u in ev) / steps, 2),
            "by_kind": per_step({}, kernel_table(ev), steps), "top_kernels_us": [(n[:120], round(u, 1)) for n, u in top],
            "warnings": sorted({str(w.message)[:200] for w in caught}), **reasons}


def step_time(model, ids, max_len: int, compile: bool, steps: int = 64, reps: int = 5) -> dict:
    """Milliseconds of one decode step in steady state, timed directly: the pooled decoder
    `generate` used for this shape, its prompt prefilled and 3 steps run, then `steps` greedy
    steps (`dec.step`: graph replay, argmax, the host's bookkeeping) between two device syncs,
    median of `reps`.  Unlike the two-call difference of `speed_row`, no prefill or per-call
    cost enters (their variance, a few ms per call, does not divide into the step).  On CPU (the
    tests) the same loop runs without graphs."""
    from msakit.generate import decoder_for

    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    ts = []
    with torch.no_grad(), decoder_for(model, ids.shape[0], max_len, cuda_graph=ids.is_cuda, compile=compile) as dec:
        logits = dec.prefill(ids)
        for _ in range(3):
            logits = dec.step(logits.argmax(-1, keepdim=True))
        for _ in range(reps):
            # restart from the prompt (its pages freed) so that every repetition decodes the same positions
            dec.reset()
            logits = dec.prefill(ids)
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                logits = dec.step(logits.argmax(-1, keepdim=True))
            sync()
            ts.append((time.perf_counter() - t0) * 1e3 / steps)
    ts.sort()
    return {"step_ms": ts[len(ts) // 2], "step_ms_min": ts[0], "step_ms_max": ts[-1], "steps": steps, "reps": reps}


def compile_row(model, ids, ctx: int, new: int, batch: int, reps: int) -> dict:
    """The graphed step uncompiled and compiled (`compile=True`) on one model: speed rows, first
    call seconds, kernels per step."""

    row: dict = {"context": ctx, "batch": batch, "new_tokens": new, "params": sum(p.numel() for p in model.parameters()),
                 "first_call_s": {}, "profile": {}}
    for name, comp in (("eager", False), ("compiled", True)):
        gen = gen_fn(model, ids, compile=comp)
        try:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            gen(2)  # one decode step: its compilation (compiled) and capture
            torch.cuda.synchronize()
            row["first_call_s"][name] = round(time.perf_counter() - t0, 2)
            row[name] = speed_row(gen, ctx, new, batch, reps)
            row[name].update(step_time(model, ids, ctx + 2 * new, comp))
            row["profile"][name] = step_profile(model, ids, ctx + 2 * new, comp)
        except Exception as e:  # report the variant and go on
            row[name] = {"error": repr(e)[:500]}
            print(f"ctx {ctx} {name}: {e!r}", flush=True)
            continue
        r, p = row[name], row["profile"][name]
        print(f"ctx {ctx:7d} B={batch} {name:8s}: step {r['step_ms']:.3f} ms (replayed), {r['ms_per_token']:.3f} "
              f"ms/token ({r['tok_s']:7.1f} tok/s steady, "
              f"{r['tok_s_per_call']:7.1f} per call), first call {row['first_call_s'][name]:.1f} s", flush=True)
        print_profile(ctx, name, p)
        for k in ("graph_disabled_reason", "compile_disabled_reason"):
            if p.get(k):
                print(f"    {k}: {p[k]}", flush=True)
    e, c = row.get("eager", {}), row.get("compiled", {})
    if "ms_per_token" in e and "ms_per_token" in c:
        row["speedup"] = e["ms_per_token"] / c["ms_per_token"]
    if "step_ms" in e and "step_ms" in c:
        row["step_speedup"] = e["step_ms"] / c["step_ms"]
    return row


def print_profile(ctx: int, name: str, p: dict) -> None:
    print(f"  profile ctx {ctx} {name}: {p['kernels_per_step']} kernels, {p['device_us_per_step'] / 1e3:.3f} ms of "
          f"device time per step", flush=True)
    for kind, d in sorted(p["by_kind"].items(), key=lambda x: -x[1]["us"]):
        print(f"    {kind:13s} {d['count']:8.1f} kernels {d['us']:9.1f} us", flush=True)


def parse_inductor_options(items: list[str]) -> dict:
    """['max_autotune=True', 'max_autotune_gemm_backends=TRITON'] -> {option: value} (True / False,
    ints, floats and JSON objects / lists parsed; the option must exist in torch._inductor.config)."""
    from torch._inductor import config as inductor_config

    out: dict = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"generate.py: --inductor must be KEY=VALUE, got {item!r}")
        if not hasattr(inductor_config, key.split(".")[0]):
            raise SystemExit(f"generate.py: --inductor {key!r} is not an inductor option")
        val: object = raw
        if raw[:1] in ("{", "["):
            try:
                val = json.loads(raw)
            except json.JSONDecodeError as e:
                raise SystemExit(f"generate.py: --inductor {key}: {e}") from None
        elif raw in ("True", "False"):
            val = raw == "True"
        else:
            for cast in (int, float):
                try:
                    val = cast(raw)
                    break
                except ValueError:
                    pass
        out[key] = val
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="*", default=None,
                    help="prompt lengths (default 1024 32768 131072; with --profile 4096 32768 131072)")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--eager", action="store_true", help="also time the eager step (cuda_graph=False)")
    ap.add_argument("--profile", action="store_true", help="kernel count and time by kind of one decode step")
    ap.add_argument("--compile", action="store_true",
                    help="graphed step uncompiled vs compiled (compile=True): ms/token, tok/s, kernels per step")
    ap.add_argument("--inductor", action="append", default=[], metavar="KEY=VALUE",
                    help="with --compile: an inductor option of the compiled step (repeatable)")
    add_run_args(ap, "smoke run: contexts 1024 and 32768, 32 new tokens")
    args = ap.parse_args(argv)
    inductor = parse_inductor_options(args.inductor)
    if inductor and not args.compile:
        ap.error("--inductor needs --compile")
    if inductor:
        import msakit.generate as mg

        mg.COMPILE_OPTIONS["options"] = {**mg.COMPILE_OPTIONS["options"], **inductor}
    if args.contexts is None:
        args.contexts = [4096, 32768, 131072] if (args.profile or args.compile) else [1024, 32768, 131072]
    if args.quick:
        args.contexts, args.new = ([4096, 32768] if args.compile else [1024, 32768]), 32
    info = env_info()
    rows = []
    if args.compile:
        for ctx in args.contexts:
            model, ids = build(ctx, args.new, args.batch)
            rows.append(compile_row(model, ids, ctx, args.new, args.batch, args.reps))
            del model, ids
            torch.cuda.empty_cache()
            # written after every context: a run cut by its time limit keeps the contexts done
            save_json(f"generate_{gpu_tag(info)}{args.tag}.json", {"env": info, "preset": "small", "mode": "sparse",
                      "dtype": "bf16", "compare": "compile", "inductor_options": inductor, "rows": rows}, args.out)
        flat = [{"context": r["context"], "batch": r["batch"], **{f"{n}_{k}": r.get(n, {}).get(k, float("nan"))
                 for n in ("eager", "compiled") for k in ("step_ms", "ms_per_token", "tok_s")},
                 **{f"{n}_kernels": r["profile"].get(n, {}).get("kernels_per_step", float("nan"))
                    for n in ("eager", "compiled")}} for r in rows]
        print_rows(flat, [("context", "context", "d"), ("B", "batch", "d"), ("eager step ms", "eager_step_ms", ".3f"),
                          ("compiled step ms", "compiled_step_ms", ".3f"), ("eager ms/tok", "eager_ms_per_token", ".3f"),
                          ("compiled ms/tok", "compiled_ms_per_token", ".3f"), ("eager tok/s", "eager_tok_s", ".1f"),
                          ("compiled tok/s", "compiled_tok_s", ".1f"), ("eager kernels", "eager_kernels", ".1f"),
                          ("compiled kernels", "compiled_kernels", ".1f")], lead=("context", "batch"))
        return
    for ctx in args.contexts:
        model, ids = build(ctx, args.new, args.batch)
        try:
            row = speed_row(gen_fn(model, ids), ctx, args.new, args.batch, args.reps)
        except Exception as e:  # report the context and go on
            print(f"ctx {ctx}: {e!r}", flush=True)
            rows.append({"context": ctx, "batch": args.batch, "error": repr(e)[:500]})
            del model, ids
            torch.cuda.empty_cache()
            continue
        row["params"] = sum(p.numel() for p in model.parameters())
        if args.eager:
            e = speed_row(gen_fn(model, ids, cuda_graph=False), ctx, args.new, args.batch, args.reps)
            row["eager"] = {k: e[k] for k in ("tok_s", "tok_s_per_call", "ms_per_token")}
        print(f"ctx {ctx:7d} B={args.batch}: {row['tok_s']:7.1f} tok/s steady ({row['ms_per_token']:.3f} ms/token), "
              f"{row['tok_s_per_call']:7.1f} per call, {row['tok_s_e2e']:7.1f} end to end, prefill "
              f"{row['prefill_ms']:.1f} ms", flush=True)
        if args.profile:
            row["profile"] = {}
            for name, kw in (("graph", {}), ("eager", {"cuda_graph": False})):
                try:
                    row["profile"][name] = profile_row(gen_fn(model, ids, **kw))
                    print_profile(ctx, name, row["profile"][name])
                except Exception as e:  # the profiler and graph capture may not mix: report, go on
                    row["profile"][name] = {"error": repr(e)[:300]}
                    print(f"  profile ctx {ctx} {name} failed: {e!r}", flush=True)
        rows.append(row)
        del model, ids
        torch.cuda.empty_cache()
    payload = {"env": info, "preset": "small", "mode": "sparse", "dtype": "bf16", "rows": rows}
    save_json(f"generate_{gpu_tag(info)}{args.tag}.json", payload, args.out)
    print_rows(rows, [("context", "context", "d"), ("B", "batch", "d"), ("tok/s", "tok_s", ".1f"),
                      ("ms/token", "ms_per_token", ".3f"), ("per call", "tok_s_per_call", ".1f"), ("e2e", "tok_s_e2e", ".1f"),
                      ("prefill ms", "prefill_ms", ".1f")], lead=("context", "batch"))

if __name__ == "__main__":
    main()
