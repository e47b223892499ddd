"""`msakit train-drafter`: train a DSpark drafter (speculative decoding) for a trained target

Train a DSpark drafter against a frozen target: the target's tap-layer states are captured on the fly (no disk
cache), several anchored blocks per row, loss 0.1 CE + 0.9 TV + 1.0 BCE (confidence) with position weights
exp(-k/4). Logs metrics.jsonl, writes atomic checkpoints under OUT/checkpoints (each a drafter folder:
config.json + model.safetensors).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from msakit.commands import command_parser
from msakit.commands.options import (NONNEG_INT, POS_FLOAT, POS_INT, SEED, Number, add_data_args, add_device_arg,
                                     add_resume_arg, check_resume_options, data_options, given, resume_from)
from msakit.speculative.runs import RegenPool, resume_drafter_run, train_drafter_run
from msakit.speculative.train import DrafterTrainConfig
from msakit.train.trainer import resolve_device

DEFAULT_STEPS = 1000
RESUME_OPTIONS = frozenset({"out", "resume", "steps", "time_budget", "tokenizer", "device", "no_progress", "cache_dir"})


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = command_parser(subparsers, __doc__)
    p.add_argument("target", metavar="TARGET", nargs="?", default=None,
                   help="the target: run folder (latest checkpoint), checkpoint or model folder (with --resume: "
                        "the run's recorded target; may be omitted)")
    p.add_argument("--out", default="runs/drafter", metavar="DIR", help="run folder (default runs/drafter)")
    add_resume_arg(p, "continue the drafter run in --out (or from CKPT) with its recorded settings; only --steps "
                      "(to train further), --time-budget, --tokenizer, --device, --cache-dir and --no-progress may be "
                      "given with it")
    d = p.add_argument_group("drafter")
    d.add_argument("--size", choices=("tiny", "small", "full"), default="small",
                   help="draft layers: tiny 1, small 2, full 5 (the released M3.1 drafter's depth)")
    d.add_argument("--config", metavar="PATH", help="a DSpark config.json instead of a size preset")
    d.add_argument("--layers", type=POS_INT, default=None, metavar="N", help="number of draft layers (default: --size)")
    d.add_argument("--block-size", type=POS_INT, default=None, metavar="G", help="drafts per block (default 7)")
    d.add_argument("--markov-rank", type=NONNEG_INT, default=None, metavar="R",
                   help="Markov head rank (0 = no Markov head; default: the size preset's)")
    d.add_argument("--no-markov", action="store_true", help="no Markov head (the paper's ablation)")
    d.add_argument("--no-confidence", action="store_true", help="no confidence head")
    d.add_argument("--taps", default=None, metavar="L1,L2,...", help="target layers to tap (default: spread)")
    d.add_argument("--noise-token-id", type=NONNEG_INT, default=None, metavar="ID", help="mask token id (default vocab-1)")
    add_data_args(p, vocab=False)
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=POS_INT, default=None, metavar="N", help=f"optimizer steps (default {DEFAULT_STEPS})")
    t.add_argument("--time-budget", type=POS_FLOAT, default=None, metavar="SECONDS",
                   help="fit the number of steps (and the LR schedule) into this many seconds of training, from "
                        "the pace of steps 10-50; loading the target and preparing the data come on top")
    t.add_argument("--batch-size", type=POS_INT, default=8, metavar="N", help="rows per step")
    t.add_argument("--anchors", type=POS_INT, default=64, metavar="N", help="anchored blocks per row")
    t.add_argument("--lr", type=POS_FLOAT, default=6e-4, help="peak learning rate (AdamW)")
    t.add_argument("--warmup-frac", type=Number(float, 0, 1, hi_open=True), default=0.04, metavar="F",
                   help="share of the steps spent in the linear lr warm-up")
    t.add_argument("--grad-clip", type=Number(float, 0), default=1.0, help="gradient-norm clip (0 = no clipping)")
    t.add_argument("--weight-decay", type=Number(float, 0), default=0.0, help="AdamW weight decay")
    t.add_argument("--regenerate", action="store_true",
                   help="train on text the target writes itself (prefix kept; T 0.7, top-p 0.8, top-k 20)")
    t.add_argument("--regen-prompt-tokens", type=POS_INT, default=32, metavar="N",
                   help="prompt tokens kept from each corpus row when the target rewrites it")
    t.add_argument("--regen-pool", type=NONNEG_INT, default=0, metavar="ROWS",
                   help="before training, let the target write ROWS rows once (half T 0.7 / top-p 0.8 / top-k 20, "
                        "half greedy) and mix them into the corpus (saved as OUT/regen_pool.npz)")
    t.add_argument("--regen-share", type=Number(float, 0, 1, lo_open=True, hi_open=True), default=0.5, metavar="F",
                   help="share of rows from the pool")
    t.add_argument("--log-every", type=POS_INT, default=10, metavar="N", help="steps per metrics.jsonl record")
    t.add_argument("--eval-every", type=POS_INT, default=200, metavar="N", help="steps per evaluation")
    t.add_argument("--eval-rows", type=NONNEG_INT, default=16, metavar="N",
                   help="validation rows per evaluation (0 = no evaluation)")
    t.add_argument("--save-every", type=POS_INT, default=500, metavar="N", help="steps per checkpoint")
    t.add_argument("--keep", type=NONNEG_INT, default=2, metavar="N", help="checkpoints kept (0 = keep all)")
    t.add_argument("--seed", type=SEED, default=0, help="seed of the initialisation and the data order")
    add_device_arg(t)
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The DSparkConfig fields the options set."""
    over: dict[str, Any] = {}
    if args.layers is not None:
        over["num_hidden_layers"] = args.layers
    if args.block_size is not None:
        over["draft_block_size"] = args.block_size
    if args.markov_rank is not None:
        over["markov_rank"] = args.markov_rank
    if args.no_markov:
        over["markov_rank"] = 0
    if args.no_confidence:
        over["enable_confidence_head"] = False
    if args.taps is not None:  # given: used or refused, never replaced by the default
        try:
            over["target_layer_ids"] = [int(x) for x in args.taps.split(",")]
        except ValueError:
            raise ValueError(f"--taps must be comma-separated layer indices (e.g. 1,3), got {args.taps!r}") from None
    if args.noise_token_id is not None:
        over["noise_token_id"] = args.noise_token_id
    return over


