"""CPU timing of `ops.sparse_attention` and `ops.index_kl_loss`: the reference against the chunked path.

One layer of the Qwen2.5-0.5B shape (B = 1, Hq = 14, G = 2, D = 64, Di = 64), block 64 top-8,
float32, the selection of `ops.index_topk` on random index projections.  For each op: forward
(no autograd) and forward + backward, wall and process CPU seconds, and the largest differences
between the two paths' outputs and gradients.  A dense causal SDPA of the same shape is timed as
the baseline.  index_kl_loss(over="all") runs on the chunked path only (its reference gathers
T keys per query).

    nice python benchmarks/cpu_ops.py            # T = 4096, 2 threads
    -> benchmarks/results/cpu_ops_<cpu>.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS, commit_info, tree_digest  # noqa: E402
from msakit import ops  # noqa: E402
from msakit.ops.index_kl import index_kl_loss_reference  # noqa: E402
from msakit.ops.index_kl.chunked import index_kl_loss_chunked  # noqa: E402
from msakit.ops.sparse_attention import sparse_attention_reference  # noqa: E402
from msakit.ops.sparse_attention.chunked import sparse_attention_chunked  # noqa: E402

SHAPE = dict(B=1, Hq=14, G=2, D=64, Di=64, block_size=64, topk=8)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--T", type=int, default=4096, help="tokens")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="JSON path (default results/cpu_ops_<cpu>.json)")
    p.add_argument("--no-reference", action="store_true", help="time the chunked path and SDPA only")
    return p.parse_args(argv)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_tag(model: str) -> str:
    """A file-name form of the CPU model: 'Intel(R) Xeon(R) Processor' -> 'Intel_Xeon_Processor'."""
    return re.sub(r"_+", "_", re.sub(r"\((R|TM)\)|[^A-Za-z0-9]+", "_", model)).strip("_") or "cpu"


def make_inputs(T: int, seed: int) -> dict:
    s = SHAPE
    g = torch.Generator().manual_seed(seed)
    x = {
        "q": torch.randn(s["B"], T, s["Hq"], s["D"], generator=g),
        "k": torch.randn(s["B"], T, s["G"], s["D"], generator=g),
        "v": torch.randn(s["B"], T, s["G"], s["D"], generator=g),
        "q_idx": torch.randn(s["B"], T, s["G"], s["Di"], generator=g),
        "k_idx": torch.randn(s["B"], T, s["Di"], generator=g),
    }
    x["block_idx"] = ops.index_topk(x["q_idx"], x["k_idx"], block_size=s["block_size"], topk=s["topk"])
    return x


def timed(fn) -> tuple[dict, object]:
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return {"wall_s": round(time.perf_counter() - w, 3), "cpu_s": round(time.process_time() - c, 3)}, out


def attention_case(x: dict, impl) -> dict:
    """impl(q, k, v) -> (o, lse); forward alone, then forward + backward (outputs and grads kept)."""
    with torch.no_grad():
        fwd, _ = timed(lambda: impl(x["q"], x["k"], x["v"]))
    q, k, v = (x[n].clone().requires_grad_() for n in ("q", "k", "v"))

    def step():
        o, lse = impl(q, k, v)
        (o.sum() + torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).sum()).backward()
        return o.detach(), lse.detach()

    fb, (o, lse) = timed(step)
    return {"fwd": fwd, "fwd_bwd": fb, "out": (o, lse, q.grad, k.grad, v.grad)}


def kl_case(x: dict, impl) -> dict:
    with torch.no_grad():
        fwd, _ = timed(lambda: impl(x["q"], x["k"], x["q_idx"], x["k_idx"]))
    qi, ki = x["q_idx"].clone().requires_grad_(), x["k_idx"].clone().requires_grad_()

    def step():
        loss = impl(x["q"], x["k"], qi, ki)
        loss.backward()
        return loss.detach()

    fb, loss = timed(step)
    return {"fwd": fwd, "fwd_bwd": fb, "out": (loss, qi.grad, ki.grad)}


def default_scales(q: torch.Tensor, q_idx: torch.Tensor) -> tuple[float, float]:
    """index_kl_loss's default softmax scales 1/sqrt(D) and 1/sqrt(Di) (the chunked path takes them resolved)."""
    return 1 / math.sqrt(q.shape[-1]), 1 / math.sqrt(q_idx.shape[-1])


