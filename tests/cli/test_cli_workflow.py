"""The workflow around the runs: speculative generation from the CLI, resuming finished or
converted runs, fresh runs that fail leave nothing behind, pruning after a resume from an older
checkpoint, warm-ups scaled to short runs, size checks, help texts, `cost` on a dense HF config."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from cli_helpers import common, one_line_error, tree_state
from msakit.cli import build_parser, main

pytestmark = pytest.mark.usefixtures("one_thread")


def test_generate_with_drafter_is_lossless_and_prints_accepted_length(run_dir, drafter_run, capsys):
    argv = ["generate", str(run_dir), "--prompt", "def f(x):", "--max-new-tokens", "12", "--temperature", "0",
            "--device", "cpu"]
    assert main(argv) == 0
    plain = capsys.readouterr()
    assert main([*argv, "--drafter", str(drafter_run)]) == 0
    spec = capsys.readouterr()
    assert spec.out == plain.out  # greedy speculative decoding gives the target's own tokens
    assert "accepted length" in spec.err and "accepted length" not in plain.err
    al = float(spec.err.split("accepted length")[1].split()[0])
    assert 1.0 <= al <= 8.0  # at most the drafter's block (7) + the target's extra token


def test_generate_compile_refuses_what_it_cannot_compile(run_dir, drafter_run, capsys):
    """--compile (the compiled paged step: tests/models/test_generate_compile.py) says in one line
    why it cannot run: a drafter, or a model the paged cache does not take (this run's block of 8)."""
    argv = ["generate", str(run_dir), "--prompt", "def f(x):", "--max-new-tokens", "6", "--temperature", "0",
            "--device", "cpu", "--compile"]
    err = one_line_error(capsys, main([*argv, "--drafter", str(drafter_run)]))
    assert "--compile" in err and "--drafter" in err
    err = one_line_error(capsys, main(argv))
    assert "--compile needs an msakit model on the paged cache" in err and "block size 8" in err


def test_resuming_a_finished_run_trains_nothing_and_prints_no_nan(env, run_dir, drafter_run, capsys):
    before, dbefore = tree_state(run_dir), tree_state(drafter_run)
    assert main(["train", "--resume", "--out", str(run_dir), "--cache-dir", env["cache"]]) == 0
    out = capsys.readouterr().out
    assert "nothing to train" in out and "step 4 of 4" in out and "nan" not in out
    assert main(["train-drafter", str(run_dir), "--resume", "--out", str(drafter_run), "--cache-dir", env["cache"]]) == 0
    out = capsys.readouterr().out
    assert "nothing to train" in out and "nan" not in out
    assert tree_state(run_dir) == before and tree_state(drafter_run) == dbefore


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm", "error"])
def test_a_fresh_run_that_fails_before_its_first_checkpoint_leaves_nothing(env, tmp_path, monkeypatch, capsys, how):
    from msakit.train.trainer import Trainer

    def fit(self, *a, **k):
        assert (self.out_dir / "tokenizer.json").is_file()  # written by then: the clean-up must remove it
        if how == "ctrl-c":
            raise KeyboardInterrupt
        if how == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        raise RuntimeError("boom")

    monkeypatch.setattr(Trainer, "fit", fit)
    out = tmp_path / "runs" / "fresh"
    argv = ["train", "--config", env["config"], "--steps", "2", *common(env, out)]
    if how == "error":
        with pytest.raises(RuntimeError):
            main(argv)
    else:
        assert main(argv) == (130 if how == "ctrl-c" else 143)
    assert not (tmp_path / "runs").exists()  # the folders it created are gone too
    # an empty --out that existed before is left empty (and the same command can run again)
    out.mkdir(parents=True)
    if how == "error":
        with pytest.raises(RuntimeError):
            main(argv)
    else:
        assert main(argv) in (130, 143)
    assert out.is_dir() and not list(out.iterdir())


def test_a_run_interrupted_after_a_sharded_checkpoint_is_kept(env, tmp_path, monkeypatch):
    from msakit.train.trainer import Trainer

    def fit(self, *a, **k):
        (self.out_dir / "sharded" / "step-00000001").mkdir(parents=True)  # what a multi-rank save writes
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "fit", fit)
    out = tmp_path / "fresh"
    assert main(["train", "--config", env["config"], "--steps", "2", *common(env, out)]) == 130
    assert (out / "sharded" / "step-00000001").is_dir() and (out / "tokenizer.json").is_file()


