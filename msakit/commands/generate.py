"""`msakit generate`: sample from a checkpoint (streams to stdout); --drafter: speculative decoding

Load a checkpoint (run folder, checkpoint or model folder) and the tokenizer saved beside it, then sample a
continuation of the prompt, streaming it to stdout.  With --drafter (a `msakit train-drafter` run or drafter
folder) the tokens come from DSpark speculative decoding (the same distribution as plain sampling); the accepted
length and the decoding speed, beside plain decoding's (timed over a few tokens of the same prompt), are printed to
stderr, with a warning where speculation costs more than it saves.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from msakit.commands import command_parser
from msakit.commands.options import NONNEG_INT, POS_INT, SEED, Number, add_device_arg
from msakit.speculative.textgen import TextGenerator
from msakit.train.trainer import resolve_device


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = command_parser(subparsers, __doc__)
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="run folder (its latest checkpoint), checkpoint or model folder")
    p.add_argument("--prompt", default=None, help="prompt text (default: start a new document)")
    p.add_argument("--prompt-file", default=None, metavar="PATH", help="read the prompt from a file")
    p.add_argument("--max-new-tokens", type=NONNEG_INT, default=200, metavar="N", help="tokens to sample")
    p.add_argument("--temperature", type=Number(float, 0), default=0.8, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-k", type=POS_INT, default=None, metavar="K", help="sample among the K likeliest (default all)")
    p.add_argument("--top-p", type=Number(float, 0, 1, lo_open=True), default=None, metavar="P",
                   help="nucleus sampling: the smallest set with probability >= P (default off)")
    p.add_argument("--seed", type=SEED, default=0, help="sampling seed")
    p.add_argument("--mode", choices=("sparse", "dense"), default="sparse", help="attention mode")
    p.add_argument("--drafter", default=None, metavar="DIR",
                   help="a DSpark drafter (train-drafter run, checkpoint or drafter folder): speculative decoding")
    p.add_argument("--tokenizer", default=None, metavar="PATH", help="tokenizer.json (default: beside the checkpoint)")
    p.add_argument("--compile", action="store_true",
                   help="run the decode step under torch.compile (msakit models on the paged cache; not with --drafter)")
    add_device_arg(p)
    return p


def run(args: argparse.Namespace) -> int:
    if args.prompt is not None and args.prompt_file is not None:
        raise ValueError("give --prompt or --prompt-file, not both")
    prompt = args.prompt
    if args.prompt_file is not None:
        prompt = Path(args.prompt_file).read_text(encoding="utf-8", errors="replace")
    gen = TextGenerator.from_folders(args.checkpoint, device=resolve_device(args.device), tokenizer=args.tokenizer,
                                     drafter=args.drafter, compile=args.compile)
    stats = gen.stream(prompt or "", sys.stdout, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       top_k=args.top_k, top_p=args.top_p, seed=args.seed, mode=args.mode)
    if stats is not None and stats.row_rounds:
        speed = f", {stats.tokens_per_s:.1f} tokens/s" if stats.tokens_per_s else ""
        if stats.plain_tokens_per_s:
            speed += f" (plain decoding {stats.plain_tokens_per_s:.1f} tokens/s)"
        print(f"speculative decoding: accepted length {stats.accepted_length:.2f} tokens per target forward "
              f"({stats.rounds} rounds, {stats.accepted_drafts} of {stats.verified_drafts} drafts accepted){speed}",
              file=sys.stderr)
        warning = stats.cost_warning()
        if warning:
            print(f"msakit generate: warning: {warning}", file=sys.stderr)
    return 0
