"""GPU check of the sparse ops' edge cases at the M3 shape (CUDA only).

  empty_selection[path]   a selection that is -1 everywhere: o = 0, lse = -inf, zero and finite
                          gradients of q, k, v, on the union-tile forward (batch rows), the
                          KV-outer forward (packed documents), and for index_kl_loss /
                          selected_lse / sparse_attention_with_kl
  late_block_refused      validate=True raises ValueError naming block_idx for one block after
                          its query; validate=False runs and matches the causal selection
  check_finite            check_finite=True raises ValueError naming q on one NaN
  validate_ms             sparse_attention's forward time on index_topk's selection with
                          validate=True and validate=False (the value checks' host sync)

Prints a table; writes ops_edges_<gpu>.json under benchmarks/results/ and into --out / $OUT.

    python benchmarks/ops_edges.py [--T 8192] [--out DIR]

Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import env_info, gpu_tag, save_json  # noqa: E402

HQ, G, D, DI, BS, TOPK = 64, 4, 128, 128, 128, 16  # the M3 attention shape


def _zero_grads(o, lse, leaves) -> bool:
    """The gradients of leaves for cotangents of ones on o and on lse: all zero and finite."""
    g = torch.autograd.grad((o, lse), leaves, (torch.ones_like(o), torch.ones_like(lse)))
    return all(bool(torch.isfinite(x).all()) and not bool(x.any()) for x in g)


def empty_selection(T: int) -> dict:
    from msakit import ops
    from msakit.ops.index_kl import selected_lse

    dev, dt = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s: torch.randn(*s, device=dev, dtype=dt, generator=gen)  # noqa: E731
    res = {}
    for path, cu in (("union", None), ("kv_outer_varlen", torch.tensor([0, T // 3, T], dtype=torch.int32, device=dev))):
        q, k, v = (x.requires_grad_(True) for x in (r(1, T, HQ, D), r(1, T, G, D), r(1, T, G, D)))
        bi = torch.full((1, G, T, TOPK), -1, dtype=torch.int32, device=dev)
        o, lse = ops.sparse_attention(q, k, v, bi, block_size=BS, return_lse=True, cu_seqlens=cu, backend="triton")
        res[f"empty_selection[{path}]"] = (not bool(o.any())) and bool(torch.isneginf(lse).all()) and _zero_grads(
            o, lse, [q, k, v])
    q, k, v = r(1, T, HQ, D), r(1, T, G, D), r(1, T, G, D)
    qi, ki = r(1, T, G, DI).requires_grad_(True), r(1, T, DI).requires_grad_(True)
    bi = torch.full((1, G, T, TOPK), -1, dtype=torch.int32, device=dev)
    lse = selected_lse(q, k, bi, block_size=BS, backend="triton")
    o, kl = ops.sparse_attention_with_kl(q, k, v, qi, ki, bi, block_size=BS, backend="triton")
    gq, gk = torch.autograd.grad(kl, (qi, ki))
    res["empty_selection[kl]"] = (bool(torch.isneginf(lse).all()) and float(kl.detach()) == 0.0 and not bool(o.any())
                                  and not bool(gq.any()) and not bool(gk.any()))
    return res


def late_and_finite(T: int) -> dict:
    from msakit import ops

    dev, dt = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(1)
    r = lambda *s: torch.randn(*s, device=dev, dtype=dt, generator=gen)  # noqa: E731
    q, k, v, qi, ki = r(1, T, HQ, D), r(1, T, G, D), r(1, T, G, D), r(1, T, G, DI), r(1, T, DI)
    bi = ops.index_topk(qi, ki, block_size=BS, topk=TOPK)
    bad = bi.clone()
    bad[0, 0, 0, -1] = 1  # query 0 (block 0) selects block 1
    res = {}
    try:
        ops.sparse_attention(q, k, v, bad, block_size=BS)
        res["late_block_refused"] = False
    except ValueError as e:
        res["late_block_refused"] = "block_idx" in str(e)
    same = torch.allclose(ops.sparse_attention(q, k, v, bad, block_size=BS, validate=False).float(),
                          ops.sparse_attention(q, k, v, bi, block_size=BS).float(), rtol=0, atol=1e-3)
    res["late_block_refused"] = res["late_block_refused"] and bool(same)
    qn = q.clone()
    qn[0, T // 2, 0, 0] = float("nan")
    try:
        ops.sparse_attention(qn, k, v, bi, block_size=BS, check_finite=True)
        res["check_finite"] = False
    except ValueError as e:
        res["check_finite"] = str(e).startswith("q ")
    import triton.testing

    for flag in (True, False):
        res[f"validate_ms[{flag}]"] = triton.testing.do_bench(
            lambda: ops.sparse_attention(q, k, v, bi, block_size=BS, validate=flag), warmup=5, rep=50)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=8192, help="tokens (default 8192)")
    ap.add_argument("--out", default=None, help="also write the JSON here (default $OUT)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("ops_edges.py needs a CUDA GPU", file=sys.stderr)
        return 2
    res = {**empty_selection(args.T), **late_and_finite(args.T)}
    for name, val in res.items():
        print(f"{name:34s} {val if isinstance(val, bool) else f'{val:.3f} ms'}")
    info = env_info()
    save_json(f"ops_edges_{gpu_tag(info)}.json", {"env": info, "T": args.T, "results": res}, args.out)
    return 0 if all(v for v in res.values() if isinstance(v, bool)) else 1


if __name__ == "__main__":
    sys.exit(main())