def run(args: argparse.Namespace) -> int:
    t0 = time.time()
    out = Path(args.out)
    device = resolve_device(args.device)
    if args.resume:
        check_resume_options(args, RESUME_OPTIONS)
        result = resume_drafter_run(out, target=args.target, checkpoint=resume_from(args), steps=args.steps,
                                    tokenizer=args.tokenizer, device=device, cache_dir=args.cache_dir,
                                    progress=not args.no_progress, time_budget=args.time_budget)
        if result is None:
            return 0
    else:
        if args.target is None:
            raise ValueError("the target (TARGET: run folder, checkpoint or model folder) is required, "
                             "except with --resume")
        named = given(args)
        if "regen_share" in named and not args.regen_pool:
            raise ValueError("--regen-share applies to a --regen-pool only")
        if "regen_prompt_tokens" in named and not (args.regenerate or args.regen_pool):
            raise ValueError("--regen-prompt-tokens applies with --regenerate or --regen-pool only")
        cfg = DrafterTrainConfig(
            steps=args.steps if args.steps is not None else DEFAULT_STEPS, batch_size=args.batch_size,
            anchors=args.anchors, lr=args.lr, warmup_frac=args.warmup_frac, weight_decay=args.weight_decay,
            grad_clip=args.grad_clip, regenerate=args.regenerate, regen_prompt_tokens=args.regen_prompt_tokens,
            log_every=args.log_every, eval_every=args.eval_every, eval_rows=args.eval_rows,
            save_every=args.save_every, keep_checkpoints=args.keep, seed=args.seed)
        pool = RegenPool(args.regen_pool, args.regen_share, args.regen_prompt_tokens) if args.regen_pool else None
        result = train_drafter_run(out, args.target, train=cfg, data=data_options(args, args.context),
                                   size=args.size, config=args.config, overrides=_overrides(args),
                                   tokenizer=args.tokenizer, regen_pool=pool, device=device, cache_dir=args.cache_dir,
                                   progress=not args.no_progress, time_budget=args.time_budget)
    trainer = result.trainer
    ev = trainer.last_eval or {}
    last = trainer.history[-1] if trainer.history else {}
    msg = f"done: step {trainer.step}"
    if "loss" in last:
        msg += f", loss {last['loss']:.4f}"
    if ev:
        msg += f", val loss {ev.get('val_loss', float('nan')):.4f}, implied accepted length (T=1) " \
               f"{ev.get('val_accept_len', float('nan')):.2f}"
    print(msg + f" ({time.time() - t0:.0f}s); checkpoints in {out / 'checkpoints'}")
    print(f"speculative generation: msakit generate {result.target} --drafter {out}")
    return 0
