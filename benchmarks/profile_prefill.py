"""Kernel-level time breakdown of the MSA forward and training step (torch.profiler, CUDA
activities), at the M3 layer shape of benchmarks/prefill.py.  Prints the kernels sorted by
device time and writes the table to $OUT (or /tmp).

    python benchmarks/profile_prefill.py [--T 131072] [--train]
    python benchmarks/profile_prefill.py --T 16384 --once   # one forward, for `ncu -k regex:_sa_fwd`
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.prefill import inputs, msa_forward, msa_train_step  # noqa: E402


def profile(fn, label: str, out_dir: str) -> str:
    from torch.profiler import ProfilerActivity, profile as tprofile

    fn()
    torch.cuda.synchronize()
    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70)
    text = f"== {label}\n{table}\n"
    with open(os.path.join(out_dir, "profile_prefill.txt"), "a") as fh:
        fh.write(text)
    return text


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=131072)
    ap.add_argument("--train", action="store_true")
    ap.add_argument("--once", action="store_true", help="warm up, then one forward (for ncu)")
    args = ap.parse_args()
    out_dir = os.environ.get("OUT", "/tmp")
    q, k, v, qi, ki = inputs(args.T, grad=args.train)
    if args.once:
        msa_forward(q, k, v, qi, ki)
        torch.cuda.synchronize()
        msa_forward(q, k, v, qi, ki)
        torch.cuda.synchronize()
        return
    print(profile(lambda: msa_forward(q, k, v, qi, ki), f"forward T={args.T}", out_dir), flush=True)
    if args.train:
        do = torch.randn_like(q)
        print(profile(lambda: msa_train_step(q, k, v, qi, ki, do), f"train step T={args.T}", out_dir), flush=True)


if __name__ == "__main__":
    main()
