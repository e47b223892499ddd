"""The Hopper peers on MSA selections, beside msakit's sparse attention, in one run (CUDA only).

    python -m tools.bench.peers --T 16384 131072 --kinds random trained real --out DIR

What each peer is fed (M3 shape: 64 query heads, 4 KV heads, d 128, block 128, top-16):
- `msakit`: `msakit.ops.sparse_attention` (exact MSA: each query row attends to its own blocks,
  causal inside its own block).
- `msakit_sm90`: msakit's CuTe DSL union-tile forward (`msakit.ops.sparse_attention.sm90`, not
  dispatched by the public op yet), its work list built in each call (exact MSA).
- `query_outer`: the per-token query-outer Triton design Hopper engines run today
  (`tools/bench/query_outer.py`, rebuilt from its description; exact MSA).
- `cudnn_union`: cuDNN frontend's block-sparse attention (`cudnn.block_sparse_attention`,
  SM90 blk128): per 128-query tile, the union of the blocks its queries select, replicated to the
  16 heads of the group; no per-row mask and no causal mask exist in its API, so this computes
  more than MSA (every row attends to the whole union): a lower bound on its cost for exact MSA.
  `kv_splits` 1 and 4 are both timed; the faster counts.
- `fa4_union`: FA4's SM90 block-sparse path (`flash_attn.cute.flash_attn_func` with
  `block_sparse_tensors`), the same union as full blocks: the same lower bound.
- `fa4_exact`: the same union as masked blocks plus a `mask_mod` that reads a per-row bitmask of
  the selected blocks (int32 [B, G, T, ceil(blocks / 32)]) and the causal condition: exact MSA.
  Its output is checked against msakit's reference on sampled rows.

Selections: the three kinds of docs/kernels.md (`random` = `tools.bench.sparse_attention.
random_block_idx`, `trained` and `real` = `benchmarks.selections`).  Rates are useful TFLOP/s,
4 * Hq * D * block_size * topk * T (the convention of `tools/bench/sparse_attention.py`), for
every peer alike, so a peer that computes the union shows its extra work as a lower rate.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import site
import time
from pathlib import Path

import torch

from tools.bench.common import rel_err, time_ms
from tools.bench.sparse_attention import M3_SHAPE, random_block_idx, reference_rows, sample_rows

SITE = os.path.expanduser("~/site")  # where the device's optional wheels are installed (--target)
if os.path.isdir(SITE):
    site.addsitedir(SITE)


def m3_inputs(T: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random bf16 q [1, T, Hq, D], k and v [1, T, G, D] at the M3 shape (seed 0)."""
    Hq, G, D = (M3_SHAPE[k] for k in ("Hq", "G", "D"))
    g = torch.Generator(device=device).manual_seed(0)
    return tuple(torch.randn(1, T, h, D, device=device, generator=g, dtype=torch.bfloat16) for h in (Hq, G, G))


def selection(kind: str, T: int, *, G: int, block_size: int, topk: int, device) -> torch.Tensor:
    """int32 [1, G, T, topk] of the named kind."""
    from benchmarks.selections import real_like_block_idx, trained_like_block_idx

    if kind == "random":
        g = torch.Generator(device=device).manual_seed(T)
        return random_block_idx(1, G, T, block_size, topk, g, device)
    if kind == "trained":
        return trained_like_block_idx(T, block_size=block_size, topk=topk, groups=G, device=device)
    if kind == "real":
        return real_like_block_idx(T, block_size=block_size, topk=topk, groups=G, device=device)
    raise ValueError(f"kind must be random, trained or real, got {kind!r}")


