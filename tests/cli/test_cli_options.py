"""Every sub-command refuses every invalid value of every numeric option (and --device) with exit
status 2, exactly one line on stderr and nothing written; values that need the model or the run
are refused the same way before any data preparation (no tokenizer is trained)."""

from __future__ import annotations

import argparse
import json

import pytest

from cli_helpers import common, one_line_error, tree_state
from msakit.cli import build_parser, main

pytestmark = pytest.mark.usefixtures("one_thread")

# options whose type is not a msakit.commands.options.Number / DeviceArg: their invalid values by hand
EXTRA_INVALID = {("cost", "--context"): ["0", "-3", "x", "1.5"]}
# `eval` parses its numbers itself (after argparse, before any work): its invalid values by hand
EVAL_INVALID = {"--samples": ["0", "x"], "--batch-size": ["0", "-1"], "--seed": ["-1", "x"],
                "--init-blocks": ["-1"], "--lengths": ["0", "x"], "--device": ["tpu", "gpu"]}
POSITIONAL = {"convert": "run", "generate": "run", "train-drafter": "run"}  # -> the trained run
NO_NUMBERS = {"export"}  # commands without a numeric option (their refusals: tests/cli/test_cli_export.py)


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    p = build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _cases() -> list[tuple[str, str, str]]:
    cases = [("eval", o, v) for o, vs in EVAL_INVALID.items() for v in vs]
    for cmd, sp in _subparsers().items():
        for a in sp._actions:
            if a.type is None or not a.option_strings or (cmd == "eval" and max(a.option_strings, key=len) in EVAL_INVALID):
                continue
            opt = max(a.option_strings, key=len)
            bad = a.type.invalid_examples() if hasattr(a.type, "invalid_examples") else EXTRA_INVALID.get((cmd, opt))
            assert bad, f"`msakit {cmd} {opt}` has a type without invalid examples: validate it (Number)"
            cases += [(cmd, opt, v) for v in bad]
    return cases


CASES = _cases()


def test_every_command_has_cases():
    cmds = {c for c, _, _ in CASES}
    assert cmds == set(_subparsers()) - NO_NUMBERS, set(_subparsers()) - NO_NUMBERS - cmds
    opts = {(c, o) for c, o, _ in CASES}
    for must in [("train", "--context"), ("train", "--steps"), ("train-drafter", "--steps"), ("convert", "--block-size"),
                 ("convert", "--topk"), ("convert", "--index-dim"), ("generate", "--temperature"), ("demo", "--steps"),
                 ("generate", "--device"), ("cost", "--context")]:
        assert must in opts, must
    assert ("generate", "--temperature", "nan") in CASES and ("train", "--device", "tpu") in CASES
    assert ("train", "--context", "1") in CASES and ("train-drafter", "--steps", "0") in CASES


