"""CUDA-graph decode check: `model.generate` on the paged path, eager vs CUDA graph (one GPU).

Small M3 preset (hidden 512, 8 layers, MoE, sparse MSA), random weights, bf16.  For each prompt
length: greedy tokens with cuda_graph=False and True must be identical (asserted; the per-step
logits are compared too), and no graph fallback warning may appear.  Prints wall ms per token:

  per_token     (t(new) - t(1)) / (new - 1): includes the graph's one-time warm-up + capture
  steady        (t(2 new) - t(new)) / new: replays only (the capture cost cancels)

    python benchmarks/generate_graph_check.py [--contexts 1024,32768] [--new 64] [--batch 1]

Writes benchmarks/results/generate_graph_check_<gpu>.json (and $OUT/).  Exit status 1 when a
check fails.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import env_info, save_json, wall_s  # noqa: E402
from msakit.models import M3Config, M3ForCausalLM  # noqa: E402


@torch.no_grad()
def check(contexts=(1024, 32768), new: int = 64, batch: int = 1, mode: str = "sparse", reps: int = 3) -> dict:
    """Eager vs CUDA-graph paged generation of the small preset; returns the results (raises
    AssertionError when tokens differ or the graph path fell back)."""
    import msakit.generate as G

    torch.manual_seed(0)
    cfg = M3Config.preset("small", vocab_size=4096, max_position_embeddings=max(contexts) + 4 * new + 64)
    model = M3ForCausalLM(cfg, mode=mode).cuda().to(torch.bfloat16).eval()
    res: dict = {"env": env_info(), "batch": batch, "new_tokens": new, "mode": mode, "rows": []}
    failures = []
    for ctx in contexts:
        ids = torch.randint(0, cfg.vocab_size, (batch, ctx), device="cuda")
        row: dict = {"context": ctx}
        toks = {}
        for graph in (False, True):
            def gen(n, **kw):
                return model.generate(ids, n, temperature=0.0, cache="paged", cuda_graph=graph, **kw)

            G._GRAPH_WARNED.clear()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                gen(4)  # warm-up: Triton compiles, allocator
                toks[graph], logits = G.generate(model, ids, new, temperature=0.0, cache="paged", cuda_graph=graph,
                                                 return_logits=True)
                t1 = wall_s(lambda: gen(1), reps)
                tn = wall_s(lambda: gen(new), reps)
                t2n = wall_s(lambda: gen(2 * new), reps)
            fell_back = [str(w.message) for w in caught if "CUDA-graph decode disabled" in str(w.message)]
            key = "graph" if graph else "eager"
            row[key] = {"prefill_ms": t1 * 1e3, "per_token_ms": (tn - t1) / max(1, new - 1) * 1e3,
                        "steady_ms": (t2n - tn) / new * 1e3, "fallback": fell_back}
            row[key]["tok_per_s_steady"] = batch * 1e3 / row[key]["steady_ms"]
            if graph:
                row["logits_max_abs_diff"] = float((logits.float() - row.pop("_logits")).abs().max())
                if fell_back:
                    failures.append(f"ctx {ctx}: graph path fell back: {fell_back}")
            else:
                row["_logits"] = logits.float()
        same = torch.equal(toks[False], toks[True])
        row["tokens_identical"] = same
        if not same:
            first = int((toks[False] != toks[True]).any(0).nonzero()[0]) - ctx
            failures.append(f"ctx {ctx}: greedy tokens differ from new token {first} on")
        e, g = row["eager"], row["graph"]
        print(f"ctx {ctx:6d}  B={batch}  eager {e['per_token_ms']:7.2f} ms/token (steady {e['steady_ms']:7.2f})   "
              f"graph {g['per_token_ms']:7.2f} ms/token (steady {g['steady_ms']:7.2f}, "
              f"{g['tok_per_s_steady']:.0f} tok/s)   prefill {e['prefill_ms']:.1f} ms   tokens identical: {same}   "
              f"logits max |diff| {row['logits_max_abs_diff']:.3g}", flush=True)
        res["rows"].append(row)
    res["failures"] = failures
    gpu = (res["env"]["gpu"] or "gpu").replace(" ", "_")
    save_json(f"generate_graph_check_{gpu}.json", res)
    for f in failures:
        print("FAIL:", f, flush=True)
    assert not failures, failures
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="1024,32768")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--mode", default="sparse", choices=("sparse", "dense"))
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    try:
        check(tuple(int(x) for x in a.contexts.split(",")), a.new, a.batch, a.mode, a.reps)
    except AssertionError:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
