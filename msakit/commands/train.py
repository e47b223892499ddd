"""`msakit train`: train an M3 model (full-attention warm-up, then sparse attention)

Train an M3-style model: AdamW with warm-up + cosine, LM loss + lambda * indexer KL, full attention for
--warmup-steps (the indexer learns meanwhile), then MSA sparse attention. Logs metrics.jsonl and plots; writes
atomic, hashed checkpoints under OUT/checkpoints.
"""

from __future__ import annotations

import argparse
from typing import Any

from msakit.commands import command_parser


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from msakit.distributed.args import add_distributed_args
    from msakit.train.run import POS_INT, add_data_args, add_optim_args

    p = command_parser(subparsers, __doc__)
    p.add_argument("--out", default="runs/train", metavar="DIR", help="run folder (default runs/train)")
    p.add_argument("--resume", nargs="?", const=True, default=None, metavar="CKPT",
                   help="continue the run in --out (or from CKPT) with the same data order and settings; only "
                        "--steps (to train further), --device, --cache-dir and --no-progress may be given with it")
    m = p.add_argument_group("model")
    m.add_argument("--preset", default="tiny",
                   help="tiny (CPU), small (one GPU), minimax-m3, minimax-m3.1-flash (refused where it cannot fit)")
    m.add_argument("--config", metavar="PATH", help="an M3 config.json (or its folder) instead of a preset")
    m.add_argument("--attention", choices=("msa", "dense"), default="msa",
                   help="dense: a plain GQA model without index branches (a source for `msakit convert`)")
    m.add_argument("--init", metavar="PATH", help="start from these weights (a checkpoint or model folder)")
    add_data_args(p)
    add_optim_args(p)
    add_distributed_args(p, positive_int=POS_INT)
    p.set_defaults(func=_run)
    return p


def _run(args: argparse.Namespace) -> int:
    from msakit.train.run import run_train

    return run_train(args)