@pytest.mark.parametrize("cmd,opt,value", CASES, ids=[f"{c}{o}={v}" for c, o, v in CASES])
def test_invalid_numeric_value_exits_2_one_line_nothing_written(cmd, opt, value, run_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("a user's file")
    before, run_before = tree_state(out), tree_state(run_dir)
    argv = [cmd]
    if cmd in POSITIONAL:
        argv.append(str(run_dir))
    if cmd == "cost":
        argv += ["--config", str(run_dir / "checkpoints" / "step-00000004")]
    elif cmd == "eval":
        argv += ["--model", str(run_dir / "checkpoints" / "step-00000004"), "--out", str(out), "--resume"]
    elif cmd != "generate":
        argv += ["--out", str(out)]
    argv += [opt, value]
    err = one_line_error(capsys, main(argv))
    assert opt.lstrip("-") in err and f"msakit {cmd}: error:" in err, err  # names the option
    assert tree_state(out) == before and tree_state(run_dir) == run_before


def _refusals(env, run_dir, drafter_run, tmp_path):
    """(argv, expected text in the error): values refused after parsing, before the data."""
    full = tmp_path / "full"
    full.mkdir()
    (full / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 5.0}\n')  # an old log, no checkpoint
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2,
                                               "num_attention_heads": 4, "num_key_value_heads": 2,
                                               "intermediate_size": 64, "vocab_size": 300}))
    new = str(tmp_path / "new")
    tr = ["train", "--config", env["config"]]
    td = ["train-drafter", str(run_dir), "--out", new, "--size", "tiny", "--no-stdlib", "--data", env["data"],
          "--cache-dir", str(tmp_path / "cache"), "--device", "cpu"]
    cache = ["--cache-dir", str(tmp_path / "cache")]
    return [
        (tr + common(env, new, "--context", "512", *cache), "max_position_embeddings"),
        (tr + common(env, full, *cache), "not empty"),
        (tr + common(env, run_dir, *cache), "--resume"),
        (["train", "--preset", "minimax-m3", "--out", new, "--device", "cpu", *cache], "needs at least"),
        (["train", "--preset", "nope", "--out", new, "--device", "cpu", *cache], "nope"),
        (["train", "--resume", "--out", str(run_dir), "--lr", "0.1", *cache], "--lr"),
        (["train", "--init", str(run_dir), "--preset", "small", "--out", new, *cache], "do not apply"),
        (["train", "--tokenizer", str(run_dir / "tokenizer.json"), "--vocab-size", "999", "--out", new, *cache],
         "--vocab-size"),
        (["train", "--resume", "--out", str(run_dir), "--steps", "3", *cache], "below the checkpoint's step"),
        (tr + ["--out", new, "--no-stdlib", "--device", "cpu", *cache], "empty corpus"),
        (tr + ["--out", new, "--no-stdlib", "--data", str(tmp_path / "missing"), "--device", "cpu", *cache],
         "not found"),
        (td + ["--context", "5000"], "max_position_embeddings"),
        (td + ["--context", "64", "--regen-pool", "4", "--regen-prompt-tokens", "64"], "--regen-prompt-tokens"),
        (td + ["--taps", "1,x"], "--taps"),
        (td + ["--taps", ""], "--taps"),  # given empty: refused, not replaced by the default taps
        (td + ["--taps", "1,,2"], "--taps"),
        (td + ["--regen-share", "0.3"], "--regen-pool only"),
        (["train-drafter", str(drafter_run), "--out", new, "--device", "cpu", *cache], "drafter"),
        (["train-drafter", str(run_dir), "--out", str(full), "--device", "cpu", *cache], "not empty"),
        (["convert", "--out", new, "--device", "cpu", *cache], "SOURCE is required"),
        (["convert", str(run_dir), "--out", str(run_dir), "--device", "cpu", *cache], "--resume"),
        # an MSA model continues with its own index branches (stage 2): new ones cannot be asked for
        (["convert", str(run_dir), "--index-dim", "8", "--out", new, "--device", "cpu", *cache], "already an MSA model"),
        (["generate", str(run_dir), "--max-new-tokens", "1000", "--device", "cpu"], "max_position_embeddings"),
        (["generate", str(hf), "--device", "cpu"], "msakit convert"),
        (["generate", str(drafter_run), "--device", "cpu"], "--drafter"),
        (["generate", str(run_dir), "--drafter", str(run_dir), "--device", "cpu"], "not a DSpark drafter"),
        (["generate", str(run_dir), "--prompt", "a", "--prompt-file", "b", "--device", "cpu"], "not both"),
        (["cost", "--config", str(tmp_path / "missing")], "not found"),
    ]


def test_values_refused_before_the_data(env, run_dir, drafter_run, tmp_path, capsys):
    import torch

    cases = _refusals(env, run_dir, drafter_run, tmp_path)
    if not torch.cuda.is_available():
        cases.append((["train", "--out", str(tmp_path / "new"), "--device", "cuda"], "CUDA is not available"))
    watched = [tmp_path / "full", tmp_path / "new", run_dir, drafter_run, env["root"] / "cache"]
    for argv, expect in cases:
        before = [tree_state(p) for p in watched]
        err = one_line_error(capsys, main(argv))
        assert expect in err, (argv, err)
        assert [tree_state(p) for p in watched] == before, argv
        assert not (tmp_path / "cache").exists(), argv  # no tokenizer trained, no tokens encoded