def tile_unions(block_idx: torch.Tensor, tile: int, chunk: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Per tile of `tile` consecutive queries, the sorted distinct valid blocks its rows select.

    block_idx int [B, G, T, K] (-1 padded) -> (idx int32 [B, G, nT, cap] with 0 past the count,
    cnt int32 [B, G, nT]); nT = ceil(T / tile), cap = the largest count.
    """
    B, G, T, K = block_idx.shape
    nT = (T + tile - 1) // tile
    x = torch.full((B, G, nT * tile, K), -1, dtype=torch.int64, device=block_idx.device)
    x[:, :, :T] = block_idx
    x = x.view(B, G, nT, tile * K)
    big = torch.iinfo(torch.int64).max
    parts = []
    for s in range(0, nT, chunk):
        y = x[:, :, s:s + chunk]
        y = torch.where(y >= 0, y, big).sort(dim=-1).values
        dup = torch.zeros_like(y, dtype=torch.bool)
        dup[..., 1:] = y[..., 1:] == y[..., :-1]
        parts.append(torch.where(dup, big, y).sort(dim=-1).values)
    y = torch.cat(parts, dim=2)
    cnt = (y != big).sum(-1)
    cap = max(int(cnt.max()), 1)
    idx = torch.where(y[..., :cap] != big, y[..., :cap], 0)
    return idx.to(torch.int32).contiguous(), cnt.to(torch.int32).contiguous()


def row_bitmask(block_idx: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """int32 [B, G, T, ceil(num_blocks / 32)]: bit (b & 31) of word (b >> 5) set where the row selects block b."""
    B, G, T, K = block_idx.shape
    W = (num_blocks + 31) // 32
    bi = block_idx.long()
    valid = bi >= 0
    word = torch.where(valid, bi >> 5, 0)
    bit = torch.where(valid, torch.ones_like(bi) << (bi & 31), 0)
    out = torch.zeros(B, G, T, W, dtype=torch.int64, device=block_idx.device)
    out.scatter_add_(3, word, bit)  # a row's blocks are distinct: the sum is the OR
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def heads(t: torch.Tensor, per_group: int) -> torch.Tensor:
    """[B, G, ...] -> [B, G * per_group, ...] (each group's metadata for its query heads)."""
    return t.repeat_interleave(per_group, dim=1).contiguous()


def make_fa4_mask(per_group: int, block_size: int):
    """FA4 mask_mod: row m of query head h keeps key n iff n <= m and m's group selected n's block."""
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute import utils as fa_utils

    @cute.jit
    def msa_mask(batch, head, m_idx, n_idx, seqlen_info, aux_tensors):
        bits = aux_tensors[0]
        blk = n_idx[0] // block_size
        word = bits[batch[0], head[0] // per_group, m_idx[0], blk // 32]
        hit = fa_utils.scalar_to_ssa((word >> (blk % 32)) & 1, cutlass.Int32)
        return (n_idx <= m_idx) & (hit == fa_utils.scalar_to_ssa(1, cutlass.Int32))

    return msa_mask


PEERS = ("msakit", "msakit_sm90", "query_outer", "cudnn_union", "fa4_union", "fa4_exact")


def run(T_list, kinds, *, peers=PEERS, check_rows: int = 64,
        verbose: bool = True) -> list[dict]:
    dev = torch.device("cuda")
    Hq, G, D, bs, topk = (M3_SHAPE[k] for k in ("Hq", "G", "D", "block_size", "topk"))
    per_group, scale = Hq // G, 1.0 / math.sqrt(D)
    rows_out = []
    for T in T_list:
        q, k, v = m3_inputs(T, dev)
        flops = 4.0 * Hq * D * bs * topk * T
        check = sample_rows(T, check_rows, bs, torch.Generator().manual_seed(1))
        for kind in kinds:
            bi = selection(kind, T, G=G, block_size=bs, topk=topk, device=dev)
            idx, cnt = tile_unions(bi, 128)
            valid = float((bi >= 0).sum(-1).float().mean())
            row = {"T": T, "kind": kind, "union_blocks_per_tile": float(cnt.float().mean()),
                   "valid_blocks_per_row": valid, "union_work_ratio": float(cnt.float().mean()) / valid}
            ro, rlse = reference_rows(q, k, v, bi, check, block_size=bs)
            for peer in peers:
                t0 = time.time()
                try:
                    fn, checked = _peer(peer, q, k, v, bi, idx, cnt, scale=scale, per_group=per_group, bs=bs)
                    if checked:
                        o = fn()[0]
                        row[f"{peer}_rel_err"] = rel_err(o[0, check.to(dev)], ro)
                    ms = time_ms(fn)
                    row[f"{peer}_ms"] = ms
                    row[f"{peer}_tflops"] = flops / ms / 1e9
                except Exception as ex:  # a peer that cannot run this case: record and go on
                    row[f"{peer}_error"] = f"{type(ex).__name__}: {ex}"[:600]
                row[f"{peer}_wall_s"] = round(time.time() - t0, 1)
                torch.cuda.empty_cache()
            if verbose:
                print(json.dumps(row), flush=True)
            rows_out.append(row)
            del bi, idx, cnt
    return rows_out


def _peer(peer, q, k, v, bi, idx, cnt, *, scale, per_group, bs):
    """(a zero-argument callable returning (o [B, T, Hq, D], ...), whether its output is exact MSA)."""
    if peer == "msakit":
        from msakit.ops.sparse_attention import sparse_attention

        return (lambda: (sparse_attention(q, k, v, bi, block_size=bs, softmax_scale=scale),)), True
    if peer == "msakit_sm90":  # the CuTe DSL union-tile forward (work list built in each call)
        from msakit.ops.sparse_attention import sm90

        return (lambda: sm90.sparse_attention_fwd_sm90(q, k, v, bi, bs, scale)), True
    if peer == "query_outer":
        from tools.bench.query_outer import query_outer_attention

        return (lambda: query_outer_attention(q, k, v, bi, block_size=bs, softmax_scale=scale)), True
    if peer == "cudnn_union":
        from cudnn.block_sparse_attention import block_sparse_attention_forward

        hidx, hcnt = heads(idx, per_group), heads(cnt, per_group)
        best = None
        for splits in (1, 4):  # "auto" fails inside cudnn-frontend 1.32.0 (int("auto"))
            f = lambda splits=splits: (block_sparse_attention_forward(  # noqa: E731
                q, k, v, hidx, q2k_block_nums=hcnt, sparse_block_size=bs, softmax_scale=scale, layout="bshd",
                kv_splits=splits)["o_tensor"],)
            ms = time_ms(f)
            if best is None or ms < best[0]:
                best = (ms, f)
        return best[1], False
    if peer in ("fa4_union", "fa4_exact"):
        from flash_attn.cute import flash_attn_func
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

        hidx, hcnt = heads(idx, per_group), heads(cnt, per_group)
        zc, zi = torch.zeros_like(hcnt), torch.zeros_like(hidx)
        if peer == "fa4_union":
            bst = BlockSparseTensorsTorch(mask_block_cnt=zc, mask_block_idx=zi, full_block_cnt=hcnt,
                                          full_block_idx=hidx, block_size=(128, bs))
            return (lambda: flash_attn_func(q, k, v, softmax_scale=scale, block_sparse_tensors=bst)), False
        bits = row_bitmask(bi, (q.shape[1] + bs - 1) // bs)
        bst = BlockSparseTensorsTorch(mask_block_cnt=hcnt, mask_block_idx=hidx, full_block_cnt=zc,
                                      full_block_idx=zi, block_size=(128, bs))
        mask = make_fa4_mask(per_group, bs)
        return (lambda: flash_attn_func(q, k, v, softmax_scale=scale, mask_mod=mask, aux_tensors=[bits],
                                        block_sparse_tensors=bst)), True
    raise ValueError(f"unknown peer {peer!r}")


def union_sweep(T_list, kinds, *, verbose=True) -> list[dict]:
    """msakit's two forward loop orders and its choice, per T and kind: the KV-outer kernel alone,
    the union-tile kernel alone (its plan included; `plan_ms` alone), the public op (its choice by
    the plan's mean union ratio), with the mean union ratio, useful TFLOP/s and errors on sampled rows."""
    from msakit.ops.sparse_attention import sparse_attention
    from msakit.ops.sparse_attention import triton as kernels
    from msakit.ops.sparse_attention.union import sparse_attention_fwd_union, union_plan, union_q_tile

    dev = torch.device("cuda")
    Hq, G, D, bs, topk = (M3_SHAPE[k] for k in ("Hq", "G", "D", "block_size", "topk"))
    scale = 1.0 / math.sqrt(D)
    qt = union_q_tile(Hq // G, topk)
    out = []
    for T in T_list:
        q, k, v = m3_inputs(T, dev)
        check = sample_rows(T, 64, bs, torch.Generator().manual_seed(1))
        flops = 4.0 * Hq * D * bs * topk * T
        for kind in kinds:
            bi = selection(kind, T, G=G, block_size=bs, topk=topk, device=dev)
            ro, _ = reference_rows(q, k, v, bi, check, block_size=bs)
            row = {"T": T, "kind": kind, "q_tile": qt, "ratio": float(union_plan(bi, qt)[3].mean()),
                   "plan_ms": time_ms(lambda: union_plan(bi, qt))}
            paths = {"kv_outer": lambda: kernels.sparse_attention_fwd_triton(q, k, v, bi, None, bs, scale),
                     "union": lambda: sparse_attention_fwd_union(q, k, v, bi, bs, scale),
                     "auto": lambda: sparse_attention(q, k, v, bi, block_size=bs, return_lse=True, validate=False)}
            for name, fn in paths.items():
                try:
                    row[f"{name}_rel_err"] = rel_err(fn()[0][0, check.to(dev)], ro)
                    row[f"{name}_ms"] = time_ms(fn)
                    row[f"{name}_tflops"] = flops / row[f"{name}_ms"] / 1e9
                except Exception as ex:  # record and go on
                    row[f"{name}_error"] = f"{type(ex).__name__}: {ex}"[:600]
            if verbose:
                print(json.dumps(row), flush=True)
            out.append(row)
    return out


def environment() -> dict:
    import triton

    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "cuda": torch.version.cuda}
    for mod in ("cutlass", "cudnn", "flash_attn"):
        try:
            m = __import__(mod)
            env[mod] = getattr(m, "__version__", "present")
        except Exception as ex:  # optional peers
            env[mod] = f"absent ({type(ex).__name__})"
    commit = Path("benchmarks/COMMIT")
    env["commit"] = commit.read_text().strip() if commit.exists() else "unknown"
    return env


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, nargs="+", default=[16384, 131072])
    ap.add_argument("--kinds", nargs="+", default=["random", "trained", "real"])
    ap.add_argument("--peers", nargs="+", default=list(PEERS))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--union-sweep", action="store_true", help="time msakit's union-tile choice instead of the peers")
    args = ap.parse_args(argv)
    env = environment()
    print(json.dumps(env), flush=True)
    if args.union_sweep:
        rows = union_sweep(args.T, args.kinds)
        (Path(args.out) / "union_sweep.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
        print(f"{'T':>8} {'kind':>8} {'ratio':>6} {'plan ms':>8} " + " ".join(f"{p + ' TF/s':>14}" for p in
                                                                          ("kv_outer", "union", "auto")))
        for r in rows:
            print(f"{r['T']:>8} {r['kind']:>8} {r['ratio']:6.2f} {r['plan_ms']:8.3f} "
                  + " ".join(f"{r.get(p + '_tflops', float('nan')):14.1f}" for p in ("kv_outer", "union", "auto")))
        return
    rows = run(args.T, args.kinds, peers=tuple(args.peers))
    out = Path(args.out) / "peers.json"
    out.write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    print(f"{'T':>8} {'kind':>8} {'union':>6} " + " ".join(f"{p:>12}" for p in args.peers))
    for r in rows:
        print(f"{r['T']:>8} {r['kind']:>8} {r['union_work_ratio']:6.2f} "
              + " ".join(f"{r.get(p + '_tflops', float('nan')):12.1f}" for p in args.peers))


if __name__ == "__main__":
    main()
