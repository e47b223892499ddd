"""`msakit convert`: convert a dense model (msakit checkpoint, HF Llama/Qwen2 folder) to MSA and train the
indexer

Add index branches to every dense-attention layer (msakit.models.convert) and train them.  --train index (the
default, the cheapest recipe): only the index branches train, by the KL against the dense attention, with the
backbone frozen (no optimizer state for it) and full attention throughout.  --train all: every parameter, a
dense warm-up (--warmup-steps) and then sparse training by LM + --kl-coef x KL.  The run ends (also at
--max-tokens or --time-budget) with a checkpoint and the model in OUT/model (weights + tokenizer), which
`msakit eval --model` and `msakit generate` take.  SOURCE: an msakit run / checkpoint folder or an HF model
folder (config.json + safetensors + tokenizer.json).  `msakit convert --resume --out RUN --steps N` continues
a conversion run (the same as `msakit train --resume --out RUN`).
"""

from __future__ import annotations

import argparse
from typing import Any

from msakit.commands import command_parser


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from msakit.distributed.args import add_distributed_args
    from msakit.models.convert import INDEX_INITS
    from msakit.nn.attention import KL_TOKENS
    from msakit.train.run import DTYPES, NONNEG_INT, POS_FLOAT, POS_INT, add_data_args, add_optim_args
    from msakit.train.trainer import TRAIN_WHAT

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
    m.add_argument("--init-blocks", type=NONNEG_INT, default=None, metavar="N",
                   help="leading blocks every query selects (default: model's / 0); models that lean on their first "
                        "tokens want 1")
    m.add_argument("--index-init", choices=INDEX_INITS, default="random",
                   help="initial index projections: random, or from the main q/k projections (qk)")
    w = p.add_argument_group("conversion")
    w.add_argument("--train", choices=TRAIN_WHAT, default="index",
                   help="index: the index branches only, by the KL, backbone frozen, full attention (default); "
                        "all: every parameter (dense warm-up, then sparse LM + KL)")
    w.add_argument("--index-lr", type=POS_FLOAT, default=None, metavar="LR",
                   help="peak learning rate of the index branches (default --lr)")
    w.add_argument("--kl-tokens", choices=KL_TOKENS, default="selected",
                   help="the KL over the indexer's selected tokens or over every causal token")
    w.add_argument("--dtype", choices=DTYPES, default="float32", help="dtype of the model's weights during conversion")
    w.add_argument("--max-tokens", type=POS_INT, default=None, metavar="N",
                   help="stop after the step that reads N tokens (batch x context per step; without --steps the "
                        "schedule spans them)")
    w.add_argument("--time-budget", type=POS_FLOAT, default=None, metavar="SECONDS",
                   help="stop after the step that ends past this many seconds of training")
    add_data_args(p, vocab=False)
    add_optim_args(p, lr=1e-3, dense_warmup_steps=100, steps=300, eval_every=50, save_every=100, eval_rows=8)
    add_distributed_args(p, positive_int=POS_INT)
    p.set_defaults(func=_run)
    return p


def _run(args: argparse.Namespace) -> int:
    from msakit.train.run import run_convert

    return run_convert(args)
