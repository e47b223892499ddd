"""Prefill and training-step speed of msakit's MSA kernels against cuDNN dense attention, in one
run on one GPU.  One layer of the M3 shape: Hq=64, G=4, D=128, Di=128, block 128, top-16, bf16,
batch 1.

Selection kinds (`--kinds`):
  random       index_topk on random keys: choices spread uniformly
  trained-like own block + 3 local blocks + block 0 + 11 stripes per group that every later
               query shares (benchmarks/selections.py), the pattern of a trained indexer
  real-like    own block + persistent slots redrawn at a fitted rate from hot blocks and a
               power law of distances (benchmarks/selections.py `RealLike`: the statistics of
               measured selections, docs/kernels.md)
  dumped       a selection dumped from a trained model's indexer (`--selection-file`, at its own T;
               `python benchmarks/selections.py --model DIR --context T --out sel.pt` writes one: a
               model with this benchmark's selection, blocks of 128 and top-16)
Score dtypes (`--scores`): "bf16" rows score the index in bf16 (every kind); an "fp8" row
(kind random) runs `ops.msa_attention(score_dtype="fp8")` end to end and reports its selection's
recall against the bf16 selection (the other kinds do not depend on scoring).
Every kind runs the same work: index_topk is computed (and timed) in each forward / training
step; the trained-like, real-like and dumped kinds then attend (and train the KL) on their own
selection.
The dense baseline is measured once per context in the same run.

    python benchmarks/prefill.py [--T 16384 131072 1048576] [--train-T 16384 131072]
                                 [--kinds random trained-like real-like] [--selection-file sel.pt] [--quick]
    python benchmarks/prefill.py --train-T 16384 131072 1048576     # issue-16 table (dense 1M step: T^2 from 128K)
    python benchmarks/prefill.py --profile --T 131072          # torch.profiler kernel tables
    python benchmarks/prefill.py --once --T 16384              # one forward, for `ncu -k regex:_sa_fwd`

Writes benchmarks/results/prefill_<gpu><tag>.json (and --out / $OUT), a PNG of speedup against
context, and prints a table.  Reported per row: times, speedups, index / sparse-attention /
dense TFLOP/s, peak extra memory beyond the inputs and output, and the selection's shape
(selections.selection_stats); with --check (default at the smallest T), the max relative row
error of the forward against the float32 reference.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import (RESULTS, add_run_args, bench_ms, copy_out, dense_cudnn, env_info, gpu_tag,  # noqa: E402
                               save_json)
from benchmarks.selections import (load_block_idx, real_like_block_idx, selection_stats,  # noqa: E402
                                   trained_like_block_idx)
from msakit import ops  # noqa: E402

HQ, G, D, DI, BS, TOPK = 64, 4, 128, 128, 128, 16
KINDS = ("random", "trained-like", "real-like", "dumped")
QUICK = dict(T=[16384, 131072], train_T=[16384])


def inputs(T: int, seed: int = 0, grad: bool = False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    q, k, v = mk(1, T, HQ, D), mk(1, T, G, D), mk(1, T, G, D)
    qi, ki = mk(1, T, G, DI), mk(1, T, DI)
    if grad:
        for t in (q, k, v, qi, ki):
            t.requires_grad_(True)
    return q, k, v, qi, ki


def flops_index(T: int) -> float:
    return G * DI * T * T  # causal half of 2*G*Di*T^2


def flops_attn(T: int) -> float:
    return 4 * HQ * D * TOPK * BS * T


def flops_dense(T: int) -> float:
    return 2 * HQ * D * T * T  # causal half of 4*Hq*D*T^2


def msa_forward(q, k, v, qi, ki, bi=None):
    """The MSA forward of one layer: index_topk, then sparse_attention on its selection (or on
    `bi` when given: the index branch still runs, so every kind does the same work)."""
    sel = ops.index_topk(qi, ki, block_size=BS, topk=TOPK)
    return ops.sparse_attention(q, k, v, sel if bi is None else bi, block_size=BS, validate=False)


def msa_train_step(q, k, v, qi, ki, do, bi=None) -> None:
    """Forward + backward of one layer with the indexer KL loss (sum(o * do) + KL, from
    `ops.sparse_attention_with_kl`: the KL reuses the forward's lse), on index_topk's selection or
    on `bi`."""
    sel = ops.index_topk(qi.detach(), ki.detach(), block_size=BS, topk=TOPK)
    sel = sel if bi is None else bi
    o, kl = ops.sparse_attention_with_kl(q, k, v, qi, ki, sel, block_size=BS, validate=False)
    ((o.float() * do).sum() + kl).backward()


def recall_vs(sel: torch.Tensor, ref: torch.Tensor, rows: int = 1 << 16) -> float:
    """Mean over (batch, group, query) rows of |sel ∩ ref| / |ref| (valid, >= 0 entries), two
    [B, G, T, topk] selections; computed over chunks of `rows` queries."""
    hit = tot = 0
    for t0 in range(0, sel.shape[2], rows):
        a, b = sel[:, :, t0:t0 + rows].long(), ref[:, :, t0:t0 + rows].long()
        valid = b >= 0
        inter = ((b.unsqueeze(-1) == a.unsqueeze(-2)) & (a >= 0).unsqueeze(-2)).any(-1) & valid
        hit += int(inter.sum())
        tot += int(valid.sum())
    return hit / max(tot, 1)


def fp8_row(T: int, q, k, v, qi, ki, dense: float, *, max_s: float) -> dict:
    """The forward row of `msa_attention(score_dtype="fp8")` on random inputs: times, speedup,
    peak extra memory and the recall of its selection against bf16 scoring."""
    row: dict = {"T": T, "kind": "random", "score": "fp8", "dense_ms": dense}

    def fwd():
        return ops.msa_attention(q, k, v, qi, ki, block_size=BS, topk=TOPK, score_dtype="fp8")

    row["index_topk_ms"] = bench_ms(lambda: ops.index_topk(qi, ki, block_size=BS, topk=TOPK, score_dtype="fp8"),
                                    max_s=max_s)
    sel8 = ops.index_topk(qi, ki, block_size=BS, topk=TOPK, score_dtype="fp8")
    sel16 = ops.index_topk(qi, ki, block_size=BS, topk=TOPK)
    row["recall_vs_bf16"] = recall_vs(sel8, sel16)
    row["same_set_frac"] = float((sel8.sort(-1).values == sel16.sort(-1).values).all(-1).float().mean())
    row.update(selection_stats(sel8, BS))
    del sel8, sel16
    torch.cuda.empty_cache()
    row["peak_extra_GiB"] = peak_extra_gib(fwd, q.numel() * q.element_size())
    row["msa_fwd_ms"] = bench_ms(fwd, max_s=max_s)
    row["speedup_fwd"] = dense / row["msa_fwd_ms"]
    row["index_tflops"] = flops_index(T) / row["index_topk_ms"] / 1e9
    return row


def selection_for(kind: str, T: int, qi, ki, selection_file: str | None):
    """block_idx [1, G, T, TOPK] of a kind at context T (None for "random": index_topk's own)."""
    if kind == "random":
        return None
    if kind == "trained-like":
        return trained_like_block_idx(T, block_size=BS, topk=TOPK, groups=G, device=qi.device)
    if kind == "real-like":
        return real_like_block_idx(T, block_size=BS, topk=TOPK, groups=G, device=qi.device)
    if kind == "dumped":
        return load_block_idx(selection_file, B=1, G=G, T=T, topk=TOPK, block_size=BS, device=qi.device)
    raise ValueError(f"unknown selection kind {kind!r} (one of {KINDS})")


def max_row_err(q, k, v, bi) -> float:
    """Max over rows (query, head) of |o - o_ref| / |o_ref| against the float32 reference."""
    from msakit.ops.sparse_attention.reference import sparse_attention_reference

    o = ops.sparse_attention(q, k, v, bi, block_size=BS, validate=False).float()
    ref = sparse_attention_reference(q.float(), k.float(), v.float(), bi, block_size=BS)
    return float(((o - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)).max())


def peak_extra_gib(fn, keep_bytes: int = 0) -> float:
    """Peak memory allocated by fn() beyond what was allocated before, minus `keep_bytes` (its
    output), in GiB."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del out
    return (peak - base - keep_bytes) / 2**30


def run_forward(T: int, kinds: list[str], selection_file: str | None, *, check: bool, max_s: float,
                scores: tuple[str, ...] = ("bf16",)) -> list[dict]:
    q, k, v, qi, ki = inputs(T)
    torch.cuda.synchronize()
    dense = bench_ms(dense_cudnn(q, k, v), max_s=2 * max_s)  # the baseline of every speedup: more repetitions
    torch.cuda.empty_cache()
    topk_ms = bench_ms(lambda: ops.index_topk(qi, ki, block_size=BS, topk=TOPK), max_s=max_s)
    rows = []
    for kind in kinds:
        row: dict = {"T": T, "kind": kind, "score": "bf16", "dense_ms": dense, "index_topk_ms": topk_ms}
        try:  # a kind that fails (memory, a kernel limit) is reported and the others still run
            bi = selection_for(kind, T, qi, ki, selection_file)
            sel = ops.index_topk(qi, ki, block_size=BS, topk=TOPK) if bi is None else bi
            row.update(selection_stats(sel, BS))
            out_bytes = q.numel() * q.element_size()
            row["peak_extra_GiB"] = peak_extra_gib(lambda: msa_forward(q, k, v, qi, ki, bi), out_bytes)
            row["sparse_attn_ms"] = bench_ms(lambda: ops.sparse_attention(q, k, v, sel, block_size=BS, validate=False),
                                             max_s=max_s)
            row["msa_fwd_ms"] = bench_ms(lambda: msa_forward(q, k, v, qi, ki, bi), max_s=max_s)
            row["speedup_fwd"] = dense / row["msa_fwd_ms"]
            row["index_tflops"] = flops_index(T) / topk_ms / 1e9
            row["sparse_attn_tflops"] = flops_attn(T) / row["sparse_attn_ms"] / 1e9
            row["dense_tflops"] = flops_dense(T) / dense / 1e9
            if check:
                row["max_row_rel_err"] = max_row_err(q, k, v, sel)
            del sel, bi
        except Exception as e:
            row["error"] = repr(e)[:500]
        rows.append(row)
        show(row)
    if "fp8" in scores:
        try:
            row = fp8_row(T, q, k, v, qi, ki, dense, max_s=max_s)
        except Exception as e:
            row = {"T": T, "kind": "random", "score": "fp8", "error": repr(e)[:500]}
        rows.append(row)
        show(row)
    return rows


def show(row: dict) -> None:
    """Prints a finished row (floats rounded) and frees the cached blocks it left."""
    print({a: round(b, 3) if isinstance(b, float) else b for a, b in row.items()}, flush=True)
    torch.cuda.empty_cache()


def run_train(T: int, kinds: list[str], selection_file: str | None, *, max_s: float,
              dense_max_T: int | None = None) -> list[dict]:
    """Training-step rows at context T; above `dense_max_T` the dense step is not run (its
    expanded K / V and gradients do not fit beside MSA's) and dense_train_ms stays None for
    `extrapolate_dense` to fill."""
    q, k, v, qi, ki = inputs(T, grad=True)
    do = torch.randn_like(q)
    dense = None
    if dense_max_T is None or T <= dense_max_T:
        dense = bench_ms(dense_cudnn(q, k, v, backward=True), rep=5, max_s=2 * max_s)
        torch.cuda.empty_cache()
    rows = []
    for kind in kinds:
        row: dict = {"T": T, "kind": kind, "dense_train_ms": dense}
        try:
            bi = selection_for(kind, T, qi, ki, selection_file)

            def step():
                msa_train_step(q, k, v, qi, ki, do, bi)

            row["train_peak_extra_GiB"] = peak_extra_gib(step)
            for t in (q, k, v, qi, ki):
                t.grad = None
            row["msa_train_ms"] = bench_ms(step, rep=5, max_s=max_s)
            if dense is not None:
                row["speedup_train"] = dense / row["msa_train_ms"]
            del bi
        except Exception as e:
            row["error"] = repr(e)[:500]
        rows.append(row)
        for t in (q, k, v, qi, ki):
            t.grad = None
        show(row)
    return rows


def extrapolate_dense(train_rows: list[dict]) -> None:
    """Fills dense_train_ms of rows without it as (T / T0)^2 x the dense step measured at the largest
    T0 of this run (dense attention's FLOPs grow with T^2; marked dense_train_extrapolated)."""
    measured = [r for r in train_rows if r.get("dense_train_ms") is not None]
    if not measured:
        return
    ref = max(measured, key=lambda r: r["T"])
    for r in train_rows:
        if r.get("dense_train_ms") is None:
            r["dense_train_ms"] = ref["dense_train_ms"] * (r["T"] / ref["T"]) ** 2
            r["dense_train_extrapolated_from_T"] = ref["T"]
            if "msa_train_ms" in r:
                r["speedup_train"] = r["dense_train_ms"] / r["msa_train_ms"]


def profile(fn, label: str) -> str:
    """torch.profiler table (CUDA time) of one fn() after one warm-up call."""
    from torch.profiler import ProfilerActivity, profile as tprofile

    fn()
    torch.cuda.synchronize()
    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70)
    return f"== {label}\n{table}\n"


def plot(rows: list[dict], train_rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "error" not in r]
    train_rows = [r for r in train_rows if "error" not in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    for kind, score in dict.fromkeys((r["kind"], r.get("score", "bf16")) for r in rows):
        fr = [r for r in rows if r["kind"] == kind and r.get("score", "bf16") == score]
        name = kind if score == "bf16" else f"{kind}, {score} scoring"
        ax.plot([r["T"] for r in fr], [r["speedup_fwd"] for r in fr], "o-", label=f"forward, {name}")
        if score != "bf16":
            continue
        tr = [r for r in train_rows if r["kind"] == kind and r.get("speedup_train") is not None]
        if tr:
            ax.plot([r["T"] for r in tr], [r["speedup_train"] for r in tr], "s--", label=f"training step, {kind}")
    Ts = sorted({r["T"] for r in rows})
    ax.plot(Ts, [flops_dense(T) / (flops_index(T) + flops_attn(T)) for T in Ts], "k:", label="FLOP ratio")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context T (tokens)")
    ax.set_ylabel("speedup over cuDNN dense (x)")
    ax.axhline(1, color="grey", lw=0.5)
    ax.legend(fontsize=7)
    ax.set_title(f"MSA vs dense, M3 layer shape, {torch.cuda.get_device_name()}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_table(rows: list[dict], train_rows: list[dict]) -> None:
    print(f"\n{'T':>9} {'kind':>12} {'score':>5} {'dense ms':>10} {'msa ms':>9} {'speedup':>8} {'idx TF/s':>9} "
          f"{'attn TF/s':>9} {'extra GiB':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['T']:>9} {r['kind']:>12} error: {r['error'][:80]}")
            continue
        attn = f"{r['sparse_attn_tflops']:>9.1f}" if "sparse_attn_tflops" in r else f"{'-':>9}"
        rec = f"  recall vs bf16 {r['recall_vs_bf16']:.3f}" if "recall_vs_bf16" in r else ""
        print(f"{r['T']:>9} {r['kind']:>12} {r.get('score', 'bf16'):>5} {r['dense_ms']:>10.2f} {r['msa_fwd_ms']:>9.2f} "
              f"{r['speedup_fwd']:>8.2f} {r['index_tflops']:>9.1f} {attn} {r['peak_extra_GiB']:>9.2f}{rec}")
    for r in train_rows:
        if "error" in r:
            print(f"train {r['T']:>9} {r['kind']:>12} error: {r['error'][:80]}")
            continue
        ext = " (dense extrapolated)" if "dense_train_extrapolated_from_T" in r else ""
        f = lambda x: "n/a" if x is None else f"{x:.2f}"  # noqa: E731
        print(f"train {r['T']:>9} {r['kind']:>12} dense {f(r.get('dense_train_ms'))} ms{ext}  msa "
              f"{r['msa_train_ms']:.2f} ms  speedup {f(r.get('speedup_train'))}  extra {r['train_peak_extra_GiB']:.2f} GiB")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, nargs="*", default=[16384, 131072, 1048576])
    ap.add_argument("--train-T", type=int, nargs="*", default=[16384, 131072])
    ap.add_argument("--kinds", nargs="*", default=["random", "trained-like", "real-like"], choices=KINDS)
    ap.add_argument("--scores", nargs="*", default=["bf16", "fp8"], choices=("bf16", "fp8"),
                    help="index scoring of the forward rows: bf16 (every kind), fp8 (msa_attention end to end, random)")
    ap.add_argument("--selection-file", default=None,
                    help="a dumped selection (torch / safetensors block_idx [1, G, T, 16]): adds the kind 'dumped' "
                         "at its own T")
    ap.add_argument("--check", type=int, nargs="*", default=None, metavar="T",
                    help="contexts with the reference row-error check (default: the smallest forward T)")
    ap.add_argument("--dense-train-max-T", type=int, default=262144,
                    help="above this context the dense training step is extrapolated (T^2) from the largest measured")
    ap.add_argument("--max-s", type=float, default=4.0, help="seconds per timed quantity (fewer repetitions beyond)")
    ap.add_argument("--profile", action="store_true", help="print torch.profiler tables instead of the table")
    ap.add_argument("--once", action="store_true", help="warm up, then one forward (for ncu)")
    add_run_args(ap, f"smoke run: forward {QUICK['T']}, training {QUICK['train_T']}")
    args = ap.parse_args(argv)
    if args.quick:
        args.T, args.train_T = QUICK["T"], QUICK["train_T"]
    if args.selection_file and "dumped" not in args.kinds:
        args.kinds = [*args.kinds, "dumped"]
    if "dumped" in args.kinds and not args.selection_file:
        ap.error("the kind 'dumped' needs --selection-file")
    if args.check is None:
        args.check = [min(args.T)] if args.T else []
    return args


def kinds_at(T: int, kinds: list[str], selection_file: str | None) -> list[str]:
    """The kinds measured at context T: 'dumped' only at the file's own T."""
    if "dumped" not in kinds:
        return kinds
    t = load_block_idx_T(selection_file)
    return [k for k in kinds if k != "dumped" or T == t]


def load_block_idx_T(path: str) -> int:
    """The context length of a dumped selection file."""
    p = Path(path)
    if p.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(p), "pt") as f:
            return int(f.get_slice("block_idx").get_shape()[2])
    obj = torch.load(p, map_location="cpu", weights_only=True)
    return int((obj["block_idx"] if isinstance(obj, dict) else obj).shape[2])


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.selection_file:  # the dumped kind runs at its own T, forward and training
        t = load_block_idx_T(args.selection_file)
        args.T = sorted(set(args.T) | {t})
        args.train_T = sorted(set(args.train_T) | {t})
    if args.once or args.profile:
        T = args.T[0]
        text = ""
        for kind in args.kinds:
            if kind not in kinds_at(T, args.kinds, args.selection_file):
                continue
            q, k, v, qi, ki = inputs(T, grad=args.profile and bool(args.train_T))
            bi = selection_for(kind, T, qi, ki, args.selection_file)
            if args.once:
                for _ in range(2):
                    msa_forward(q.detach(), k.detach(), v.detach(), qi.detach(), ki.detach(), bi)
                    torch.cuda.synchronize()
                return
            with torch.no_grad():
                text += profile(lambda: msa_forward(q, k, v, qi, ki, bi), f"forward T={T} {kind}")
            if args.train_T:
                do = torch.randn_like(q)
                text += profile(lambda: msa_train_step(q, k, v, qi, ki, do, bi), f"train step T={T} {kind}")
            del q, k, v, qi, ki, bi
            torch.cuda.empty_cache()
        print(text, flush=True)
        path = RESULTS / f"prefill_profile_{gpu_tag()}{args.tag}.txt"
        path.write_text(text)
        copy_out(path, args.out)
        return
    info = env_info()
    rows, train_rows = [], []
    name = f"prefill_{gpu_tag(info)}{args.tag}.json"
    payload = {"env": info, "scores": args.scores,
               "shape": dict(Hq=HQ, G=G, D=D, Di=DI, block=BS, topk=TOPK, dtype="bf16", B=1),
               "kinds": args.kinds, "selection_file": args.selection_file, "forward": rows, "train": train_rows}
    for T in args.T:
        rows += run_forward(T, kinds_at(T, args.kinds, args.selection_file), args.selection_file,
                            check=T in args.check, max_s=args.max_s, scores=tuple(args.scores))
        save_json(name, dict(payload, partial=True), args.out)  # kept if a later context runs out of time
    for T in args.train_T:
        train_rows += run_train(T, kinds_at(T, args.kinds, args.selection_file), args.selection_file, max_s=args.max_s,
                                dense_max_T=args.dense_train_max_T)
        extrapolate_dense(train_rows)
        save_json(name, dict(payload, partial=True), args.out)
    save_json(name, payload, args.out)
    png = RESULTS / name.replace(".json", ".png")
    try:
        plot(rows, train_rows, png)
        copy_out(png, args.out)
    except Exception as e:  # plotting is optional
        print("plot failed:", e)
    print_table(rows, train_rows)


if __name__ == "__main__":
    main()
