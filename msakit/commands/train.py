"""`msakit train`: train an M3 model (full-attention warm-up, then sparse attention)

Train an M3-style model: AdamW with warm-up + cosine, LM loss + lambda * indexer KL, full attention for
--warmup-steps (the indexer learns meanwhile), then MSA sparse attention. Logs metrics.jsonl and plots; writes
atomic, hashed checkpoints under OUT/checkpoints.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from msakit.commands import command_parser
from msakit.commands.options import (add_data_args, add_distributed_args, add_optim_args, add_resume_arg,
                                     check_resume_options, data_options, deferred_notes, given, resume_from,
                                     start_processes)
from msakit.train.runs import DEFAULT_CONTEXT, resume_run, train_run

# what may change when a run is resumed: where and how it runs (not what it trains)
RESUME_OPTIONS = frozenset({"out", "resume", "steps", "device", "no_progress", "cache_dir",
                            "cp", "fsdp", "activation_checkpointing", "max_tokens", "time_budget", "compile"})


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = command_parser(subparsers, __doc__)
    p.add_argument("--out", default="runs/train", metavar="DIR", help="run folder (default runs/train)")
    add_resume_arg(p, "continue the run in --out (or from CKPT) with the same data order and settings; only "
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
    add_distributed_args(p)
    return p


def resume(args: argparse.Namespace, device, parallel=None) -> int:
    """`train --resume` / `convert --resume`: continue the run (a conversion continues as a
    training run), on one process or under torchrun (`parallel`)."""
    check_resume_options(args, RESUME_OPTIONS)
    result = resume_run(Path(args.out), checkpoint=resume_from(args), steps=args.steps, device=device,
                        parallel=parallel, fsdp=bool(getattr(args, "fsdp", False)),
                        compile=bool(getattr(args, "compile", False)),
                        activation_checkpointing=bool(getattr(args, "activation_checkpointing", False)),
                        max_tokens=getattr(args, "max_tokens", None), time_budget=getattr(args, "time_budget", None),
                        cache_dir=args.cache_dir, progress=not args.no_progress, command=args.command)
    if result is not None and result.model_dir is not None:
        print(f"model: {result.model_dir}")
    return 0


def run(args: argparse.Namespace) -> int:
    parallel, device, _ = start_processes(args)
    if args.resume:
        return resume(args, device, parallel)
    named = given(args)
    if args.init and named & {"preset", "config", "attention"}:
        raise ValueError("--init takes the model (and its architecture) from its folder: --preset, --config and "
                         "--attention do not apply")
    if args.tokenizer and "vocab_size" in named:
        raise ValueError("--tokenizer gives the vocabulary: --vocab-size does not apply")
    data = data_options(args, args.context if args.context is not None else DEFAULT_CONTEXT)
    cfg, say_notes = deferred_notes(args)
    train_run(Path(args.out), train=cfg, data=data, preset=args.preset, config=args.config,
              attention=args.attention, init=args.init, tokenizer=args.tokenizer, device=device, parallel=parallel,
              fsdp=args.fsdp, activation_checkpointing=args.activation_checkpointing, cache_dir=args.cache_dir,
              progress=not args.no_progress, ready=say_notes)
    return 0
