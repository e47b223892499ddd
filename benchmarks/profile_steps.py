"""Where the time of a decode step and of a QAT training step goes (torch.profiler, CUDA).

Small M3 preset (hidden 512, 8 layers, MoE), random weights:

  decode   `model.generate` (paged and contiguous caches), the speculative engine's plain loop and
           one `speculative_generate` with an untrained drafter: wall ms per token and, under the
           profiler, CPU vs GPU time and the top operators.  A step whose GPU time is far below
           its wall time is launch / Python bound.
  qat      one BF16 training step and one QAT step (weights refreshed by the CUDA graph), same
           batch: wall ms and the top operators.

    python benchmarks/profile_steps.py --what decode,qat [--out DIR]

Prints tables; writes ``profile_steps_<what>.txt`` (the profiler tables) into --out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import wall_s  # noqa: E402
from msakit.models import M3Config, M3ForCausalLM  # noqa: E402


def log(*a) -> None:
    print(*a, flush=True)


def prof_table(fn, title: str, fh, rows: int = 25) -> dict:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    dev_attr = "self_device_time_total" if hasattr(ka[0], "self_device_time_total") else "self_cuda_time_total"
    gpu_us = sum(getattr(e, dev_attr) for e in ka)
    cpu_us = sum(e.self_cpu_time_total for e in ka)
    launches = sum(e.count for e in ka if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                      "cudaLaunchKernelExC"))
    fh.write(f"\n===== {title}: self CPU {cpu_us / 1e3:.1f} ms, GPU {gpu_us / 1e3:.1f} ms, launches {launches}\n")
    fh.write(ka.table(sort_by="self_cpu_time_total", row_limit=rows) + "\n")
    fh.write(ka.table(sort_by=dev_attr, row_limit=rows) + "\n")
    fh.flush()
    return {"cpu_ms": cpu_us / 1e3, "gpu_ms": gpu_us / 1e3, "launches": launches}


def small_model(vocab: int, max_pos: int, mode: str) -> M3ForCausalLM:
    cfg = M3Config.preset("small", vocab_size=vocab, max_position_embeddings=max_pos)
    return M3ForCausalLM(cfg, mode=mode)


@torch.no_grad()
def decode(out: Path, ctx: int, new: int, only: str = "") -> dict:
    from msakit.spec import DSparkConfig, DSparkDrafter, autoregressive_generate, speculative_generate

    torch.manual_seed(0)
    model = small_model(4096, ctx + 4 * new + 64, "sparse").cuda().to(torch.bfloat16).eval()
    ids = torch.randint(0, 4096, (1, ctx), device="cuda")
    drafter = DSparkDrafter(DSparkConfig.for_target(model.config, "small")).cuda().to(torch.bfloat16).eval()
    res = {"context": ctx, "new_tokens": new}
    fh = open(out / "profile_steps_decode.txt", "w")
    runs = {
        "generate_paged": lambda n: model.generate(ids, n, temperature=0.0, cache="paged"),
        "generate_contiguous": lambda n: model.generate(ids, n, temperature=0.0, cache="contiguous"),
        "spec_engine_plain": lambda n: autoregressive_generate(model, ids, n, temperature=0.0),
        "speculative": lambda n: speculative_generate(model, drafter, ids, n, temperature=0.0),
    }
    for name, fn in runs.items():
        if only and name not in only.split(","):
            continue
        try:
            fn(4)
            t_pre = wall_s(lambda: fn(1))
            t_all = wall_s(lambda: fn(new))
            per = (t_all - t_pre) / max(1, new - 1)
            p = prof_table(lambda: fn(new), f"{name} ({new} tokens after a {ctx}-token prompt)", fh)
            res[name] = {"ms_per_token": per * 1e3, "prefill_ms": t_pre * 1e3, **p}
            log(f"{name:22s} {per * 1e3:8.2f} ms/token  prefill {t_pre * 1e3:7.1f} ms  profiled: CPU "
                f"{p['cpu_ms']:.0f} ms GPU {p['gpu_ms']:.0f} ms launches {p['launches']}")
        except Exception as e:  # report and go on
            res[name] = {"error": repr(e)[:300]}
            log(f"{name}: {e!r}")
    fh.close()
    return res


def qat(out: Path, batch: int, ctx: int) -> dict:
    from benchmarks.qat import make_opt, train_step
    from msakit.quant import capture_weight_refresh, prepare_qat, quantization_plan

    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    base = small_model(4096, ctx, "dense").cuda()
    ids = torch.randint(0, 4096, (batch, ctx), device="cuda")
    res = {"batch": batch, "context": ctx}
    fh = open(out / "profile_steps_qat.txt", "a")
    import copy

    for name in ("bf16", "qat"):
        model = copy.deepcopy(base)
        if name == "qat":
            prepare_qat(model, quantization_plan(model))
            capture_weight_refresh(model, torch.bfloat16)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = make_opt(model, 1e-4, ids.device)

        def step(model=model, opt=opt, params=params):
            train_step(model, opt, params, ids, ids, ids.device)

        for _ in range(3):
            step()
        t = wall_s(step, reps=7)
        p = prof_table(step, f"{name} training step (batch {batch} x {ctx})", fh)
        res[name] = {"step_ms": t * 1e3, **p}
        log(f"{name:5s} step {t * 1e3:7.2f} ms  profiled: CPU {p['cpu_ms']:.0f} ms GPU {p['gpu_ms']:.0f} ms "
            f"launches {p['launches']}")
        del model, opt
    res["ratio"] = res["qat"]["step_ms"] / res["bf16"]["step_ms"]
    log(f"QAT / BF16 step: {res['ratio']:.3f}")
    fh.close()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--what", default="decode,qat")
    ap.add_argument("--out", default=".")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--decode-runs", default="", help="comma-separated subset of the decode runs")
    ap.add_argument("--qat-shapes", default="32x512", help="comma-separated BATCHxCONTEXT training shapes")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {}
    if "decode" in args.what:
        res["decode"] = decode(out, args.ctx, args.new, args.decode_runs)
    if "qat" in args.what:
        res["qat"] = [qat(out, *map(int, sh.split("x"))) for sh in args.qat_shapes.split(",")]
    import json

    (out / "profile_steps.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
