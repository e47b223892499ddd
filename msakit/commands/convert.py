"""`msakit convert`: convert a dense model (msakit checkpoint, HF Llama/Qwen2 folder) to MSA and train the
indexer

Add index branches to every dense-attention layer (msakit.models.convert) and train them.  --train index (the
default, the cheapest recipe): only the index branches train, by the KL against the dense attention, with the
backbone frozen (no optimizer state for it) and full attention throughout.  --train all: every parameter, a
dense warm-up (--warmup-steps) and then sparse training by LM + --kl-coef x KL.  A SOURCE that is already
MSA (a warmed model's OUT/model) keeps its own index branches: `msakit convert WARMED/model --train all
--warmup-steps 0` is stage 2 of the recipe (sparse continued training; --lora R trains the backbone through LoRA
adapters, merged into OUT/model at the end; --short-context N reports the loss at N tokens before and after).  The
run ends (also at
--max-tokens or --time-budget) with a checkpoint and the model in OUT/model (weights + tokenizer), which
`msakit eval --model` and `msakit generate` take.  SOURCE: an msakit run / checkpoint folder or an HF model
folder (config.json + safetensors + tokenizer.json).  `msakit convert --resume --out RUN --steps N` continues
a conversion run (the same as `msakit train --resume --out RUN`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path
from typing import Any

from msakit.commands import command_parser
from msakit.commands.options import (NONNEG_INT, POS_FLOAT, POS_INT, add_data_args, add_distributed_args,
                                     add_optim_args, add_resume_arg, data_options, deferred_notes, given,
                                     start_processes)
from msakit.commands.train import resume
from msakit.models.convert import INDEX_INITS
from msakit.nn.attention import KL_TOKENS
from msakit.train.runs import DEFAULT_CONTEXT, DTYPES, convert_run
from msakit.train.trainer import TRAIN_WHAT

# what `--train index` leaves unused (the backbone is frozen, attention dense, the KL the only loss)
NOT_WITH_INDEX = {"warmup_steps": "attention stays dense for the whole index warm-up",
                  "kl_coef": "the KL is the only loss",
                  "kl_every": "the KL is the only loss, computed every step",
                  "routing_bias_rate": "the backbone (its routing bias included) is frozen"}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = command_parser(subparsers, __doc__)
    p.add_argument("source", metavar="SOURCE", nargs="?", default=None,
                   help="dense model: msakit run/checkpoint folder or HF model folder (not with --resume)")
    p.add_argument("--out", default="runs/convert", metavar="DIR", help="run folder")
    add_resume_arg(p, "continue the conversion run in --out (or from CKPT) with its recorded settings")
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
    w.add_argument("--lora", type=POS_INT, default=None, metavar="RANK",
                   help="with --train all: train the backbone through LoRA adapters of this rank (peft; the index "
                        "branch trains fully), merged into OUT/model at the end; no resumable checkpoints")
    w.add_argument("--lora-alpha", type=POS_FLOAT, default=None, metavar="A",
                   help="LoRA scale A / RANK (default RANK: a scale of 1)")
    w.add_argument("--short-context", type=POS_INT, default=None, metavar="N",
                   help="also measure the validation loss over rows of N tokens before and after the run (stage "
                        "2's cost in short-context quality; the recipe's bar: at most +0.5%%)")
    w.add_argument("--short-context-data", nargs="+", default=None, metavar="PATH",
                   help="with --short-context: measure it on these files / folders (another corpus than the "
                        "training data, e.g. English text; the default is the held-out validation files)")
    w.add_argument("--dtype", choices=DTYPES, default="float32", help="dtype of the model's weights during conversion")
    w.add_argument("--max-tokens", type=POS_INT, default=None, metavar="N",
                   help="stop after the step that reads N tokens (batch x context per step; without --steps the "
                        "schedule spans them)")
    w.add_argument("--time-budget", type=POS_FLOAT, default=None, metavar="SECONDS",
                   help="bound on the whole command's wall time, from its start: loading, data preparation and "
                        "validations count; training stops at the first step that ends past it, less the time of "
                        "one validation (measured before training; on --resume none is kept), and the last step's "
                        "validation, checkpoint and the saved model end the run")
    add_data_args(p, vocab=False)
    add_optim_args(p, lr=1e-3, dense_warmup_steps=100, steps=300, eval_every=50, save_every=100, eval_rows=8)
    add_distributed_args(p)
    return p


def check_convert_options(args: argparse.Namespace) -> None:
    """ValueError naming the option for a combination `msakit convert` cannot honour."""
    named = given(args)
    budget = args.time_budget
    if budget is not None and not (math.isfinite(budget) and budget > 0):
        raise ValueError(f"--time-budget must be a positive number of seconds, got {budget!r}")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be positive, got {args.max_tokens}")
    if args.train == "index":
        bad = [k for k in NOT_WITH_INDEX if k in named]
        if bad:
            k = bad[0]
            raise ValueError(f"--{k.replace('_', '-')} does not apply with --train index ({NOT_WITH_INDEX[k]}); "
                             "use --train all for the full recipe")
        if args.lora is not None:
            raise ValueError("--lora does not apply with --train index (the backbone is frozen); use --train all")
        if "lr" in named and "index_lr" in named:
            raise ValueError("--lr and --index-lr: with --train index only the index branch trains; give one of them")
    if args.lora_alpha is not None and args.lora is None:
        raise ValueError("--lora-alpha needs --lora RANK")
    if args.short_context is not None and args.short_context < 2:
        raise ValueError(f"--short-context must be at least 2 tokens, got {args.short_context}")
    if args.short_context_data and args.short_context is None:
        raise ValueError("--short-context-data needs --short-context N (the row length to measure)")
    if args.init_blocks is not None and args.topk is not None and args.init_blocks + 1 > args.topk:
        raise ValueError(f"--init-blocks {args.init_blocks} plus the query's own block exceed --topk {args.topk}")


def run(args: argparse.Namespace) -> int:
    check_convert_options(args)
    parallel, device, main_rank = start_processes(args)
    if args.resume:  # a conversion continues as a training run
        return resume(args, device, parallel)
    if args.source is None:
        raise ValueError("SOURCE is required (the dense model to convert), unless --resume continues a conversion")
    out = Path(args.out)
    data = data_options(args, args.context if args.context is not None else DEFAULT_CONTEXT)
    cfg, say_notes = deferred_notes(args)
    if args.lora is not None:
        cfg = dataclasses.replace(cfg, lora_rank=args.lora, lora_alpha=args.lora_alpha)
    result = convert_run(args.source, out, train=cfg, data=data, tokenizer=args.tokenizer,
                         dtype=args.dtype, index_dim=args.index_dim, block_size=args.block_size, topk=args.topk,
                         init_blocks=args.init_blocks, index_init=args.index_init, max_tokens=args.max_tokens,
                         time_budget=args.time_budget, short_context=args.short_context,
                         short_context_data=args.short_context_data, device=device, parallel=parallel, fsdp=args.fsdp,
                         activation_checkpointing=args.activation_checkpointing, cache_dir=args.cache_dir,
                         progress=not args.no_progress, ready=say_notes)
    if main_rank:
        mdir = result.model_dir
        print(f"model: {mdir} (msakit eval --model {mdir}; msakit generate {mdir})")
        if args.lora is not None:  # no checkpoints: the merged model is where a next run starts
            print(f"continue training: msakit convert {mdir} --train all --warmup-steps 0 --out NEW_RUN")
        else:
            print(f"continue training: msakit convert --resume --out {out} --steps N "
                  f"(or msakit train --resume --out {out})")
    return 0