def test_pruning_after_resuming_from_an_older_checkpoint_keeps_it(env, copy_run, capsys):
    ckpts = copy_run / "checkpoints"
    st = ckpts / "step-00000004" / "trainer_state.json"
    st.write_bytes(st.read_bytes().replace(b'"step"', b'"stpe"', 1))  # the newest checkpoint is corrupt
    err = one_line_error(capsys, main(["train", "--resume", "--out", str(copy_run), "--cache-dir", env["cache"]]))
    assert "corrupt" in err
    assert main(["train", "--resume", str(ckpts / "step-00000002"), "--out", str(copy_run), "--steps", "3",
                 "--cache-dir", env["cache"], "--no-progress"]) == 0
    from msakit.train import checkpoint as ck

    ck.verify_checkpoint(ckpts / "step-00000002")  # the checkpoint resumed from survives pruning (keep 2)
    assert ck.resolve_checkpoint(copy_run).name == "step-00000003"
    recs = [json.loads(x) for x in (copy_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if r["kind"] == "train"] == [1, 2, 3]  # the log follows the resumed run


def test_convert_then_continue_with_convert_resume(env, tmp_path, capsys):
    dense = tmp_path / "dense"
    assert main(["train", "--config", env["dense_config"], "--steps", "2", "--warmup-steps", "2",
                 *common(env, dense)]) == 0
    conv = tmp_path / "conv"
    opts = [a for a in common(env, conv) if a not in ("--vocab-size", "300")]
    assert main(["convert", str(dense), "--train", "all", "--steps", "3", "--warmup-steps", "2", "--block-size", "8",
                 "--topk", "2", "--index-dim", "8", *opts]) == 0
    out = capsys.readouterr().out
    assert "converted" in out and "after conversion" in out and f"convert --resume --out {conv}" in out
    from msakit.models import M3Config

    cfg = M3Config.from_pretrained(conv / "checkpoints" / "step-00000003")
    assert (cfg.index_block_size, cfg.index_topk_blocks, cfg.index_head_dim) == (8, 2, 8)  # as given
    assert cfg.num_sparse_layers == cfg.num_hidden_layers
    err = one_line_error(capsys, main(["convert", str(dense), *opts]))
    assert "--resume" in err
    assert main(["convert", "--resume", "--out", str(conv), "--steps", "5", "--no-progress",
                 "--cache-dir", env["cache"]]) == 0
    recs = [json.loads(x) for x in (conv / "metrics.jsonl").read_text().splitlines() if '"train"' in x]
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    assert [r["mode"] for r in recs] == ["dense", "dense", "sparse", "sparse", "sparse"]


def test_convert_refuses_zero_sizes():
    from msakit.models.convert import convert_dense_to_msa

    from toy_model import make_model

    dense = make_model(300, sparse_attention_freq=[0, 0])
    for kw in ({"block_size": 0}, {"topk": 0}, {"index_head_dim": 0}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            convert_dense_to_msa(dense, **kw)
    assert convert_dense_to_msa(dense, block_size=16, topk=3).config.index_block_size == 16


def _args(*argv):
    return build_parser().parse_args(list(argv))


def test_warmups_scale_to_a_short_run_and_given_ones_are_kept():
    from msakit.commands.options import optim_config

    notes = []
    cfg = optim_config(_args("train", "--steps", "10"), warn=notes.append)
    assert 0 < cfg.dense_warmup_steps < 10 and cfg.lr_warmup_steps >= 1  # reaches sparse attention
    assert any("scaled" in n for n in notes)
    notes.clear()
    cfg = optim_config(_args("train"), warn=notes.append)
    assert (cfg.steps, cfg.dense_warmup_steps, cfg.lr_warmup_steps) == (1000, 300, 20) and not notes
    cfg = optim_config(_args("train", "--steps", "10", "--warmup-steps", "20", "--lr-warmup-steps", "0"),
                       warn=notes.append)
    assert (cfg.dense_warmup_steps, cfg.lr_warmup_steps) == (20, 0)  # used as given ...
    assert any("never switches to sparse" in n for n in notes)  # ... and said so
    cfg = optim_config(_args("convert", "x", "--train", "all", "--steps", "30"), warn=notes.append)
    assert cfg.dense_warmup_steps == 10  # convert's own default (100 of 300) scaled
    cfg = optim_config(_args("convert", "x", "--steps", "30"), warn=notes.append)
    assert (cfg.train, cfg.dense_warmup_steps) == ("index", 30)  # the index warm-up is dense throughout
    notes.clear()
    cfg = optim_config(_args("convert", "x", "--max-tokens", "1000", "--batch-size", "2", "--context", "64"),
                       warn=notes.append)
    assert cfg.steps == 8 and any("--max-tokens" in n for n in notes)  # the schedule spans ceil(1000 / 128) steps


def test_size_check_counts_before_building(monkeypatch):
    from msakit.models import M3Config
    from msakit.train.runs import check_fits, config_params

    n = config_params(M3Config.preset("minimax-m3"))
    assert 3e11 < n < 6e11
    with pytest.raises(ValueError, match="needs at least"):
        check_fits(n, "cpu", available=lambda d: 1 << 40)
    check_fits(10**6, "cpu", available=lambda d: 1 << 30)
    check_fits(10**6, "cpu", available=lambda d: None)  # unknown: not refused
    with pytest.raises(ValueError, match="on cpu"):  # a CUDA run builds the model on the host first
        check_fits(10**9, "cuda", available=lambda d: (1 << 40) if d.type == "cuda" else (1 << 30))


def test_help_shows_defaults_and_keep_zero(capsys):
    assert main(["generate", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for s in ("(default: 200)", "(default: 0.8)", "(default: sparse)", "(default: auto)"):
        assert s in text, s
    for cmd in ("train", "convert", "train-drafter"):
        assert main([cmd, "--help"]) == 0
        assert "0 = keep all" in " ".join(capsys.readouterr().out.split()), cmd


def test_cost_reads_a_dense_hf_config(tmp_path, capsys):
    cfg = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["cost", "--config", str(tmp_path), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["parameters"]["routed_experts"] == 0
    assert 7.0e9 < r["parameters"]["total"] < 8.5e9  # Llama-3-8B's shape
