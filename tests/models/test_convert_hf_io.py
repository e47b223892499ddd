"""Converted HF models: cached decoding, the transformers round trip, q/k init, KL tokens, peft LoRA."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from msakit.cache import KVCache
from msakit.generate import generate
from msakit.models.convert import convert_dense_to_msa, init_index_from_qk, load_for_conversion
from msakit.models.hf import MSAWrappedModel, is_msa_folder
from msakit.models.interface import index_parameters
from msakit.generate import generate_uncached

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
}


def tiny(kind: str, *, tie: bool = False, heads: int = 4, kv: int = 2):
    cfg_name, model_name, extra = FAMILIES[kind]
    cfg = getattr(transformers, cfg_name)(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=kv, max_position_embeddings=256, tie_word_embeddings=tie, **extra)
    torch.manual_seed(0)
    return getattr(transformers, model_name)(cfg).eval()


def converted(kind: str = "qwen2", mode: str = "sparse", **kw) -> MSAWrappedModel:
    model = convert_dense_to_msa(tiny(kind, **kw), block_size=8, topk=2, init_blocks=1)
    model.set_attention_mode(mode)
    return model.eval()


@pytest.mark.parametrize("kind", sorted(FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_mode_equals_hf(kind: str, dtype: torch.dtype) -> None:
    hf = tiny(kind, tie=kind == "llama", heads=8, kv=2).to(dtype)  # GQA 4:1
    ids = torch.randint(0, 96, (2, 33))
    with torch.no_grad():
        ref = hf(ids).logits.clone()
        model = convert_dense_to_msa(hf, block_size=8, topk=2)
        assert torch.equal(model(ids, compute_kl=False).logits, ref)


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_cached_forward_equals_full_forward(mode: str) -> None:
    model = converted(mode=mode)
    ids = torch.randint(0, 96, (2, 45))
    with torch.no_grad():
        full = model(ids, compute_kl=False).logits
        cache = KVCache(2, 64)
        parts = [model(ids[:, :30], cache=cache).logits]
        for t in range(30, 45, 5):  # several new tokens at once, then one by one
            parts.append(model(ids[:, t:t + 5], cache=cache).logits)
        assert cache.length == 45
    tol = 1e-5 * math.sqrt(64)
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=tol)


def test_generate_is_cached_and_greedy_equal() -> None:
    model = converted()
    ids = torch.randint(0, 96, (1, 20))
    calls = []
    handle = model.hf.model.register_forward_pre_hook(lambda m, a, k: calls.append(k["input_ids"].shape[1]),
                                                      with_kwargs=True)
    toks = generate(model, ids, 6, temperature=0)
    handle.remove()
    assert calls == [20, 1, 1, 1, 1, 1]  # the prompt once, then one new token per step
    ref = generate_uncached(model, ids, 6, temperature=0)
    assert torch.equal(toks, ref)


@pytest.mark.parametrize("kind,tie", [("qwen2", False), ("llama", True), ("qwen3", False)])
def test_round_trip_msakit_and_plain_transformers(tmp_path: Path, kind: str, tie: bool) -> None:
    model = converted(kind, tie=tie)
    ids = torch.randint(0, 96, (1, 40))
    with torch.no_grad():
        ref = model(ids, compute_kl=False).logits
    src = tmp_path / "src"
    (src).mkdir()
    (src / "tokenizer.json").write_text("{}")
    model.hf.name_or_path = str(src)  # where a folder-loaded model's tokenizer lives
    model.save_pretrained(tmp_path / "msa")
    assert is_msa_folder(tmp_path / "msa") and (tmp_path / "msa" / "tokenizer.json").is_file()
    again = load_for_conversion(tmp_path / "msa")
    assert isinstance(again, MSAWrappedModel) and again.attention_mode == "sparse"
    assert torch.equal(again(ids, compute_kl=False).logits, ref)
    # plain transformers, with msakit imported: the same logits in sparse mode, and HF's generate
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "msa")).eval()
    assert type(hf).__name__.startswith("MSA")
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ref, rtol=0, atol=1e-5)
    out = hf.generate(ids[:, :24], max_new_tokens=8, do_sample=False)
    mine = generate(again, ids[:, :24], 8, temperature=0)
    assert torch.equal(out, mine)


def test_save_refuses_nothing_and_loads_strictly(tmp_path: Path) -> None:
    model = converted()
    model.save_pretrained(tmp_path / "m")
    raw = json.loads((tmp_path / "m" / "config.json").read_text())
    raw["msakit_msa"]["layers"] = [0]
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "m", bad)
    (bad / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="msakit_llama|not a saved MSA"):
        MSAWrappedModel.from_pretrained(tmp_path / "nowhere")
    loaded = MSAWrappedModel.from_pretrained(bad)  # fewer branches: loads, extra weights unused
    assert loaded.settings.layers == [0]


def test_qk_init_matches_group_mean_scores() -> None:
    hf = tiny("llama")  # no q/k biases: the pre-norm index scores equal the main ones
    model = convert_dense_to_msa(hf, block_size=8, topk=2, index_init="qk")
    assert model.settings.rotary_dim == 16 and model.settings.index_head_dim == 16
    attn = hf.model.layers[0].self_attn
    x = torch.randn(3, 64)
    q = attn.q_proj(x).view(3, 2, 2, 16).mean(2)  # [tokens, G, D]: group-mean of the query heads
    k = attn.k_proj(x).view(3, 2, 16).mean(1)
    torch.testing.assert_close(attn.index_q_proj(x).view(3, 2, 16), q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(attn.index_k_proj(x), k, rtol=1e-5, atol=1e-6)
    assert attn.index_q_norm.weight.abs().sum() == 0
    # the index RoPE rotates what the main RoPE rotates: with one head per group the index
    # selection of a 1-token-per-head model ranks keys as the main scores do
    with pytest.raises(ValueError, match="index_head_dim"):
        init_index_from_qk(convert_dense_to_msa(tiny("llama"), block_size=8, topk=2, index_head_dim=8))
    with pytest.raises(ValueError, match="index_init"):
        convert_dense_to_msa(tiny("llama"), index_init="zeros")


def test_kl_tokens_all_and_index_parameters() -> None:
    model = converted(mode="dense")
    ids = torch.randint(0, 96, (1, 40))
    sel = model(ids).kl
    model.set_kl_tokens("all")
    every = model(ids, logits_to_keep=1)
    assert every.logits.shape == (1, 1, 96)
    assert torch.isfinite(every.kl) and every.kl.item() != pytest.approx(sel.item())
    names = [n for n, _ in model.index_parameters()]
    assert len(names) == 2 * 4 and all(".self_attn.index_" in n for n in names)
    assert [n for n, _ in index_parameters(model)] == names
    with pytest.raises(ValueError, match="tokens"):
        model.set_kl_tokens("some")
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(ids, labels=ids, logits_to_keep=1)


def test_peft_lora_trains_in_sparse_mode() -> None:
    peft = pytest.importorskip("peft")
    model = converted()
    model.train()
    # LoRA injected in place: the wrapper, its index branches and their state stay as they are
    peft.inject_adapter_in_model(peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), model.hf)
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(trainable) == 2 * 2 * 2
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    ids = torch.randint(0, 96, (2, 40))
    losses = []
    for _ in range(4):
        out = model(ids, labels=ids, compute_kl=False)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    assert model.attention_mode == "sparse" and losses[-1] < losses[0]
