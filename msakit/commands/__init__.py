"""CLI sub-commands that live outside the module owning their work (each: `add_parser(subparsers)`)."""

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
