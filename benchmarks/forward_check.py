"""GPU check of the one model forward behind every decode path (CUDA only).

On the "small" M3 preset (bf16, sparse MSA, random weights with the output head scaled by
--head-scale so that greedy argmaxes are not near ties) and an untrained DSpark drafter:

  generate_graph_eq      model.generate, paged cache: CUDA-graph step == eager step (tokens and
                         per-step logits bit for bit), greedy and sampled with a fixed seed
  generate_paged_eq_contiguous   greedy tokens, paged (msa_decode) == contiguous (reference ops)
  spec_eq_plain[cache]   speculative_generate T 0 == model.generate T 0 token for token, and the
                         same engine's plain loop (autoregressive_generate), per target cache
  spec_graph_eq[cache, T]  speculative_generate graph == eager at T 0 and T 1 (fixed seeds),
                         per target cache (paged: verify through msa_decode; contiguous)
  graphs_reused          captures counted over two calls of the same shape: the second call of
                         generate / speculative_generate / autoregressive_generate captures none
  no_graph_disabled      no "CUDA-graph decode disabled" warning was raised

and the wall time of each call (first and second: the second replays pooled graphs).  Prints a
table; writes forward_check_<gpu>.json under benchmarks/results/ and into --out / $OUT.

    python benchmarks/forward_check.py [--ctx 512] [--new 48] [--batch 2] [--out DIR]

Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import env_info, gpu_tag, save_json  # noqa: E402


def _timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def _first_diff(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """Index (along the sequence) of the first differing token of two [B, T] results, None if equal."""
    if a.shape != b.shape:
        return min(a.shape[1], b.shape[1])
    diff = (a != b).any(0).nonzero()
    return None if diff.numel() == 0 else int(diff[0])


def _margin(logits: torch.Tensor) -> torch.Tensor:
    """Top-1 minus top-2 logit per row of logits [B, V] (float32)."""
    top = logits.float().topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def _near_tie(ref_logits: torch.Tensor, a: torch.Tensor, b: torch.Tensor, prompt: int, tol: float) -> dict:
    """Explain the first difference of two greedy results a, b [B, T] of different kernels: the
    reference path's step logits [B, n, V] at the first differing step have a top-2 margin below
    `tol` (the two paths' rounding difference) in every row that diverges there.  Returns
    {"equal", "first_diff", "margin", "tol", "near_tie"}."""
    t = _first_diff(a, b)
    if t is None:
        return {"equal": True, "first_diff": None, "near_tie": False}
    step = t - prompt
    rows = (a[:, t] != b[:, t]).nonzero().flatten()
    margin = float(_margin(ref_logits[rows, step]).max()) if 0 <= step < ref_logits.shape[1] else float("inf")
    return {"equal": False, "first_diff": t, "margin": margin, "tol": tol, "near_tie": margin <= tol}


def run(args) -> dict:
    import msakit.generate as G
    import msakit.speculative.generate as SG
    from msakit.models import M3Config, M3ForCausalLM
    from msakit.speculative import DSparkConfig, DSparkDrafter, autoregressive_generate, speculative_generate

    captures: list[str] = []
    real_capture = G.capture_graph

    def counting_capture(fn, device):
        captures.append("capture")
        return real_capture(fn, device)

    G.capture_graph = counting_capture  # the decode step's and the speculative rounds' captures

    torch.manual_seed(0)
    V = 4096
    cfg = M3Config.preset("small", vocab_size=V, max_position_embeddings=args.ctx + 8 * args.new + 256)
    model = M3ForCausalLM(cfg, mode="sparse").cuda().to(torch.bfloat16).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(args.head_scale)
    drafter = DSparkDrafter(DSparkConfig.for_target(model.config, "small")).cuda().to(torch.bfloat16).eval()
    ids = torch.randint(0, V, (args.batch, args.ctx), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    n = args.new
    checks: dict[str, dict] = {}
    times: dict[str, float] = {}

    def check(name: str, ok: bool, **detail) -> None:
        checks[name] = {"ok": bool(ok), **detail}

    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        # -- model.generate: paged graph == eager, paged == contiguous ------------------------
        G.clear_decoders(model)
        (te, le), times["generate eager"] = _timed(lambda: G.generate(model, ids, n, temperature=0, return_logits=True,
                                                                      cache="paged", cuda_graph=False))
        captures.clear()
        (tg, lg), times["generate graph 1st"] = _timed(lambda: G.generate(model, ids, n, temperature=0,
                                                                          return_logits=True, cache="paged",
                                                                          cuda_graph=True))
        first = len(captures)
        (tg2, _), times["generate graph 2nd"] = _timed(lambda: G.generate(model, ids, n, temperature=0,
                                                                          return_logits=True, cache="paged",
                                                                          cuda_graph=True))
        check("generate_graph_eq greedy", torch.equal(te, tg) and torch.equal(lg, le) and torch.equal(tg, tg2),
              first_diff=_first_diff(te, tg), max_logit_diff=float((lg.float() - le.float()).abs().max()))
        check("graphs_reused generate", first >= 1 and len(captures) == first, captures_first=first,
              captures_second=len(captures) - first)
        kw = dict(temperature=1.0, top_k=50, cache="paged")
        a = G.generate(model, ids, n, generator=torch.Generator("cuda").manual_seed(3), cuda_graph=False, **kw)
        b = G.generate(model, ids, n, generator=torch.Generator("cuda").manual_seed(3), cuda_graph=True, **kw)
        check("generate_graph_eq T1", torch.equal(a, b), first_diff=_first_diff(a, b))
        (tc, lc), times["generate contiguous"] = _timed(lambda: G.generate(model, ids, n, temperature=0,
                                                                           return_logits=True, cache="contiguous"))
        # Paged (msa_decode) and contiguous (reference ops) are different kernels: in bf16 their logits
        # differ by rounding, so greedy tokens may part at a near-tie.  The check: equal tokens, or the
        # first difference falls where the top-2 margin is below the two paths' logit difference on
        # the steps both decoded from the same prefix.
        t0 = _first_diff(tc, te)
        upto = le.shape[1] if t0 is None else max(1, t0 - args.ctx + 1)
        rounding = float((lc[:, :upto].float() - le[:, :upto].float()).abs().max())
        tie = _near_tie(le, tc, te, args.ctx, 2 * rounding)
        check("generate_paged_eq_contiguous greedy (or near-tie)", tie["equal"] or tie["near_tie"],
              logit_diff=rounding, **tie)

        # -- speculative_generate / autoregressive_generate per target cache -------------------
        for cache in ("paged", "contiguous"):
            SG.clear_runs(model)
            se, times[f"spec {cache} eager"] = _timed(lambda: speculative_generate(
                model, drafter, ids, n, temperature=0, cuda_graph=False, cache=cache))
            captures.clear()
            sg1, times[f"spec {cache} graph 1st"] = _timed(lambda: speculative_generate(
                model, drafter, ids, n, temperature=0, cuda_graph=True, cache=cache))
            first = len(captures)
            sg2, times[f"spec {cache} graph 2nd"] = _timed(lambda: speculative_generate(
                model, drafter, ids, n, temperature=0, cuda_graph=True, cache=cache))
            check(f"spec_graph_eq[{cache}, T0]", torch.equal(se, sg1) and torch.equal(sg1, sg2),
                  first_diff=_first_diff(se, sg1))
            tie = _near_tie(le, sg1, te, args.ctx, 2 * rounding)
            check(f"spec_eq_plain[{cache}] vs generate (or near-tie)", tie["equal"] or tie["near_tie"], **tie)
            captures_spec = len(captures) - first
            ae, times[f"plain-engine {cache} eager"] = _timed(lambda: autoregressive_generate(
                model, ids, n, temperature=0, cuda_graph=False, cache=cache))
            ag1, times[f"plain-engine {cache} graph 1st"] = _timed(lambda: autoregressive_generate(
                model, ids, n, temperature=0, cuda_graph=True, cache=cache))
            mark = len(captures)
            ag2, times[f"plain-engine {cache} graph 2nd"] = _timed(lambda: autoregressive_generate(
                model, ids, n, temperature=0, cuda_graph=True, cache=cache))
            # verify width 8 against width 1: different GEMM shapes, so near-ties may part in bf16 too;
            # the engine's plain loop itself must be graph == eager bit for bit.
            tie = _near_tie(le, sg1, ag1, args.ctx, 2 * rounding)
            check(f"spec_eq_plain[{cache}] vs same engine (or near-tie)", tie["equal"] or tie["near_tie"], **tie)
            check(f"plain_engine_graph_eq[{cache}]", torch.equal(ae, ag1) and torch.equal(ag1, ag2),
                  first_diff=_first_diff(ae, ag1))
            check(f"graphs_reused spec[{cache}]", first >= 1 and captures_spec == 0 and len(captures) == mark,
                  captures_first=first, captures_second=captures_spec, captures_plain_second=len(captures) - mark)
            for seed in (5, 6):
                s1 = speculative_generate(model, drafter, ids, n // 2, temperature=1.0, cuda_graph=False, cache=cache,
                                          generator=torch.Generator("cuda").manual_seed(seed))
                s2 = speculative_generate(model, drafter, ids, n // 2, temperature=1.0, cuda_graph=True, cache=cache,
                                          generator=torch.Generator("cuda").manual_seed(seed))
                check(f"spec_graph_eq[{cache}, T1, seed {seed}]", torch.equal(s1, s2), first_diff=_first_diff(s1, s2))
    disabled = sorted({str(w.message) for w in warned if "CUDA-graph decode disabled" in str(w.message)})
    check("no_graph_disabled", not disabled, warnings=disabled)
    G.capture_graph = real_capture
    return {"config": vars(args), "checks": checks, "seconds": {k: round(v, 4) for k, v in times.items()},
            "tokens_per_s": {k: round(args.batch * n / v, 1) for k, v in times.items()}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ctx", type=int, default=512, help="prompt length")
    p.add_argument("--new", type=int, default=48, help="new tokens per call")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--head-scale", type=float, default=8.0, help="lm_head weight scale (greedy margins)")
    p.add_argument("--out", default=None, help="also write the JSON here (default $OUT)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("forward_check needs CUDA")
        return 2
    res = run(args)
    res["env"] = env_info()
    print(f"\n{'check':<46} {'ok':>4}  detail")
    for name, c in res["checks"].items():
        detail = {k: v for k, v in c.items() if k != "ok"}
        print(f"{name:<46} {'yes' if c['ok'] else 'NO':>4}  {detail}")
    print(f"\n{'call':<34} {'seconds':>8} {'tok/s':>9}")
    for k, s in res["seconds"].items():
        print(f"{k:<34} {s:>8.3f} {res['tokens_per_s'][k]:>9.1f}")
    path = save_json(f"forward_check_{gpu_tag(res['env'])}.json", res, args.out)
    print(f"\nwrote {path}")
    return 0 if all(c["ok"] for c in res["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