def max_diffs(names: tuple[str, ...], a: tuple, b: tuple) -> dict:
    out = {}
    for n, x, y in zip(names, a, b):
        fin = torch.isfinite(x) & torch.isfinite(y)
        out[n] = float((x[fin] - y[fin]).abs().max()) if fin.any() else 0.0
        out[n + "_scale"] = float(y[fin].abs().max()) if fin.any() else 0.0
    return out


def dense_sdpa(x: dict) -> dict:
    """Causal GQA attention over every j <= i through F.scaled_dot_product_attention."""
    q, k, v = (x[n].transpose(1, 2) for n in ("q", "k", "v"))
    run = lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True)  # noqa: E731
    with torch.no_grad():
        fwd, _ = timed(lambda: run(q, k, v))
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    fb, _ = timed(lambda: run(qg, kg, vg).sum().backward())
    return {"fwd": fwd, "fwd_bwd": fb}


def speedup(ref: dict, new: dict) -> dict:
    return {p: {u: round(ref[p][u] / max(new[p][u], 1e-9), 2) for u in ("wall_s", "cpu_s")} for p in ("fwd", "fwd_bwd")}


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    bs = SHAPE["block_size"]
    x = make_inputs(args.T, args.seed)
    bi = x["block_idx"]
    res: dict = {
        "cpu": cpu_model(), "threads": args.threads, "torch": torch.__version__, "T": args.T, "shape": SHAPE,
        "dtype": "float32", "selection": "index_topk of random q_idx, k_idx",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load_avg_start": os.getloadavg()[0],
        **commit_info(), "tree_digest": tree_digest(),
    }
    attn = {
        "chunked": lambda q, k, v: sparse_attention_chunked(q, k, v, bi, bs, 1 / math.sqrt(q.shape[-1])),
        "reference": lambda q, k, v: sparse_attention_reference(q, k, v, bi, block_size=bs, return_lse=True),
    }
    kl = {
        "chunked": lambda q, k, qi, ki: index_kl_loss_chunked(q, k, qi, ki, bi, bs, *default_scales(q, qi)),
        "reference": lambda q, k, qi, ki: index_kl_loss_reference(q, k, qi, ki, bi, block_size=bs),
    }
    names = ["chunked"] + ([] if args.no_reference else ["reference"])
    res["dense_sdpa"] = dense_sdpa(x)
    res["sparse_attention"] = {n: attention_case(x, attn[n]) for n in names}
    res["index_kl_loss"] = {n: kl_case(x, kl[n]) for n in names}
    all_impl = lambda q, k, qi, ki: index_kl_loss_chunked(q, k, qi, ki, None, bs, *default_scales(q, qi), over="all")  # noqa: E731
    res["index_kl_loss_all"] = {"chunked": kl_case(x, all_impl)}
    for op, fields in (("sparse_attention", ("o", "lse", "dq", "dk", "dv")), ("index_kl_loss", ("loss", "dq_idx", "dk_idx"))):
        r = res[op]
        if "reference" in r:
            r["max_abs_diff"] = max_diffs(fields, r["chunked"]["out"], r["reference"]["out"])
            r["speedup"] = speedup(r["reference"], r["chunked"])
    for op in ("sparse_attention", "index_kl_loss", "index_kl_loss_all"):
        for v in res[op].values():
            if isinstance(v, dict):
                v.pop("out", None)
    res["load_avg_end"] = os.getloadavg()[0]
    return res


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    res = run(args)
    out = args.out or RESULTS / f"cpu_ops_{cpu_tag(res['cpu'])}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({k: res[k] for k in ("sparse_attention", "index_kl_loss", "index_kl_loss_all", "dense_sdpa")}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
