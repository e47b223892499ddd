"""Tiny shared fixtures of the CLI tests (session-scoped: built once, read-only for the tests;
a test that changes a run works on a copy, `copy_run`)."""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import pytest

from cli_helpers import common
from msakit.cli import main

from toy_model import toy_config

STDLIB = Path(sysconfig.get_paths()["stdlib"])
FILES = ["json/decoder.py", "json/encoder.py", "textwrap.py", "fnmatch.py", "bisect.py", "heapq.py", "glob.py",
         "colorsys.py"]


@pytest.fixture(scope="session")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    data = root / "data"
    data.mkdir()
    for n in FILES:
        (data / n.replace("/", "_")).write_text((STDLIB / n).read_text())
    cfg_dir = root / "toy"
    toy_config(300).save(cfg_dir)
    dense_dir = root / "toy_dense"
    toy_config(300, sparse_attention_freq=[0, 0]).save(dense_dir)
    return {"root": root, "data": str(data), "config": str(cfg_dir), "dense_config": str(dense_dir),
            "cache": str(root / "cache")}


@pytest.fixture(scope="session")
def run_dir(env):
    """A finished 4-step train run (checkpoints at steps 2 and 4)."""
    out = env["root"] / "run"
    rc = main(["train", "--config", env["config"], "--steps", "4", "--warmup-steps", "2", "--save-every", "2",
               *common(env, out)])
    assert rc == 0
    return out


@pytest.fixture(scope="session")
def drafter_run(env, run_dir):
    """A 2-step DSpark drafter run for `run_dir`."""
    out = env["root"] / "drafter"
    rc = main(["train-drafter", str(run_dir), "--out", str(out), "--size", "tiny", "--steps", "2",
               "--batch-size", "2", "--anchors", "4", "--context", "64", "--no-stdlib", "--data", env["data"],
               "--cache-dir", env["cache"], "--eval-every", "2", "--eval-rows", "2", "--no-progress",
               "--device", "cpu", "--val-fraction", "0.15"])
    assert rc == 0
    return out


@pytest.fixture
def copy_run(run_dir, tmp_path):
    """A private copy of `run_dir` (for tests that change it)."""
    dst = tmp_path / "run_copy"
    shutil.copytree(run_dir, dst)
    return dst
