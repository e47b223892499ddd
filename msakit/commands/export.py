"""`msakit export`: write a run's model (its newest checkpoint, single-file or sharded) as a model folder

SOURCE: a run folder (its newest checkpoint: the single-file layout of a run on one process, or the sharded DCP
checkpoint a run under torchrun writes), a checkpoint or a model folder.  --out (new or empty) receives
config.json, the safetensors weights and tokenizer.json: what `msakit generate`, `msakit eval --model`,
`train --init` and `convert` take.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from msakit.commands import command_parser
from msakit.train.export import export_model
from msakit.train.runs import DTYPES


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = command_parser(subparsers, __doc__)
    p.add_argument("source", metavar="SOURCE", help="run folder (its newest checkpoint), checkpoint or model folder")
    p.add_argument("--out", required=True, metavar="DIR", help="the model folder to write (new or empty)")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="dtype of the written weights (default: as stored)")
    return p


def run(args: argparse.Namespace) -> int:
    out = export_model(args.source, args.out, dtype=getattr(torch, args.dtype) if args.dtype else None)
    print(f"model: {out} (msakit generate {out}; msakit eval --model {out})")
    return 0
