"""Honest logs and warnings: a run whose "sparse" attention is dense says so once; the logs the
commands write are strict JSON; speculative decoding reports its accepted length and speed beside
plain decoding's, and warns where speculation costs more than it saves."""

from __future__ import annotations

import json

import pytest

from cli_helpers import common
from msakit.cli import main
from msakit.ops.index_topk import Selection
from msakit.speculative.generate import MIN_ACCEPTED_LENGTH, SpecStats

pytestmark = pytest.mark.usefixtures("one_thread")


def _strict_lines(path):
    def strict(token):  # a strict parser refuses NaN / Infinity literals
        raise ValueError(f"non-standard JSON constant {token}")

    return [json.loads(line, parse_constant=strict) for line in path.read_text().splitlines()]


def test_selection_covers_the_context_exactly_when_topk_blocks_span_it():
    sel = Selection(32, 4)
    assert sel.covers(128) and sel.covers(100) and not sel.covers(129)


@pytest.mark.parametrize("context,dense", [(16, True), (64, False)])
def test_train_says_once_when_its_sparse_attention_is_dense(env, tmp_path, capsys, context, dense):
    # the toy config selects top-2 blocks of 8 = 16 tokens: a 16-token context is covered, 64 is not
    out = tmp_path / "r"
    argv = ["train", "--config", env["config"], "--steps", "2", "--warmup-steps", "1", "--save-every", "2",
            *common(env, out)]
    argv[argv.index("--context") + 1] = str(context)
    assert main(argv) == 0
    said = capsys.readouterr().out
    assert said.count("covers the whole context") == (1 if dense else 0), said
    if dense:
        assert "top-2 blocks of 8 = 16 tokens" in said and "the same as dense" in said
    _strict_lines(out / "metrics.jsonl")


def test_a_run_without_sparse_steps_says_nothing_about_its_selection(env, tmp_path, capsys):
    argv = ["train", "--config", env["config"], "--steps", "2", "--warmup-steps", "2", *common(env, tmp_path / "r")]
    argv[argv.index("--context") + 1] = "16"
    assert main(argv) == 0
    assert "covers the whole context" not in capsys.readouterr().out


def test_cost_warning_of_speculative_decoding():
    nothing = SpecStats(rounds=10, row_rounds=10, tokens=10, accepted_drafts=0, verified_drafts=70)
    assert nothing.accepted_length < MIN_ACCEPTED_LENGTH
    w = nothing.cost_warning()
    assert w and "never accepted" in w and "0 of 70" in w and "without --drafter" in w
    good = SpecStats(rounds=10, row_rounds=10, tokens=40, accepted_drafts=30, verified_drafts=70,
                     tokens_per_s=50.0, plain_tokens_per_s=20.0)
    assert good.cost_warning() is None
    slow = SpecStats(rounds=10, row_rounds=10, tokens=30, accepted_drafts=20, verified_drafts=70,
                     tokens_per_s=4.0, plain_tokens_per_s=20.0)
    w = slow.cost_warning()
    assert w and "4.0 tokens/s" in w and "20.0 tokens/s" in w and "0.20x" in w and "never accepted" not in w
    assert SpecStats().cost_warning() is None  # nothing decoded, nothing to say
    json.dumps(SpecStats().as_dict(), allow_nan=True)


def test_generate_with_drafter_reports_speeds_and_warns_when_it_does_not_pay(run_dir, drafter_run, capsys):
    argv = ["generate", str(run_dir), "--prompt", "def f(x):", "--max-new-tokens", "12", "--temperature", "0",
            "--device", "cpu", "--drafter", str(drafter_run)]
    assert main(argv) == 0
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if x.startswith("speculative decoding: accepted length"))
    assert "tokens/s (plain decoding " in line
    al = float(line.split("accepted length")[1].split()[0])
    spec = float(line.split("), ")[-1].split(" tokens/s")[0])
    plain = float(line.split("plain decoding ")[1].split(" tokens/s")[0])
    warned = "msakit generate: warning: speculation costs more than it saves" in err
    if al < MIN_ACCEPTED_LENGTH or spec != plain:  # (speeds equal to the printed digit: either way)
        assert warned == (al < MIN_ACCEPTED_LENGTH or spec < plain), err
