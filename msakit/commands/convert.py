"""`msakit convert`: convert a dense model (msakit checkpoint, HF Llama/Qwen2 folder) to MSA and train the
indexer

Add index branches to every dense-attention layer (msakit.models.convert), warm the indexer up by KL while the
main branch stays dense (--warmup-steps), then continue training in sparse mode.  SOURCE: an msakit run /
checkpoint folder or an HF model folder (config.json + safetensors + tokenizer.json).  `msakit convert
--resume --out RUN --steps N` continues a conversion run (the same as `msakit train --resume --out RUN`).
"""

from __future__ import annotations

import argparse
from typing import Any

from msakit.commands import command_parser


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from msakit.distributed.args import add_distributed_args
    from msakit.train.run import POS_INT, add_data_args, add_optim_args

    p = command_parser(subparsers, __doc__)
    p.add_argument("source", metavar="SOURCE", nargs="?", default=None,
                   help="dense model: msakit run/checkpoint folder or HF model folder (not with --resume)")
    p.add_argument("--out", default="runs/convert", metavar="DIR", help="run folder")
    p.add_argument("--resume", nargs="?", const=True, default=None, metavar="CKPT",
                   help="continue the conversion run in --out (or from CKPT) with its recorded settings")
    m = p.add_argument_group("index branch")
    m.add_argument("--block-size", type=POS_INT, default=None, metavar="N", help="MSA block size (default: model's / 128)")
    m.add_argument("--topk", type=POS_INT, default=None, metavar="K", help="blocks per query (default: model's / 16)")
    m.add_argument("--index-dim", type=POS_INT, default=None, metavar="N", help="index head dim (default: model's)")
    add_data_args(p, vocab=False)
    add_optim_args(p, lr=1e-3, dense_warmup_steps=100, steps=300, eval_every=50, save_every=100)
    add_distributed_args(p, positive_int=POS_INT)
    p.set_defaults(func=_run)
    return p


def _run(args: argparse.Namespace) -> int:
    from msakit.train.run import run_convert

    return run_convert(args)
