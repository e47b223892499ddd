"""`msakit convert WARMED/model --train all --warmup-steps 0` (stage 2 of the conversion recipe) end to end on
a tiny msakit run and a tiny random HF Qwen2 folder: the warmed model's index weights are the starting point
(nothing re-added or re-initialised), --init-blocks / --topk change the selection only, --lora trains the
backbone through LoRA adapters merged into OUT/model (which generate and eval load), --short-context reports the
loss at N tokens before and after, and options that cannot apply exit 2 with one line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from cli_helpers import common, one_line_error
from msakit.cli import main
from msakit.models.convert import load_for_conversion

pytestmark = pytest.mark.usefixtures("one_thread")


def _opts(env, out, *extra):
    """`common` without --vocab-size (the tokenizer comes with the source)."""
    return [a for a in common(env, out, *extra) if a not in ("--vocab-size", "300")]


def _tensors(folder):
    out = {}
    for f in sorted(folder.glob("model*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def warmed(env, tmp_path_factory):
    """{"msakit": .., "qwen2": ..}: OUT/model of a 2-step index warm-up of a dense msakit run and of a Qwen2 folder."""
    root = tmp_path_factory.mktemp("stage2")
    dense = root / "dense"
    assert main(["train", "--config", env["dense_config"], "--steps", "1", *common(env, dense)]) == 0
    from transformers import Qwen2Config, Qwen2ForCausalLM

    qwen = root / "qwen"
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                 tie_word_embeddings=False)).save_pretrained(qwen)
    shutil.copy(dense / "tokenizer.json", qwen / "tokenizer.json")
    out = {}
    for kind, src, extra in (("msakit", dense, ["--index-dim", "8"]), ("qwen2", qwen, [])):
        run = root / f"warm-{kind}"
        assert main(["convert", str(src), "--steps", "2", "--block-size", "8", "--topk", "2", *extra,
                     *_opts(env, run)]) == 0
        out[kind] = run / "model"
    return out


@pytest.mark.parametrize("kind", ["msakit", "qwen2"])
def test_stage2_starts_from_the_warmed_index_weights(env, warmed, kind, tmp_path, capsys):
    src = _tensors(warmed[kind])
    run = tmp_path / "s2"
    # one step at lr 0: nothing moves, so OUT/model is the warmed model itself (not a re-converted one)
    assert main(["convert", str(warmed[kind]), "--train", "all", "--warmup-steps", "0", "--steps", "1", "--lr", "1e-30",
                 "--init-blocks", "1", "--topk", "3", "--short-context", "16", *_opts(env, run)]) == 0
    out = capsys.readouterr().out
    assert "continuing the MSA model" in out and "short-context validation loss (16 tokens)" in out
    new = _tensors(run / "model")
    assert set(new) == set(src)
    assert all(torch.allclose(new[k], src[k], atol=1e-6) for k in src if ".index_" in k)
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["mode"] for r in recs if r["kind"] == "train"] == ["sparse"]
    short = [r for r in recs if r["kind"] == "short_context"]
    assert len(short) == 1 and short[0]["context"] == 16 and short[0]["rows"] > 0
    assert abs(short[0]["change_pct"]["sparse"]) < 1e-3  # lr ~0: the short-context loss does not move
    model = load_for_conversion(run / "model")
    sel = model.settings.selection if hasattr(model, "settings") else model.config.selection
    assert (sel.init_blocks, sel.topk, sel.block_size) == (1, 3, 8)


def test_stage2_short_context_on_another_corpus(env, warmed, tmp_path, capsys):
    """--short-context-data measures the short-context loss on other files than the validation split."""
    text = tmp_path / "english.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    run = tmp_path / "s2d"
    assert main(["convert", str(warmed["msakit"]), "--train", "all", "--warmup-steps", "0", "--steps", "1",
                 "--lr", "1e-2", "--short-context", "16", "--short-context-data", str(text), *_opts(env, run)]) == 0
    out = capsys.readouterr().out
    assert f"short-context loss on {text} (16 tokens)" in out
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    short = [r for r in recs if r["kind"] == "short_context"]
    assert len(short) == 1 and short[0]["data"] == [str(text)] and short[0]["rows"] > 0
    default = tmp_path / "s2v"
    assert main(["convert", str(warmed["msakit"]), "--train", "all", "--warmup-steps", "0", "--steps", "1",
                 "--lr", "1e-2", "--short-context", "16", *_opts(env, default)]) == 0
    rec = [json.loads(x) for x in (default / "metrics.jsonl").read_text().splitlines()
           if json.loads(x)["kind"] == "short_context"][0]
    assert rec["data"] == "validation files" and rec["before"]["dense"] != short[0]["before"]["dense"]


@pytest.mark.parametrize("kind", ["msakit", "qwen2"])
def test_stage2_with_lora_saves_merged_weights_that_generate_and_eval_load(env, warmed, kind, tmp_path, capsys):
    src = _tensors(warmed[kind])
    run = tmp_path / "lora"
    assert main(["convert", str(warmed[kind]), "--train", "all", "--warmup-steps", "0", "--steps", "2",
                 "--lr", "1e-2", "--lora", "2", "--lora-alpha", "4", *_opts(env, run)]) == 0
    out = capsys.readouterr().out
    assert "LoRA of rank 2" in out and "merged the LoRA adapters" in out and "no resumable checkpoints" in out
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").glob("step-*"))
    new = _tensors(run / "model")
    assert set(new) == set(src) and not any("lora" in k for k in new)  # the original names, adapters merged
    moved = {k for k in src if not torch.equal(new[k], src[k])}
    assert any(".index_" in k for k in moved)  # the index branch trains fully
    assert any(k.endswith("q_proj.weight") and ".index_" not in k for k in moved)  # the merged LoRA deltas
    frozen = [k for k in src if "embed" in k or "norm" in k and ".index_" not in k]
    assert frozen and all(torch.equal(new[k], src[k]) for k in frozen)
    assert main(["generate", str(run / "model"), "--prompt", "def f(x):", "--max-new-tokens", "3", "--temperature",
                 "0", "--mode", "sparse", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("def f(x):")


@pytest.mark.parametrize("extra,match", [
    (["--lora", "2"], "--lora"),  # --train index (the default)
    (["--train", "all", "--lora-alpha", "4"], "--lora-alpha"),
    (["--train", "all", "--index-dim", "4"], "--index-dim"),
    (["--train", "all", "--index-init", "qk"], "--index-init"),
    (["--train", "all", "--short-context", "128"], "--short-context"),
    (["--train", "all", "--short-context-data", "x.txt"], "--short-context-data"),
    (["--train", "all", "--short-context", "16", "--short-context-data", "/no/such/file"], "/no/such/file"),
])
def test_stage2_options_that_cannot_apply_exit_2_one_line(env, warmed, tmp_path, capsys, extra, match):
    run = tmp_path / "bad"
    err = one_line_error(capsys, main(["convert", str(warmed["msakit"]), "--steps", "1", *extra, *_opts(env, run)]))
    assert match in err
    assert not run.exists()
