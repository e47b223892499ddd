"""The shape of the command line: every command module has the one convention (`add_parser`,
`run`), and the arrows point one way (the library never imports the commands; training never
imports speculative decoding)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from msakit.cli import COMMANDS, build_parser

REPO = Path(__file__).resolve().parents[2]


def test_every_command_module_has_add_parser_and_run():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert len(sub.choices) == len(COMMANDS)
    for mod in COMMANDS:
        assert callable(mod.add_parser) and callable(mod.run), mod.__name__
    files = {p.stem for p in (REPO / "msakit" / "commands").glob("*.py")} - {"__init__", "options"}
    assert files == {m.__name__.rsplit(".", 1)[1] for m in COMMANDS}  # one module per command


def test_the_library_imports_no_command_and_training_no_speculative_decoding():
    code = ("import sys, msakit.train.runs, msakit.train.folders, msakit.train.demo; "
            "bad = [m for m in sys.modules if m.startswith(('msakit.speculative', 'msakit.commands', 'msakit.cli'))]; "
            "assert not bad, bad; "
            "import msakit.speculative.runs, msakit.speculative.textgen, msakit.eval.loading, msakit.cost; "
            "bad = [m for m in sys.modules if m.startswith(('msakit.commands', 'msakit.cli'))]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
