"""Dense -> MSA conversion: msakit dense models and HF Llama / Qwen2 models keep their outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from msakit.generate import generate
from msakit.models import M3Config, M3ForCausalLM
from msakit.models.convert import convert_dense_to_msa, load_for_conversion
from msakit.models.hf import MSAWrappedModel

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")


def dense_m3() -> M3ForCausalLM:
    cfg = M3Config.preset(
        "tiny", vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, index_head_dim=16, rotary_dim=8, dense_intermediate_size=64, intermediate_size=32,
        shared_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sparse_attention_freq=[0, 0],
    )
    torch.manual_seed(0)
    return M3ForCausalLM(cfg)


def test_convert_msakit_dense_model(tmp_path: Path) -> None:
    src = dense_m3()
    assert not src.msa_layers()
    ids = torch.randint(0, 256, (2, 40))
    ref = src(ids, labels=ids)
    assert ref.kl.item() == 0.0
    new = convert_dense_to_msa(src, block_size=8, topk=2)
    assert new.config.sparse_attention_freq == [1, 1] and new.attention_mode == "dense"
    assert (new.config.index_block_size, new.config.index_topk_blocks, new.config.index_n_heads) == (8, 2, 2)
    out = new(ids, labels=ids)
    assert torch.equal(out.logits, ref.logits)
    assert out.kl.item() > 0
    g = torch.autograd.grad(out.kl, [new.model.layers[0].self_attn.index_q_proj.weight])[0]
    assert g.abs().sum() > 0
    new.set_attention_mode("sparse")
    assert (new(ids).logits - ref.logits).abs().max() > 1e-5
    # deterministic fresh init; the result saves and reloads as an M3 model
    again = convert_dense_to_msa(src, block_size=8, topk=2)
    assert torch.equal(again.model.layers[1].self_attn.index_k_proj.weight, new.model.layers[1].self_attn.index_k_proj.weight)
    new.save_pretrained(tmp_path / "m")
    assert isinstance(load_for_conversion(tmp_path / "m"), M3ForCausalLM)
    with pytest.raises(ValueError, match="every layer"):
        convert_dense_to_msa(new)
    # from a folder
    src.save_pretrained(tmp_path / "dense")
    from_path = convert_dense_to_msa(tmp_path / "dense", block_size=8, topk=2)
    assert torch.equal(from_path(ids).logits, ref.logits)


def tiny_hf(kind: str):
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).eval()
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common)).eval()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_convert_hf_model_keeps_outputs(kind: str) -> None:
    hf = tiny_hf(kind)
    ids = torch.randint(0, 128, (2, 40))
    with torch.no_grad():
        ref = hf(ids).logits.clone()
    model = convert_dense_to_msa(hf, block_size=8, topk=2)
    assert isinstance(model, MSAWrappedModel) and model.attention_mode == "dense"
    out = model(ids, labels=ids, return_attn_inputs=True)
    torch.testing.assert_close(out.logits, ref, rtol=0, atol=1e-5)
    assert out.kl.item() > 0 and out.expert_load.numel() == 0
    attn = hf.model.layers[0].self_attn
    g = torch.autograd.grad(out.kl, [attn.index_q_proj.weight, attn.q_proj.weight], allow_unused=True)
    assert g[0].abs().sum() > 0 and (g[1] is None or g[1].abs().sum() == 0)
    a = out.attn_inputs[1]
    assert a["q"].shape == (2, 40, 4, 16) and a["k_idx"].shape == (2, 40, 16) and a["block_idx"].shape == (2, 2, 40, 2)
    assert (a["block_size"], a["topk"]) == (8, 2)
    model.set_attention_mode("sparse")
    sp = model(ids, labels=ids)
    torch.testing.assert_close(sp.logits[:, :16], ref[:, :16], rtol=0, atol=1e-5)  # all blocks selected there
    assert (sp.logits[:, 20:] - ref[:, 20:]).abs().max() > 1e-4
    sp.loss.backward()
    model.update_routing_bias(out.expert_load)


def test_hf_wrapper_packed_and_roundtrip(tmp_path: Path) -> None:
    hf = tiny_hf("llama")
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_for_conversion(tmp_path / "hf")
    assert type(loaded).__name__ == "LlamaForCausalLM"
    model = convert_dense_to_msa(tmp_path / "hf", block_size=8, topk=2, index_head_dim=32, rotary_dim=16)
    assert model.settings.index_head_dim == 32 and model.settings.rope_theta == 10000.0
    a, b = torch.randint(0, 128, (1, 13)), torch.randint(0, 128, (1, 19))
    for mode in ("dense", "sparse"):
        model.set_attention_mode(mode)
        packed = model(torch.cat([a, b], 1), cu_seqlens=torch.tensor([0, 13, 32], dtype=torch.int32))
        torch.testing.assert_close(packed.logits[:, :13], model(a).logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed.logits[:, 13:], model(b).logits, rtol=1e-5, atol=1e-5)
    model.save_pretrained(tmp_path / "msa")
    raw = json.loads((tmp_path / "msa" / "config.json").read_text())
    assert raw["model_type"] == "msakit_llama"
    settings = raw["msakit_msa"]
    assert settings["mode"] == "sparse" and settings["block_size"] == 8
    again = load_for_conversion(tmp_path / "msa")
    assert isinstance(again, MSAWrappedModel)
    ids = torch.randint(0, 128, (1, 30))
    assert torch.equal(again(ids).logits, model(ids).logits)
    toks = generate(again, ids[:, :4], 3, temperature=0)
    assert toks.shape == (1, 7)


def test_unsupported_inputs(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="gpt2"):
        load_for_conversion(tmp_path)
    with pytest.raises(FileNotFoundError):
        load_for_conversion(tmp_path / "missing")
    with pytest.raises(ValueError, match="cannot convert"):
        convert_dense_to_msa(torch.nn.Linear(2, 2))


def test_m3_qk_init_and_kl_tokens() -> None:
    from msakit.models.convert import init_index_from_qk

    new = convert_dense_to_msa(dense_m3(), block_size=8, topk=2, index_init="qk")
    attn = new.model.layers[0].self_attn
    x = torch.randn(5, 64)
    torch.testing.assert_close(attn.index_q_proj(x).view(5, 2, 16), attn.q_proj(x).view(5, 2, 2, 16).mean(2),
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(attn.index_k_norm.weight, attn.k_norm.weight)
    ids = torch.randint(0, 256, (1, 40))
    sel = new(ids).kl
    new.set_kl_tokens("all")
    assert all(a.cfg.kl_tokens == "all" for a in new.msa_layers())
    every = new(ids).kl
    assert torch.isfinite(every) and every.item() != pytest.approx(sel.item())
    assert {n.split(".self_attn.")[1].split(".")[0] for n, _ in new.index_parameters()} == {
        "index_q_proj", "index_k_proj", "index_q_norm", "index_k_norm"}
    with pytest.raises(ValueError, match="MSAWrappedModel or an M3ForCausalLM"):
        init_index_from_qk(torch.nn.Linear(2, 2))
