"""`msakit generate`: sample text from a trained checkpoint, streamed to stdout."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "generate", help="sample from a checkpoint (streams to stdout)",
        description="Load a checkpoint (run folder, checkpoint folder or model folder) and the tokenizer saved "
                    "beside it, then sample a continuation of the prompt, streaming it to stdout.")
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="run folder (its latest checkpoint), checkpoint or model folder")
    p.add_argument("--prompt", default=None, help="prompt text (default: start a new document)")
    p.add_argument("--prompt-file", default=None, metavar="PATH", help="read the prompt from a file")
    p.add_argument("--max-new-tokens", type=int, default=200, metavar="N")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None, metavar="K")
    p.add_argument("--top-p", type=float, default=None, metavar="P")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode", choices=("sparse", "dense"), default="sparse", help="attention mode (default sparse)")
    p.add_argument("--tokenizer", default=None, metavar="PATH", help="tokenizer.json (default: beside the checkpoint)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.set_defaults(func=_run)
    return p


def _run(args: argparse.Namespace) -> int:
    from msakit.train.run import run_generate

    return run_generate(args)
