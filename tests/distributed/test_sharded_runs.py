"""A run under `torchrun ... msakit train --fsdp` is a run like others (gloo on CPU, two processes
spawned from pytest, timeouts on every launch; the one-process commands after it run in pytest's
process): its summary names the sharded checkpoint, it
resumes from the command line on the same number of processes and on one (DCP reshards), its
newest checkpoint exports to the single-file layout (`msakit export`), and `msakit generate`
reads both the run folder and the export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import torch

from msakit.cli import main
from msakit.models import M3ForCausalLM
from msakit.train.checkpoint import find_checkpoint

STDLIB = Path(sysconfig.get_paths()["stdlib"])
TIMEOUT = 420


def _msakit(tmp_path: Path, *args: str, nproc: int = 0) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launch = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "-m", "msakit"]
              if nproc else [sys.executable, "-m", "msakit"])
    return subprocess.run([*launch, *args], capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd=tmp_path)


def _in_process(capsys, *args: str) -> SimpleNamespace:
    """`msakit ARGS` run by `msakit.cli.main` in this process (a one-process command needs no fresh
    interpreter: it saves the ~2 s import of torch and msakit per command), shaped like `_msakit`'s result."""
    capsys.readouterr()
    rc = main(list(args))
    out, err = capsys.readouterr()
    return SimpleNamespace(returncode=rc, stdout=out, stderr=err)


def _train_args(tmp_path: Path) -> list[str]:
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    for n in ("textwrap.py", "fnmatch.py", "bisect.py", "heapq.py"):
        (data / n).write_text((STDLIB / n).read_text())
    return ["--data", str(data), "--no-stdlib", "--vocab-size", "300", "--context", "64", "--preset", "tiny",
            "--batch-size", "2", "--eval-every", "100", "--eval-rows", "2", "--save-every", "2", "--log-every", "1",
            "--no-progress", "--device", "cpu", "--cache-dir", str(tmp_path / "cache")]


def _steps(run: Path) -> list[int]:
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in recs if r["kind"] == "train"]


def test_sharded_run_resumes_exports_and_generates(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    r = _msakit(tmp_path, "train", *_train_args(tmp_path), "--steps", "2", "--fsdp", "--out", str(run), nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    ck2 = run / "sharded" / "step-00000002"
    assert f"checkpoint {ck2}" in r.stdout, r.stdout  # not "checkpoint None"
    assert find_checkpoint(run) == ck2

    # the same number of processes
    r = _msakit(tmp_path, "train", "--resume", "--out", str(run), "--steps", "4", "--fsdp", "--no-progress",
                "--device", "cpu", "--cache-dir", str(tmp_path / "cache"), nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("resumed") == 1 and "at step 2" in r.stdout, r.stdout
    assert find_checkpoint(run) == run / "sharded" / "step-00000004"
    assert _steps(run) == [1, 2, 3, 4]

    # one process: DCP reshards the checkpoint; the run goes on in the single-file layout
    r = _in_process(capsys, "train", "--resume", "--out", str(run), "--steps", "6", "--no-progress", "--device", "cpu",
                    "--cache-dir", str(tmp_path / "cache"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "at step 4" in r.stdout, r.stdout
    assert find_checkpoint(run) == run / "checkpoints" / "step-00000006"
    assert _steps(run) == [1, 2, 3, 4, 5, 6]

    # export the sharded step-4 checkpoint; the weights equal those the DCP shards hold
    out = tmp_path / "export"
    r = _in_process(capsys, "export", str(run / "sharded" / "step-00000004"), "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    a = M3ForCausalLM.from_pretrained(out)
    b = M3ForCausalLM.from_pretrained(run / "sharded" / "step-00000004")  # the loader reads DCP directly
    for (n, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), n

    for src in (out, run / "sharded" / "step-00000004"):
        r = _in_process(capsys, "generate", str(src), "--prompt", "def f(", "--max-new-tokens", "4", "--temperature",
                        "0", "--device", "cpu")
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stdout.startswith("def f("), r.stdout
