"""Adding a model family is one file: tests/phi3_family.py registers transformers' Phi-3 (fused
qkv_proj, partial RoPE) and conversion works end to end; the shipped families' registry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from msakit.generate import generate, generate_uncached
from msakit.models.adapters import family_adapter, find_family, supported_model_types
from msakit.models.convert import convert_dense_to_msa, load_for_conversion
from msakit.models.hf import MSAWrappedModel, is_msa_folder
from msakit.models.interface import MSAModel

transformers = pytest.importorskip("transformers")
phi3_family = pytest.importorskip("phi3_family")  # the one file (tests/ is on sys.path)

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_phi3(*, partial: float = 0.5, **extra) -> torch.nn.Module:
    cfg = transformers.Phi3Config(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial}, **extra)
    torch.manual_seed(0)
    return transformers.Phi3ForCausalLM(cfg).eval()


def test_registry_of_the_shipped_families() -> None:
    assert {"llama", "mistral", "qwen2", "qwen3", "phi3"} <= set(supported_model_types())
    assert find_family("msakit_qwen3") is family_adapter("qwen3") and find_family("gpt2") is None
    with pytest.raises(ValueError, match="gpt2.*not supported"):
        family_adapter("gpt2")
    with pytest.raises(ValueError, match="sliding"):
        convert_dense_to_msa(transformers.MistralForCausalLM(transformers.MistralConfig(
            vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, sliding_window=16)))


def test_phi3_dense_equals_source_and_sparse_trains_the_index_only() -> None:
    hf = tiny_phi3()
    ids = torch.randint(0, 96, (2, 40))
    with torch.no_grad():
        ref = hf(ids).logits.clone()
    model = convert_dense_to_msa(hf, block_size=8, topk=2)
    assert isinstance(model, MSAWrappedModel) and isinstance(model, MSAModel) and model.adapter.name == "phi3"
    out = model(ids, labels=ids, return_attn_inputs=True)
    torch.testing.assert_close(out.logits, ref, rtol=0, atol=1e-5)
    assert out.attn_inputs[0]["k_idx"].shape == (2, 40, 16) and out.attn_inputs[0]["block_idx"].shape == (2, 2, 40, 2)
    model.set_attention_mode("sparse")
    sp = model(ids, labels=ids)
    assert sp.kl.item() > 0 and (sp.logits[:, 20:] - ref[:, 20:]).abs().max() > 1e-4
    attn = hf.model.layers[0].self_attn
    g_idx, g_qkv = torch.autograd.grad(sp.kl, [attn.index_q_proj.weight, attn.qkv_proj.weight], allow_unused=True)
    assert g_idx.abs().sum() > 0 and (g_qkv is None or g_qkv.abs().sum() == 0)
    sp.loss.backward()
    assert attn.qkv_proj.weight.grad.abs().sum() > 0  # the LM loss still trains the backbone


def test_phi3_qk_init_splits_the_fused_projection() -> None:
    hf = tiny_phi3()
    model = convert_dense_to_msa(hf, block_size=8, topk=2, index_init="qk")
    assert model.settings.rotary_dim == 8  # what the main RoPE rotates: half of head_dim 16
    attn = hf.model.layers[1].self_attn
    x = torch.randn(3, 64)
    qkv = attn.qkv_proj(x)
    q = qkv[:, :64].view(3, 2, 2, 16).mean(2)  # group mean of the query heads (4 heads, 2 groups)
    k = qkv[:, 64:96].view(3, 2, 16).mean(1)
    torch.testing.assert_close(attn.index_q_proj(x).view(3, 2, 16), q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(attn.index_k_proj(x), k, rtol=1e-5, atol=1e-6)


def test_phi3_round_trip_and_cached_generation(tmp_path: Path) -> None:
    model = convert_dense_to_msa(tiny_phi3(), block_size=8, topk=2, init_blocks=1)
    model.set_attention_mode("sparse")
    model.eval()
    ids = torch.randint(0, 96, (1, 30))
    with torch.no_grad():
        ref = model(ids, compute_kl=False).logits
    model.save_pretrained(tmp_path / "msa")
    assert json.loads((tmp_path / "msa" / "config.json").read_text())["model_type"] == "msakit_phi3"
    assert is_msa_folder(tmp_path / "msa")
    again = load_for_conversion(tmp_path / "msa")
    assert isinstance(again, MSAWrappedModel) and again.attention_mode == "sparse"
    with torch.no_grad():
        assert torch.equal(again(ids, compute_kl=False).logits, ref)
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "msa")).eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, ref, rtol=0, atol=1e-5)
    toks = generate(again, ids[:, :20], 6, temperature=0, cache="contiguous")
    assert torch.equal(toks, generate_uncached(again, ids[:, :20], 6, temperature=0))
