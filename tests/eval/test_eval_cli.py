"""`msakit eval` end to end on a tiny random HF Qwen2 folder; bad input exits 2 with one line."""

from __future__ import annotations

import json

import pytest

from eval_fakes import tiny_tokenizer
from msakit.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = tiny_tokenizer()
    d = tmp_path_factory.mktemp("qwen_tiny")
    cfg = Qwen2Config(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(d)
    tok.save(str(d / "tokenizer.json"))
    return d


def _docs(tmp_path):
    import sysconfig
    from pathlib import Path

    d = tmp_path / "docs"
    d.mkdir(exist_ok=True)
    (d / "textwrap.py").write_text((Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text())
    return str(d)


def _argv(hf_dir, tmp_path, out, policies, tasks="loss,passkey", budget="block32-top4"):
    return ["eval", "--model", str(hf_dir), "--tasks", tasks, "--lengths", "512", "--depths", "0.5",
            "--policies", policies, "--budget", budget, "--samples", "1", "--docs", _docs(tmp_path),
            "--out", str(out), "--device", "cpu", "--no-progress"]


def test_eval_hf_folder(hf_dir, tmp_path, capsys):
    out = tmp_path / "ev"
    argv = _argv(hf_dir, tmp_path, out, "dense,last256,msa")
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "| msa |" in table and "loss 512" in table
    summ = json.loads((out / "summary.json").read_text())
    assert set(summ["loss"]) == {"dense", "last256", "msa"}
    assert summ["loss"]["msa"]["512"]["loss"] != summ["loss"]["dense"]["512"]["loss"]
    # the finished run refuses a second start without --resume, resumes with it
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--resume" in err[0]
    assert main(argv + ["--resume"]) == 0


def test_eval_hf_folder_policies(hf_dir, tmp_path, capsys):
    out = tmp_path / "ev"
    assert main(_argv(hf_dir, tmp_path, out, "dense,window,window0,oracle,msa")) == 0
    summ = json.loads((out / "summary.json").read_text())
    assert set(summ["loss"]) == {"dense", "window", "window0", "oracle", "msa"}
    assert {r["selection"] for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())
            if r["policy"] != "dense"} == {"policy"}


def test_eval_hf_folder_window_oracle(hf_dir, tmp_path):
    """Without msa, an HF folder runs window / oracle on its own attention (no index branch)."""
    out = tmp_path / "wo"
    assert main(_argv(hf_dir, tmp_path, out, "dense,window,window0,oracle")) == 0
    recs = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert {r["selection"] for r in recs if r["policy"] != "dense"} == {"policy"}
    assert main(_argv(hf_dir, tmp_path, tmp_path / "full", "dense,window", tasks="loss", budget="block32-top16")) == 0
    full = json.loads((tmp_path / "full" / "summary.json").read_text())["loss"]
    assert full["window"]["512"]["loss"] == pytest.approx(full["dense"]["512"]["loss"], rel=1e-5)


@pytest.mark.parametrize("opt,val,match", [
    ("--budget", "64x8", "budget"), ("--policies", "dense,random", "policies"), ("--lengths", "4k", "lengths"),
    ("--depths", "0.5,x", "depths"), ("--tasks", "loss,qa", "task"), ("--samples", "0", "samples"),
    ("--dtype", "int8", "dtype"), ("--rope-scaling", "yarn", "rope scaling"), ("--ruler-samples", "0", "ruler-samples"),
])
def test_bad_input_one_line(hf_dir, tmp_path, capsys, opt, val, match):
    argv = ["eval", "--model", str(hf_dir), "--out", str(tmp_path / "x"), opt, val]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("msakit eval: error:") and match in err[0]
    assert not (tmp_path / "x").exists()


def test_missing_model(tmp_path, capsys):
    assert main(["eval", "--model", str(tmp_path / "none"), "--out", str(tmp_path / "o")]) == 2
    assert "not found" in capsys.readouterr().err


def test_eval_ruler_task_with_yarn(hf_dir, tmp_path, capsys):
    from ruler_fakes import write_ruler_data

    data = write_ruler_data(tmp_path / "rdata")
    out = tmp_path / "ruler"
    argv = ["eval", "--model", str(hf_dir), "--tasks", "qa_1", "--lengths", "2048", "--policies", "dense,window0",
            "--budget", "block32-top4", "--ruler-samples", "1", "--ruler-data", str(data), "--rope-scaling", "yarn:2",
            "--out", str(out), "--device", "cpu", "--no-progress"]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ruler"]["scores"]["dense"]["qa_1"]["2048"]["n"] == 1
    assert "rope scaling" in capsys.readouterr().err and (out / "ruler.png").is_file()
    assert main(argv[:-5] + ["--ruler-data", str(tmp_path / "none"), "--out", str(tmp_path / "r2"), "--device", "cpu",
                             "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "msakit[ruler]" in err[0]
