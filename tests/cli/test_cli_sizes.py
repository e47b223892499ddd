"""Values that need the model (or the device) to judge are judged before any work: eval's lengths
against the model's positions, its budget against the model's block size, lengths too short for a
retrieval task, absurd --samples / --batch-size against memory; convert's --block-size / --topk
against the model's positions; train's --batch-size against memory.  One stderr line, exit 2,
nothing written, every file outside --out unchanged."""

from __future__ import annotations

import pytest

from cli_helpers import common, one_line_error, tree_state
from msakit.cli import main
from msakit.cost import ModelShape, activation_bytes
from msakit.models.sizes import check_batch_fits, check_memory, check_selection_fits

from toy_model import toy_config

pytestmark = pytest.mark.usefixtures("one_thread")


def _refused(capsys, argv, watched, out, *words):
    before = tree_state(watched)
    err = one_line_error(capsys, main(argv))
    for w in words:
        assert w in err, err
    assert tree_state(watched) == before
    assert not out.exists()
    return err


# the toy model: 256 positions, blocks of 8, top-2
EVAL_CASES = {
    "beyond-positions": (["--tasks", "loss", "--lengths", "2048"], ["--lengths 2,048", "256 positions"]),
    "too-short-niah": (["--tasks", "loss,niah", "--lengths", "64"], ["--lengths 64", "niah"]),
    "too-short-vt": (["--tasks", "vt", "--lengths", "100"], ["--lengths 100", "vt"]),
    "budget-block": (["--tasks", "loss", "--lengths", "128", "--policies", "dense,msa", "--budget", "block64-top8"],
                     ["--budget block64-top8", "blocks of 8"]),
    "samples": (["--tasks", "passkey", "--lengths", "256", "--samples", "1000000000"], ["--samples 1,000,000,000"]),
    "batch": (["--tasks", "passkey", "--lengths", "256", "--samples", "1000000000", "--batch-size", "1000000000"],
              ["--batch-size 1,000,000,000"]),
}


@pytest.mark.parametrize("case", list(EVAL_CASES))
def test_eval_judges_sizes_before_work(run_dir, env, tmp_path, capsys, case):
    extra, words = EVAL_CASES[case]
    out = tmp_path / "eval"
    _refused(capsys, ["eval", "--model", str(run_dir / "checkpoints" / "step-00000004"), *extra, "--out", str(out),
                      "--device", "cpu", "--no-progress", "--docs", env["data"]], run_dir, out, *words)


@pytest.mark.parametrize("opt,value,word", [("--block-size", "1000000000", "256 positions"),
                                            ("--topk", "1000000", "32 blocks of 8")])
def test_convert_judges_the_selection_against_the_model(run_dir, env, tmp_path, capsys, opt, value, word):
    out = tmp_path / "conv"
    args = [a for a in common(env, out) if a not in ("--vocab-size", "300")]  # convert takes the model's vocabulary
    _refused(capsys, ["convert", str(run_dir), opt, value, "--steps", "1", *args],
             run_dir, out, f"{opt} {int(value):,}", word)


def test_train_judges_the_batch_against_memory(env, tmp_path, capsys):
    out = tmp_path / "train"
    args = common(env, out)
    args[args.index("--batch-size") + 1] = "1000000000"
    _refused(capsys, ["train", "--config", env["config"], "--steps", "1", *args], env["root"] / "data", out,
             "--batch-size 1,000,000,000", "on cpu")


def test_activation_bound_and_memory_checks():
    shape = ModelShape.from_config(toy_config(300).to_dict())
    # logits [T, V] float32 + 2 hidden states; a training step doubles the logits and keeps each layer's input
    assert activation_bytes(shape, 10) == 10 * 300 * 4 + 2 * 10 * 32 * 4
    assert activation_bytes(shape, 10, backward=True) == 2 * 10 * 300 * 4 + (2 + 2) * 10 * 32 * 4
    check_memory(100, "cpu", "x", available=lambda d: 100)
    with pytest.raises(ValueError, match="x needs at least"):
        check_memory(101, "cpu", "x", available=lambda d: 100)
    check_batch_fits(toy_config(300), 2, 64, "cpu", backward=True, available=lambda d: 10**9)
    with pytest.raises(ValueError, match="--batch-size 2 "):
        check_batch_fits(toy_config(300), 2, 64, "cpu", backward=True, available=lambda d: 1000)
    check_selection_fits(8, 32, 256)
    check_selection_fits(10**9, 10**9, None)  # no positions known: nothing to judge
    with pytest.raises(ValueError, match="--topk 33"):
        check_selection_fits(8, 33, 256)
    with pytest.raises(ValueError, match="--block-size 257"):
        check_selection_fits(257, 1, 256)
