"""README's worked examples, run as written: every command line of the ```sh blocks of its "Worked
examples" section runs, in order, in one folder (the blocks hand runs to each other: runs/tiny,
runs/dense, runs/conv, ...).  To fit the test suite's time the test shrinks what README says may be
raised, the same way for every line: run lengths (`--steps`, `--warmup-steps`, `--max-tokens`) are divided by 100,
and the commands that read a corpus or build a model get a toy model (`--config`: 2 layers of 32,
blocks of 8, 1,024 positions like the tiny preset), a small corpus (`--no-stdlib --data`) and
short rows (`--context 64`); `eval` reads one sample of a small document (`--samples 1 --docs`).
These options are appended, so an option README gives is replaced only where it is one of them.
Lines that need several GPUs (`torchrun`, and `export` of the run that writes) or a downloaded
model (`path/to/Qwen...`) are not run; the test lists them, so a new example cannot go unrun
silently."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from pathlib import Path

import pytest

from msakit.cli import main

from conftest import FILES, STDLIB
from toy_model import toy_config

pytestmark = pytest.mark.usefixtures("one_thread")

README = Path(__file__).resolve().parents[2] / "README.md"
SECTION = "## Worked examples"

NOT_RUN = {  # line prefix -> why the test does not run it
    "torchrun ": "needs several GPUs (tests/distributed runs the same code with gloo)",
    "msakit export runs/train ": "exports the torchrun run above",
    "msakit convert path/to/Qwen2.5-Coder-0.5B ": "needs the downloaded Qwen2.5-Coder-0.5B",
}
SCALED = ("--steps", "--warmup-steps", "--max-tokens")  # divided by 100 (at least 1)

# Llama-3-8B's config.json (its published sizes): what `msakit cost --config path/to/Llama-3-8B` reads
LLAMA_3_8B = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                  max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  torch_dtype="bfloat16")


def example_lines(text: str) -> list[str]:
    """The command lines of the ```sh blocks of README's worked examples (continuations joined,
    comments dropped)."""
    body = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    lines = []
    for block in re.findall(r"```sh\n(.*?)```", body, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                lines.append(shlex.join(words))
    return lines


def _scaled(words: list[str]) -> list[str]:
    out = list(words)
    for i, w in enumerate(out[:-1]):
        if w in SCALED:
            out[i + 1] = str(max(1, int(out[i + 1]) // 100))
    return out


def _small_args(words: list[str], toy: str, data: str, docs: str) -> list[str]:
    """The options the test appends to one command (see the module's docstring)."""
    command, resume = words[1], "--resume" in words
    corpus = [] if "--data" in words else ["--no-stdlib", "--data", data]
    rows = ["--context", "64", "--batch-size", "2", "--eval-rows", "2", *corpus]
    if resume:
        return []
    if command == "train":
        return ["--config", toy, "--vocab-size", "300", *rows]
    if command == "convert":
        return rows
    if command == "train-drafter":
        return [*rows, "--anchors", "4"]
    if command == "eval":
        return ["--samples", "1", "--docs", docs]
    return []


def test_readme_examples_run_as_written(tmp_path, monkeypatch, capsys):
    lines = example_lines(README.read_text(encoding="utf-8"))
    skipped = {p for line in lines for p in NOT_RUN if line.startswith(p)}
    assert skipped == set(NOT_RUN), f"README's examples changed: update NOT_RUN ({skipped} of {set(NOT_RUN)})"
    home, work = tmp_path / "home", tmp_path / "work"
    project = home / "src" / "myproject"  # the user's own corpus of `--data ~/src/myproject`
    data, docs = tmp_path / "data", tmp_path / "docs"
    for d in (project, data, docs, work / "path" / "to" / "Llama-3-8B"):
        d.mkdir(parents=True)
    for n in FILES:
        text = (STDLIB / n).read_text()
        (data / n.replace("/", "_")).write_text(text)
        (project / n.replace("/", "_")).write_text(text)
    (docs / "textwrap.py").write_text((STDLIB / "textwrap.py").read_text())
    (work / "path" / "to" / "Llama-3-8B" / "config.json").write_text(json.dumps(LLAMA_3_8B))
    (work / "msakit").symlink_to(README.parent / "msakit")  # `--config msakit/models/configs/...`
    toy = tmp_path / "toy"
    toy_config(300, max_position_embeddings=1024).save(toy)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("MSAKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(work)
    ran = []
    for line in lines:
        if any(line.startswith(p) for p in NOT_RUN):
            continue
        words = [os.path.expanduser(w) for w in shlex.split(line)]
        assert words[0] == "msakit", line
        argv = [*_scaled(words), *_small_args(words, str(toy), str(data), str(docs))][1:]
        rc = main(argv)
        out, err = capsys.readouterr()
        assert rc == 0, f"{line}\n(run as: msakit {shlex.join(argv)})\n{err[-3000:]}"
        ran.append(words[1])
    assert {"train", "convert", "generate", "train-drafter", "cost", "eval"} <= set(ran)
    assert (work / "runs" / "eval" / "summary.json").is_file()
    shutil.rmtree(work / "runs")
