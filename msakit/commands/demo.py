"""`msakit demo`: train the tiny M3 model on the stdlib corpus in ~3 minutes and report dense vs sparse

`msakit demo`: the whole system in a few minutes on a 2-core CPU.  Writes report.md, metrics.jsonl and loss.png
under --out.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from msakit.commands import command_parser
from msakit.commands.options import POS_FLOAT, POS_INT, SEED, Number, add_device_arg
from msakit.train.demo import DEFAULT_PROMPT, PROFILES, fmt_list, run_demo


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = command_parser(subparsers, __doc__)
    p.add_argument("--preset", choices=tuple(PROFILES), default="tiny", help="tiny (CPU, default) or small (GPU)")
    add_device_arg(p)
    p.add_argument("--out", default="runs/demo", metavar="DIR",
                   help="output folder: new, empty or an earlier demo's output (default runs/demo)")
    p.add_argument("--budget", type=POS_FLOAT, default=None, metavar="SECONDS",
                   help="wall-time budget of the whole demo (default 180 for tiny, 600 for small)")
    p.add_argument("--steps", type=Number(int, 2), default=None, metavar="N",
                   help="train exactly N steps (no time planning)")
    p.add_argument("--data", nargs="+", metavar="PATH", default=None, help="extra files or folders for the corpus")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt of the generated sample")
    p.add_argument("--seed", type=SEED, default=0, help="seed of the initialisation, data order and sample")
    p.add_argument("--threads", type=POS_INT, default=None, metavar="N", help="CPU threads for torch (default: torch's)")
    p.add_argument("--cache-dir", metavar="DIR", help="tokenizer / token cache (default $MSAKIT_CACHE or ~/.cache/msakit)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    info = run_demo(preset=args.preset, out=out, device=args.device, budget=args.budget, steps=args.steps,
                    data=args.data, prompt=args.prompt, seed=args.seed, threads=args.threads,
                    cache_dir=args.cache_dir, progress=not args.no_progress)
    print_summary(info, out)
    return 0


def print_summary(i: dict, out: Path) -> None:
    f = i["final"]
    r = f["recall_per_layer"]
    o = f["oracle_per_layer"]
    print()
    print(f"msakit demo finished in {i['total_s']:.0f}s ({i['train_cfg'].steps} steps, {i['tokens_seen']:,} tokens)")
    print(f"  validation loss, same weights: dense {f['val_loss_dense']:.4f}, sparse {f['val_loss_sparse']:.4f} "
          f"({100 * f['relative_gap']:+.2f}%); context-free {f['val_loss_unigram']:.4f}")
    print(f"  {f['verdict']}: {f['verdict_reason']}")
    if r:
        print(f"  indexer recall per layer: {fmt_list(r)} (oracle {fmt_list(o)})")
    first = i["sample"].splitlines()[:4]
    print("  sample: " + "\n          ".join(first))
    print(f"  report: {out / 'report.md'}  plots: {out / 'loss.png'}, {out / 'recall.png'}")
