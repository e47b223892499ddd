"""The `msakit` command line: one sub-command per job.

Each sub-command lives in the module that owns its work and registers itself here through a
small `add_parser(subparsers)` function; `main` only dispatches.  Errors a user can cause (a
missing file, a bad config) are raised as `CLIError` (or `ValueError`/`FileNotFoundError`) and
printed as one line with exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence


class CLIError(Exception):
    """An error caused by the user's input: printed as one line, exit status 2."""


# (module path, function) pairs; imported lazily so `msakit cost` does not import torch models.
_COMMANDS: list[str] = [
    "msakit.commands.demo",
    "msakit.commands.train",
    "msakit.commands.convert",
    "msakit.commands.generate",
    "msakit.commands.train_drafter",
    "msakit.cost",
]


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(prog="msakit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for mod in _COMMANDS:
        importlib.import_module(mod).add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int | None] = args.func
    try:
        return int(func(args) or 0)
    except (CLIError, ValueError, FileNotFoundError, PermissionError, IsADirectoryError) as e:
        print(f"msakit {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"msakit {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
