"""The `msakit` sub-commands, one module each, all of one shape:

- ``add_parser(subparsers) -> argparse.ArgumentParser`` registers the command (`command_parser`
  names it from the module docstring) and its options (shared types and groups:
  `msakit.commands.options`);
- ``run(args) -> int`` checks what is about the command line (combinations of options), turns the
  options into the library's settings, calls the public library functions that do the work, and
  prints what the user reads; it returns the exit status.

`msakit.cli` registers every module and dispatches; it alone prints errors.  The library never
imports this package.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["command_parser"]


def command_parser(subparsers: Any, doc: str | None) -> argparse.ArgumentParser:
    """Adds a sub-command's parser from its module docstring: the first paragraph, "`msakit NAME`:
    HELP", names the command and gives its line in `msakit -h`; the paragraphs after it are the
    description of `msakit NAME -h`."""
    head, _, body = (doc or "").strip().partition("\n\n")
    cmd, sep, summary = " ".join(head.split()).partition(": ")
    if not (sep and cmd.startswith("`msakit ") and cmd.endswith("`")):
        raise ValueError(f"doc must start with '`msakit NAME`: HELP', got {head[:60]!r}")
    name = cmd[len("`msakit "):-1]
    return subparsers.add_parser(name, help=summary, description=" ".join(body.split()) or summary)
