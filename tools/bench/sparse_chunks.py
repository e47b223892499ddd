"""Memory against time of the sparse-attention forward as a function of its query chunk (GPU).

The KV-outer forward writes one partial output per (query, slot) of a chunk of C query rows
(`CHUNK_BYTES` of one KV group's bf16 partials by default), which sets its peak extra memory (issue: <= 1 GiB
at 16K, <= 4 GiB at 1M).  Smaller chunks cut the memory and leave fewer of a chunk's queries per
key block (emptier work items).  This sweep times the forward (index_topk's selection on random
keys, and the trained-like selection) at several partial budgets, and the "fill" rule: the
fewest rows that keep a key block's expected queries per chunk at one full item
(item_queries * n_blocks / topk), within a budget.

    python tools/bench/sparse_chunks.py [--T 16384,131072,1048576] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.common import env_info  # noqa: E402
from benchmarks.selections import trained_like_block_idx  # noqa: E402
from msakit import ops  # noqa: E402
from msakit.ops.sparse_attention import triton as K  # noqa: E402
from tools.bench.common import peak_extra, time_ms  # noqa: E402

HQ, G, D, DI, BS, TOPK = 64, 4, 128, 128, 128, 16
BUDGETS_GIB = (5.0, 3.5, 2.0, 1.0, 0.75)
ITEM_QUERIES = 128


def rows_for(budget_bytes: float, T: int) -> int:
    """Query rows per chunk the launcher takes for this budget (its own rule)."""
    return K.chunk_rows_for(int(budget_bytes), tokens=T, heads=HQ, groups=G, head_dim=D, topk=TOPK,
                            elt_bytes=2, lse_bytes=4)


def fill_rows(T: int, cap_bytes: float, floor_bytes: float) -> int:
    """Rows so that a key block gets ~one full item of queries per chunk, clamped to the budgets."""
    want = ITEM_QUERIES * math.ceil(T / BS) // TOPK
    return max(rows_for(floor_bytes, T), min(want, rows_for(cap_bytes, T)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", default="16384,131072,1048576")
    ap.add_argument("--out", type=Path, default=Path("sparse_chunks.json"))
    a = ap.parse_args(argv)
    rows = []
    for T in (int(x) for x in a.T.split(",")):
        g = torch.Generator(device="cuda").manual_seed(0)
        mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
        q, k, v, qi, ki = mk(1, T, HQ, D), mk(1, T, G, D), mk(1, T, G, D), mk(1, T, G, DI), mk(1, T, DI)
        sels = {"random": ops.index_topk(qi, ki, block_size=BS, topk=TOPK),
                "trained-like": trained_like_block_idx(T, block_size=BS, topk=TOPK, groups=G, device="cuda")}
        del qi, ki
        out, lse = torch.empty_like(q), torch.empty(1, HQ, T, device="cuda")
        scale = 1 / math.sqrt(D)
        cands = [(f"{b:g} GiB", rows_for(b * 2**30, T)) for b in BUDGETS_GIB]
        cands.append(("fill (0.75-3.5 GiB)", fill_rows(T, 3.5 * 2**30, 0.75 * 2**30)))
        ref = None
        for kind, bi in sels.items():
            for name, C in cands:
                fn = lambda: K.sparse_attention_fwd_triton(q, k, v, bi, None, BS, scale, out=out, lse_out=lse,  # noqa: E731
                                                           chunk_rows=C)
                t0 = time.time()
                extra, _ = peak_extra(fn)
                ms = time_ms(fn, rep=50)
                if name == cands[0][0]:
                    ref = out.clone()
                err = max_abs_diff(out, ref)
                row = dict(T=T, kind=kind, chunk=name, chunk_rows=C, chunks=math.ceil(T / C), fwd_ms=round(ms, 3),
                           peak_extra_GiB=round(extra / 2**30, 3), max_abs_diff_vs_default=err,
                           wall_s=round(time.time() - t0, 1))
                print(json.dumps(row), flush=True)
                rows.append(row)
                a.out.write_text(json.dumps(dict(env=env_info(), rows=rows), indent=1))
        del q, k, v, sels, out, lse, ref
        torch.cuda.empty_cache()
    return 0


def max_abs_diff(a: torch.Tensor, b: torch.Tensor, rows: int = 65536) -> float:
    """max |a - b| over [B, T, H, D] in float32, T in slices (one fp32 copy at 1M tokens is 32 GiB)."""
    return max(float((a[:, i:i + rows].float() - b[:, i:i + rows].float()).abs().max())
               for i in range(0, a.shape[1], rows))


if __name__ == "__main__":
    raise SystemExit(main())
