"""`msakit convert --train index` end to end on a tiny msakit dense run and a tiny random HF Qwen2
folder: the backbone in OUT/model is the source's bit for bit, --max-tokens stops at its step,
OUT/model takes `msakit generate` and `msakit eval`, the run resumes in index mode, `--train all`
takes --index-lr and --kl-tokens all, and combinations that cannot apply exit 2 with one line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from cli_helpers import common, one_line_error
from msakit.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


def _opts(env, out, *extra):
    """`common` without --vocab-size (the tokenizer comes with the source)."""
    return [a for a in common(env, out, *extra) if a not in ("--vocab-size", "300")]


@pytest.fixture(scope="module")
def dense(env, tmp_path_factory):
    """A 1-step msakit run of a dense (no MSA layer) toy model."""
    out = tmp_path_factory.mktemp("cidx") / "dense"
    assert main(["train", "--config", env["dense_config"], "--steps", "1", *common(env, out)]) == 0
    return out


@pytest.fixture(scope="module")
def qwen(dense, tmp_path_factory):
    """A tiny random HF Qwen2 folder with the dense run's tokenizer (300 tokens)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    d = tmp_path_factory.mktemp("cidx_qwen")
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                 tie_word_embeddings=False)).save_pretrained(d)
    shutil.copy(dense / "tokenizer.json", d / "tokenizer.json")
    return d


def _tensors(folder):
    out = {}
    for f in sorted(folder.glob("model*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _train_records(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"train"' in x]


def test_index_warmup_of_an_msakit_model(env, dense, tmp_path, capsys):
    conv = tmp_path / "conv"
    per_step = 2 * 64
    assert main(["convert", str(dense), "--steps", "6", "--max-tokens", str(3 * per_step - 5), "--block-size", "8",
                 "--topk", "2", "--index-dim", "8", "--init-blocks", "1", "--kl-tokens", "all",
                 *_opts(env, conv, "--eval-every", "2")]) == 0
    out = capsys.readouterr().out
    # one line per evaluation (step 2, and step 3 where --max-tokens stopped the run) with both losses
    lines = [x for x in out.splitlines() if "validation loss dense" in x and x.startswith("step ")]
    assert [x.split(":")[0] for x in lines] == ["step 2", "step 3"] and all("sparse" in x for x in lines)
    assert "after conversion" in out and "backbone frozen" in out
    assert (conv / "checkpoints" / "latest").read_text().strip() == "step-00000003"
    recs = _train_records(conv)
    assert [r["step"] for r in recs] == [1, 2, 3] and {r["mode"] for r in recs} == {"dense"}
    # OUT/model: the source's backbone bit for bit, an index branch that trained, the tokenizer beside it
    model = conv / "model"
    src = _tensors(dense / "checkpoints" / "step-00000001")
    new = _tensors(model)
    index = {k for k in new if ".index_" in k}
    assert index and set(new) - index == set(src)
    assert all(torch.equal(new[k], src[k]) for k in src)
    assert (model / "tokenizer.json").is_file()
    from msakit.models import M3Config

    cfg = M3Config.from_pretrained(model)
    assert (cfg.index_init_blocks, cfg.index_block_size, cfg.index_topk_blocks) == (1, 8, 2)
    assert main(["generate", str(model), "--prompt", "def f(x):", "--max-new-tokens", "4", "--temperature", "0",
                 "--mode", "sparse", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("def f(x):")
    # the run resumes as it was: index only, dense attention, OUT/model rewritten at the end
    assert main(["convert", "--resume", "--out", str(conv), "--steps", "4", "--no-progress",
                 "--cache-dir", env["cache"]]) == 0
    recs = _train_records(conv)
    assert [r["step"] for r in recs] == [1, 2, 3, 4] and all(r["loss"] is None for r in recs)
    again = _tensors(model)
    assert all(torch.equal(again[k], src[k]) for k in src)
    assert any(not torch.equal(again[k], new[k]) for k in index)


def test_index_warmup_of_an_hf_folder_reloads_generates_and_evaluates(env, qwen, tmp_path, capsys):
    conv = tmp_path / "conv"
    assert main(["convert", str(qwen), "--steps", "2", "--block-size", "8", "--topk", "2", "--init-blocks", "1",
                 "--index-init", "qk", "--index-lr", "3e-3", *_opts(env, conv)]) == 0
    capsys.readouterr()
    model = conv / "model"
    src = _tensors(qwen)
    new = _tensors(model)
    index = {k for k in new if ".index_" in k}
    assert index and all(torch.equal(new[k], src[k]) for k in src)
    st = json.loads((conv / "checkpoints" / "step-00000002" / "trainer_state.json").read_text())
    assert st["config"]["train"] == "index" and st["config"]["lr"] == 3e-3  # --index-lr is the run's lr
    assert main(["generate", str(model), "--prompt", "def f(x):", "--max-new-tokens", "4", "--temperature", "0",
                 "--mode", "sparse", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("def f(x):")
    ev = tmp_path / "eval"
    assert main(["eval", "--model", str(model), "--tasks", "loss", "--lengths", "64", "--policies", "dense,msa",
                 "--budget", "block8-top2", "--samples", "1", "--docs", env["data"], "--out", str(ev),
                 "--device", "cpu", "--no-progress"]) == 0
    assert (ev / "summary.json").is_file()


def test_train_all_takes_index_lr_and_kl_over_all_tokens(env, dense, tmp_path):
    conv = tmp_path / "conv"
    assert main(["convert", str(dense), "--train", "all", "--steps", "2", "--warmup-steps", "1", "--lr", "1e-3",
                 "--index-lr", "4e-3", "--kl-tokens", "all", "--block-size", "8", "--topk", "2", "--index-dim", "8",
                 *_opts(env, conv)]) == 0
    assert [r["mode"] for r in _train_records(conv)] == ["dense", "sparse"]
    opt = json.loads((conv / "checkpoints" / "step-00000002" / "optimizer.json").read_text())
    scaled = [g for g in opt["param_groups"] if g.get("lr_scale") == 4.0]
    assert scaled and all(".index_" in n for g in scaled for n in g["params"])
    assert any(".index_" not in n for g in opt["param_groups"] for n in g["params"])  # the backbone trains too


@pytest.mark.parametrize("extra,match", [
    (["--warmup-steps", "2"], "--warmup-steps"),
    (["--kl-coef", "0.5"], "--kl-coef"),
    (["--kl-every", "2"], "--kl-every"),
    (["--lr", "1e-3", "--index-lr", "1e-2"], "--index-lr"),
    (["--init-blocks", "2"], "--init-blocks"),
    (["--time-budget", "0"], "--time-budget"),
    (["--max-tokens", "0"], "--max-tokens"),
])
def test_combinations_that_cannot_apply_exit_2_one_line(env, dense, tmp_path, capsys, extra, match):
    conv = tmp_path / "conv"
    err = one_line_error(capsys, main(["convert", str(dense), "--block-size", "8", "--topk", "2", *extra,
                                       *_opts(env, conv)]))
    assert match in err
    assert not conv.exists()


def test_compile_of_a_converted_hf_model_is_refused_before_any_data_or_folder(env, qwen, tmp_path, capsys):
    conv = tmp_path / "conv"
    rc = main(["convert", str(qwen), "--steps", "2", "--block-size", "8", "--topk", "2", "--compile", *_opts(env, conv)])
    err = capsys.readouterr().err.strip().splitlines()  # transformers' loading bar may come first
    assert rc == 2 and err[-1].startswith("msakit convert: error:") and "--compile" in err[-1]
    assert not conv.exists()
