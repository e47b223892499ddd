"""`msakit cost`: parameter, FLOP, decode-read, KV-cache and expert-byte costs from a config

Cost model (MSA paper eq. 12, M3.1-Flash brief) from an HF config.json.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from msakit.commands import command_parser
from msakit.cost import DEFAULT_CONTEXT, ModelShape, format_report, report


def _positive_int(text: str) -> int:
    try:
        v = int(text.replace(",", "").replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return v


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = command_parser(subparsers, __doc__)
    p.add_argument("--config", required=True, metavar="PATH",
                   help="config.json or a folder containing it")
    p.add_argument("--context", type=_positive_int, default=DEFAULT_CONTEXT, metavar="N",
                   help=f"context length in tokens (default {DEFAULT_CONTEXT:,})")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def run(args: argparse.Namespace) -> int:
    r = report(ModelShape.from_config(args.config), args.context)
    print(json.dumps(r, indent=2) if args.json else format_report(r))
    return 0
