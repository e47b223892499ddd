"""The `msakit` command line: one sub-command per job.

Each sub-command is a module of `msakit.commands` with `add_parser(subparsers)` and `run(args)`;
`main` parses, dispatches and is the one place that prints errors.  Errors a user can cause (a bad
option value, a missing file, a bad config, a model that cannot fit) are raised as `CLIError` (or
`ValueError` / `OSError`) or refused by argparse, and printed as one line with exit status 2; no
traceback.  SIGTERM is turned into an interruption (like Ctrl-C), so that a command's clean-up
(temporary folders, partial checkpoints) runs before it exits with status 143.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from typing import Iterator, Sequence

from msakit.commands import convert, cost, demo, export, generate, train, train_drafter
from msakit.commands import eval as eval_


class CLIError(Exception):
    """An error caused by the user's input: printed as one line, exit status 2."""


class Terminated(KeyboardInterrupt):
    """SIGTERM received: unwinds like Ctrl-C (clean-up handlers run), exit status 143."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none (None / False) or the help
    already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_ = action.help or ""
        d = action.default
        if d is None or d is False or d == argparse.SUPPRESS or "default" in help_ or not action.option_strings:
            return help_
        return help_ + " (default: %(default)s)"


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors (``msakit CMD: error: ...``, exit status 2), no option
    abbreviations (an abbreviation could silently pick another option) and the defaults shown in
    --help."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {one_line(message)}\n")


def one_line(text: object) -> str:
    """`text` on one line (an exception's message may span several)."""
    return "; ".join(x.strip() for x in str(text).splitlines() if x.strip())


# the sub-commands, in the order `msakit -h` lists them
COMMANDS = (demo, train, convert, export, generate, eval_, train_drafter, cost)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="msakit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for mod in COMMANDS:
        mod.add_parser(sub).set_defaults(run=mod.run)
    return parser


def given_options(parser: argparse.ArgumentParser, command: str, argv: Sequence[str]) -> set[str]:
    """The dests of the options of sub-command `command` that appear in `argv` (abbreviations are
    off, so the option strings are exact)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    p = sub.choices[command]
    names = {s: a.dest for a in p._actions for s in a.option_strings}  # noqa: SLF001
    return {names[t.split("=", 1)[0]] for t in argv if t.startswith("--") and t.split("=", 1)[0] in names}


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While inside, SIGTERM raises `Terminated` in the main thread (no-op elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated()

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or an argument error (already printed on one line)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    args.given = given_options(parser, args.command, argv)
    try:
        with sigterm_as_interrupt():
            return int(args.run(args) or 0)
    except (CLIError, ValueError, OSError, MemoryError) as e:
        msg = one_line(e) or type(e).__name__
        print(f"msakit {args.command}: error: {msg}", file=sys.stderr)
        return 2
    except Terminated:
        print(f"msakit {args.command}: terminated", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print(f"msakit {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
