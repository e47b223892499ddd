"""Prefill and training-step speed of msakit's MSA kernels against cuDNN dense attention, in one
run on one GPU (issue: Hopper kernels).  One layer of the M3 shape: Hq=64, G=4, D=128, Di=128,
block 128, top-16, bf16, batch 1.

    python benchmarks/prefill.py [--T 16384 65536 131072 262144 1048576] [--train-T 16384 65536 131072]

Writes benchmarks/results/prefill_<gpu>.json (and $OUT/ when set), a PNG of speedup against
context, and prints a table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import RESULTS, bench_ms, dense_cudnn, env_info, save_json  # noqa: E402
from msakit import ops  # noqa: E402

HQ, G, D, DI, BS, TOPK = 64, 4, 128, 128, 128, 16


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


def msa_forward(q, k, v, qi, ki):
    """The MSA forward of one layer: index_topk, then sparse_attention."""
    return ops.sparse_attention(q, k, v, ops.index_topk(qi, ki, block_size=BS, topk=TOPK), block_size=BS, validate=False)


def msa_train_step(q, k, v, qi, ki, do) -> None:
    """Forward + backward of one layer with the indexer KL loss (sum(o * do) + KL)."""
    bi = ops.index_topk(qi.detach(), ki.detach(), block_size=BS, topk=TOPK)
    o, lse = ops.sparse_attention(q, k, v, bi, block_size=BS, return_lse=True, validate=False)
    kl = ops.index_kl_loss(q, k, qi, ki, bi, block_size=BS, lse=lse, validate=False)
    ((o.float() * do).sum() + kl).backward()


def run_forward(T: int, dense_once: bool) -> dict:
    q, k, v, qi, ki = inputs(T)
    torch.cuda.synchronize()
    row: dict = {"T": T}
    run_dense = dense_cudnn(q, k, v)
    row["dense_ms"] = bench_ms(run_dense, warmup=0 if dense_once else 2, rep=1 if dense_once else 10)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    bi = ops.index_topk(qi, ki, block_size=BS, topk=TOPK)
    o = ops.sparse_attention(q, k, v, bi, block_size=BS, validate=False)
    torch.cuda.synchronize()
    out_bytes = o.numel() * o.element_size()
    row["peak_extra_GiB"] = (torch.cuda.max_memory_allocated() - base - out_bytes) / 2**30
    del o
    row["index_topk_ms"] = bench_ms(lambda: ops.index_topk(qi, ki, block_size=BS, topk=TOPK))
    row["sparse_attn_ms"] = bench_ms(lambda: ops.sparse_attention(q, k, v, bi, block_size=BS, validate=False))
    row["msa_fwd_ms"] = bench_ms(lambda: msa_forward(q, k, v, qi, ki))
    row["speedup_fwd"] = row["dense_ms"] / row["msa_fwd_ms"]
    row["index_tflops"] = flops_index(T) / row["index_topk_ms"] / 1e9
    row["sparse_attn_tflops"] = flops_attn(T) / row["sparse_attn_ms"] / 1e9
    row["dense_tflops"] = flops_dense(T) / row["dense_ms"] / 1e9
    return row


def run_train(T: int) -> dict:
    q, k, v, qi, ki = inputs(T, grad=True)
    do = torch.randn_like(q)
    row: dict = {"T": T}
    row["dense_train_ms"] = bench_ms(dense_cudnn(q, k, v, backward=True), rep=5)

    def step():
        msa_train_step(q, k, v, qi, ki, do)

    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    row["train_peak_extra_GiB"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    row["msa_train_ms"] = bench_ms(step, rep=5)
    row["speedup_train"] = row["dense_train_ms"] / row["msa_train_ms"]
    return row


def plot(rows: list[dict], train_rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["T"] for r in rows], [r["speedup_fwd"] for r in rows], "o-", label="forward (index_topk + sparse_attention)")
    if train_rows:
        ax.plot([r["T"] for r in train_rows], [r["speedup_train"] for r in train_rows], "s-", label="training step (+ KL)")
    ax.plot([r["T"] for r in rows], [flops_dense(r["T"]) / (flops_index(r["T"]) + flops_attn(r["T"])) for r in rows], "k--", label="FLOP ratio")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context T (tokens)")
    ax.set_ylabel("speedup over cuDNN dense (x)")
    ax.axhline(1, color="grey", lw=0.5)
    ax.legend(fontsize=8)
    ax.set_title(f"MSA vs dense, M3 layer shape, {torch.cuda.get_device_name()}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, nargs="*", default=[16384, 65536, 131072, 262144, 1048576])
    ap.add_argument("--train-T", type=int, nargs="*", default=[16384, 65536, 131072])
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    info = env_info()
    rows, train_rows = [], []
    for T in args.T:
        rows.append(run_forward(T, dense_once=T >= 524288))
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()}, flush=True)
        torch.cuda.empty_cache()
    for T in args.train_T:
        train_rows.append(run_train(T))
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in train_rows[-1].items()}, flush=True)
        torch.cuda.empty_cache()
    gpu = (info.get("gpu") or "gpu").replace(" ", "_")
    name = f"prefill_{gpu}{args.tag}.json"
    save_json(name, {"env": info, "shape": dict(Hq=HQ, G=G, D=D, Di=DI, block=BS, topk=TOPK, dtype="bf16", B=1),
                     "forward": rows, "train": train_rows})
    png = RESULTS / name.replace(".json", ".png")
    plot(rows, train_rows, png)
    import os, shutil

    if os.environ.get("OUT"):
        shutil.copy(png, os.environ["OUT"])
    print(f"\n{'T':>9} {'dense ms':>10} {'msa ms':>9} {'speedup':>8} {'idx TF/s':>9} {'attn TF/s':>9} {'extra GiB':>9}")
    for r in rows:
        print(f"{r['T']:>9} {r['dense_ms']:>10.2f} {r['msa_fwd_ms']:>9.2f} {r['speedup_fwd']:>8.2f} "
              f"{r['index_tflops']:>9.1f} {r['sparse_attn_tflops']:>9.1f} {r['peak_extra_GiB']:>9.2f}")
    for r in train_rows:
        print(f"train {r['T']:>9} dense {r['dense_train_ms']:.2f} ms  msa {r['msa_train_ms']:.2f} ms  speedup {r['speedup_train']:.2f}")


if __name__ == "__main__":
    main()
