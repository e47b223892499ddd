"""M3Config parsing/presets, M3ForCausalLM forward/backward, meta-device builds and safetensors I/O."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from msakit import cost
from msakit.models import M3Config, M3ForCausalLM
from msakit.models.io import INDEX_FILE, SINGLE_FILE, hf_state_items

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[2]
FLASH, M3 = "minimax-m3.1-flash", "minimax-m3"


def fixture_config(name: str) -> Path:
    for root in (REPO / "tests" / "fixtures", REPO.parent / "shared" / "fixtures"):
        p = root / name / "config.json"
        if p.is_file():
            return p
    pytest.skip(f"fixture {name} not found")


def _raw(name: str) -> dict[str, Any]:
    return json.loads(fixture_config(name).read_text())


def small_cfg(**kw: Any) -> M3Config:
    """2 layers (dense MLP + MoE), blocks of 8, top-2: sparse selection matters from T = 17."""
    base = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, index_head_dim=16, rotary_dim=8, dense_intermediate_size=96, intermediate_size=32,
                shared_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, index_block_size=8,
                index_topk_blocks=2)
    base.update(kw)
    return M3Config.preset("tiny", **base)


def make(cfg: M3Config, seed: int = 0) -> M3ForCausalLM:
    torch.manual_seed(seed)
    return M3ForCausalLM(cfg)


# -- config --------------------------------------------------------------------------------------


def test_presets() -> None:
    tiny = M3Config.preset("tiny")
    assert (tiny.hidden_size, tiny.num_hidden_layers, tiny.vocab_size) == (128, 4, 4096)
    assert tiny.moe_layer_freq == [0, 1, 1, 1] and tiny.sparse_attention_freq == [1, 1, 1, 1]
    assert (tiny.num_local_experts, tiny.num_experts_per_tok, tiny.n_shared_experts) == (8, 2, 1)
    assert (tiny.index_block_size, tiny.index_topk_blocks, tiny.rotary_dim) == (32, 4, 16)
    assert M3Config.preset("tiny", vocab_size=1000).vocab_size == 1000
    six = M3Config.preset("tiny", num_hidden_layers=6)
    assert six.moe_layer_freq == [0] + [1] * 5 and len(six.sparse_attention_freq) == 6
    small = M3Config.preset("small")
    assert (small.hidden_size, small.num_hidden_layers, small.num_local_experts, small.index_topk_blocks) == (512, 8, 16, 8)
    with pytest.raises(ValueError, match="unknown preset"):
        M3Config.preset("huge")
    with pytest.raises(ValueError, match="unknown M3Config field"):
        M3Config.preset("tiny", hiden_size=3)


@pytest.mark.parametrize("name", [FLASH, M3])
def test_fixture_presets_match_files(name: str) -> None:
    cfg = M3Config.from_pretrained(fixture_config(name))
    assert cfg == M3Config.preset(name)
    assert cfg == M3Config.from_pretrained(fixture_config(name).parent)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_local_experts, cfg.index_topk_blocks) == (6144, 60, 128, 16)
    assert cfg.rotary_dim == 64 and cfg.routed_scaling_factor == 2.0
    assert cfg.num_sparse_layers == (60 if name == FLASH else 57)
    assert cfg.rope_theta == (1e7 if name == FLASH else 5e6)


@pytest.mark.parametrize("name", [FLASH, M3])
def test_flat_transformers_names(name: str) -> None:
    text = copy.deepcopy(_raw(name)["text_config"])
    sac = text.pop("sparse_attention_config")
    moe = text.pop("moe_layer_freq")
    text.update(index_n_heads=4, index_head_dim=128, index_block_size=128, index_topk_blocks=16, index_local_blocks=1,
                layer_types=["minimax_m3_sparse" if f else "full_attention" for f in sac["sparse_attention_freq"]],
                mlp_layer_types=["sparse" if f else "dense" for f in moe], hidden_act="silu")
    text.pop("rope_theta")
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": _raw(name)["text_config"]["rope_theta"]}
    assert M3Config.from_dict(text) == M3Config.preset(name)


def test_roundtrip(tmp_path: Path) -> None:
    for cfg in (M3Config.preset("tiny"), M3Config.preset("small"), M3Config.preset(M3), small_cfg(eos_token_id=[1, 2])):
        f = cfg.save(tmp_path / "c")
        assert M3Config.from_pretrained(f) == cfg
        assert M3Config.from_pretrained(tmp_path / "c") == cfg
    d = M3Config.preset("tiny").to_dict()
    d.update(some_unknown_key=1, vision_config={"x": 1}, quantization_config=None)
    assert M3Config.from_dict({"text_config": d, "model_type": "minimax_m3_vl"}) == M3Config.preset("tiny")


def _bad(mutate) -> dict[str, Any]:
    raw = _raw(FLASH)
    mutate(raw["text_config"])
    return raw


@pytest.mark.parametrize("mutate, field", [
    (lambda t: t["sparse_attention_config"].update(sparse_score_type="lse"), "sparse_score_type"),
    (lambda t: t["sparse_attention_config"].update(sparse_num_index_heads=2), "index_n_heads"),
    (lambda t: t["sparse_attention_config"]["sparse_disable_index_value"].__setitem__(5, 0), "index value head"),
    (lambda t: t["sparse_attention_config"].update(sparse_attention_freq=[1] * 59), "num_hidden_layers"),
    (lambda t: t.update(moe_layer_freq=[1] * 61), "num_hidden_layers"),
    (lambda t: t.update(scoring_func="softmax"), "scoring_func"),
    (lambda t: t.update(hidden_act="gelu"), "hidden_act"),
    (lambda t: t.update(rotary_dim=63, partial_rotary_factor=None), "rotary_dim"),
    (lambda t: t.update(rotary_dim=32), "partial_rotary_factor"),
    (lambda t: t.update(qk_norm_type="per_layer"), "qk_norm_type"),
    (lambda t: t.update(tie_word_embeddings=True), "tie_word_embeddings"),
    (lambda t: t.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope"),
    (lambda t: t["sparse_attention_config"].update(sparse_local_block=0), "local_blocks"),
    (lambda t: t["sparse_attention_config"].update(sparse_topk_blocks=0), "topk_blocks"),
    (lambda t: t.update(num_experts_per_tok=200), "num_experts_per_tok"),
    (lambda t: t.update(index_block_size=64), "index_block_size"),
])
def test_bad_config_names_field(mutate, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        M3Config.from_dict(_bad(mutate))


def test_bad_dataclass_values() -> None:
    with pytest.raises(ValueError, match="index_n_heads"):
        small_cfg(index_n_heads=4)
    with pytest.raises(ValueError, match="moe_layer_freq"):
        small_cfg(moe_layer_freq=[1, 1, 1])
    with pytest.raises(ValueError, match="rotary_dim"):
        small_cfg(rotary_dim=32)
    with pytest.raises(FileNotFoundError):
        M3Config.from_pretrained("/nonexistent/folder")


# -- meta builds ----------------------------------------------------------------------------------


def test_flash_builds_on_meta_with_cost_counts() -> None:
    cfg = M3Config.preset(FLASH)
    with torch.device("meta"):
        model = M3ForCausalLM(cfg)
    c = model.parameter_counts()
    assert c["routed_experts"] == 413_122_166_784
    assert c["mxfp8_group"] == 10_560_208_896
    assert c["embeddings_and_head"] == 2_458_386_432
    assert c["router"] == 44_826_624
    s = cfg.to_shape()
    assert c["norms"] == cost.norm_params(s) and c["router_bias"] == cost.router_bias_params(s)
    assert c["total"] == cost.total_params(s)
    assert model.model.layers[0].self_attn.index_branch and model.model.layers[0].is_moe is False


def test_m3_builds_on_meta_with_cost_counts() -> None:
    cfg = M3Config.preset(M3)
    with torch.device("meta"):
        model = M3ForCausalLM(cfg)
    s = cost.ModelShape.from_config(fixture_config(M3))
    c = model.parameter_counts()
    assert c["routed_experts"] == cost.routed_expert_params(s)
    assert c["mxfp8_group"] == cost.mxfp8_group_params(s)
    assert c["embeddings_and_head"] == cost.embedding_params(s)
    assert c["router"] == cost.router_params(s)
    assert c["total"] == cost.total_params(s)
    layers = model.model.layers
    assert not hasattr(layers[2].self_attn, "index_q_proj") and hasattr(layers[3].self_attn, "index_q_proj")
    assert layers[2].self_attn.mode == "dense" and layers[3].self_attn.mode == "sparse"


# -- forward / backward ---------------------------------------------------------------------------


def test_tiny_forward_backward() -> None:
    cfg = M3Config.preset("tiny")
    model = make(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 40))
    out = model(ids, labels=ids)
    assert out.logits.shape == (2, 40, cfg.vocab_size) and out.logits.dtype == torch.float32
    assert out.loss.shape == () and torch.isfinite(out.loss)
    assert out.loss.item() == pytest.approx(torch.log(torch.tensor(float(cfg.vocab_size))).item(), rel=0.05)
    assert out.kl.shape == () and out.kl.item() > 0
    assert out.expert_load.shape == (3, 8) and out.expert_load.dtype == torch.float32
    assert out.expert_load.sum(1).tolist() == [2 * 40 * 2] * 3
    (out.loss + out.kl).backward()
    for name, p in model.named_parameters():
        if name.endswith("e_score_correction_bias"):
            assert p.grad is None
        else:
            assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_kl_reaches_index_branch_only() -> None:
    model = make(small_cfg())
    ids = torch.randint(0, 256, (1, 30))
    out = model(ids, labels=ids)
    attn = model.model.layers[1].self_attn
    g = torch.autograd.grad(out.kl, [attn.index_q_proj.weight, attn.q_proj.weight, model.model.embed_tokens.weight],
                            allow_unused=True)
    assert g[0] is not None and g[0].abs().sum() > 0
    assert g[1] is None or g[1].abs().sum() == 0
    assert g[2] is None or g[2].abs().sum() == 0
    g = torch.autograd.grad(out.loss, [attn.index_q_proj.weight, attn.q_proj.weight], allow_unused=True)
    assert (g[0] is None or g[0].abs().sum() == 0) and g[1].abs().sum() > 0
    assert model(ids, compute_kl=False).kl.item() == 0.0


def test_modes_and_dense_layers() -> None:
    cfg = small_cfg(sparse_attention_freq=[0, 1])
    model = make(cfg)
    assert not model.model.layers[0].self_attn.index_branch
    ids = torch.randint(0, 256, (2, 40))
    sparse = model(ids).logits
    model.set_attention_mode("dense")
    assert model.attention_mode == "dense" and model.model.layers[1].self_attn.mode == "dense"
    dense = model(ids).logits
    # rows within the first topk * block = 16 tokens see every block: identical; later rows differ
    torch.testing.assert_close(sparse[:, :16], dense[:, :16])
    assert (sparse[:, 20:] - dense[:, 20:]).abs().max() > 1e-4
    with pytest.raises(ValueError, match="mode"):
        model.set_attention_mode("fast")
    with pytest.raises(ValueError, match="index_branch"):
        model.model.layers[0].self_attn.mode = "sparse"
    out = model(ids, return_attn_inputs=True)
    a0, a1 = out.attn_inputs
    assert a0["q_idx"] is None and a0["block_idx"] is None
    assert a1["q"].shape == (2, 40, 4, 16) and a1["k"].shape == (2, 40, 2, 16)
    assert a1["q_idx"].shape == (2, 40, 2, 16) and a1["k_idx"].shape == (2, 40, 16)
    assert a1["block_idx"].shape == (2, 2, 40, 2) and a1["block_idx"].dtype == torch.int32
    assert (a1["block_size"], a1["topk"], a1["local_blocks"], a1["init_blocks"]) == (8, 2, 1, 0)


def test_packed_documents_equal_separate_runs() -> None:
    model = make(small_cfg())
    a, b = torch.randint(0, 256, (1, 21)), torch.randint(0, 256, (1, 19))
    packed = torch.cat([a, b], dim=1)
    cu = torch.tensor([0, 21, 40], dtype=torch.int32)
    out = model(packed, labels=packed, cu_seqlens=cu)
    oa, ob = model(a, labels=a), model(b, labels=b)
    torch.testing.assert_close(out.logits[:, :21], oa.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.logits[:, 21:], ob.logits, rtol=1e-5, atol=1e-5)
    want_loss = (oa.loss * 20 + ob.loss * 18) / 38  # the cross-document target is ignored
    torch.testing.assert_close(out.loss, want_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.kl, (oa.kl * 21 + ob.kl * 19) / 40, rtol=1e-5, atol=1e-6)
    inp = model(packed, cu_seqlens=cu, return_attn_inputs=True).attn_inputs[0]
    assert inp["cu_seqlens"].tolist() == [0, 21, 40]
    torch.testing.assert_close(inp["block_idx"][:, :, 21:], model(b, return_attn_inputs=True).attn_inputs[0]["block_idx"])
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(packed, cu_seqlens=torch.tensor([0, 21, 39], dtype=torch.int32))


def test_labels_ignore_and_hidden_states() -> None:
    model = make(small_cfg())
    ids = torch.randint(0, 256, (2, 12))
    labels = ids.clone()
    labels[:, :6] = -100
    out = model(ids, labels=labels, output_hidden_states=True)
    lg = out.logits[:, 5:-1].reshape(-1, 256)
    torch.testing.assert_close(out.loss, torch.nn.functional.cross_entropy(lg, ids[:, 6:].reshape(-1)))
    assert len(out.hidden_states) == 3
    all_ignored = model(ids, labels=torch.full_like(ids, -100)).loss
    assert all_ignored.item() == 0.0


def test_update_routing_bias() -> None:
    model = make(small_cfg(num_hidden_layers=3))
    ids = torch.randint(0, 256, (2, 16))
    out = model(ids)
    model.update_routing_bias(out.expert_load, rate=0.01)
    for moe, load in zip(model.moe_layers(), out.expert_load):
        torch.testing.assert_close(moe.e_score_correction_bias, 0.01 * torch.sign(load.mean() - load))
    with pytest.raises(ValueError, match="expert_load"):
        model.update_routing_bias(torch.zeros(5, 4))


def test_gradient_checkpointing_same_grads() -> None:
    model = make(small_cfg())
    ids = torch.randint(0, 256, (1, 24))
    out = model(ids, labels=ids)
    g1 = torch.autograd.grad(out.loss + out.kl, list(model.parameters())[:6])
    model.gradient_checkpointing_enable()
    out2 = model(ids, labels=ids)
    g2 = torch.autograd.grad(out2.loss + out2.kl, list(model.parameters())[:6])
    torch.testing.assert_close(out.loss, out2.loss)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)


def test_cpu_autocast_bf16() -> None:
    model = make(small_cfg())
    ids = torch.randint(0, 256, (1, 20))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, labels=ids)
    assert torch.isfinite(out.loss) and torch.isfinite(out.kl)
    out.loss.backward()


# -- save / load ----------------------------------------------------------------------------------


def test_save_load_bit_identical(tmp_path: Path) -> None:
    model = make(small_cfg(num_hidden_layers=3, sparse_attention_freq=[0, 1, 1]))
    with torch.no_grad():
        for moe in model.moe_layers():
            moe.e_score_correction_bias.normal_()
    model.save_pretrained(tmp_path)
    assert (tmp_path / SINGLE_FILE).is_file() and (tmp_path / "config.json").is_file()
    from safetensors import safe_open

    with safe_open(str(tmp_path / SINGLE_FILE), framework="pt") as f:
        names = set(f.keys())
    for n in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
              "model.layers.0.mlp.gate_proj.weight", "model.layers.0.self_attn.q_norm.weight",
              "model.layers.1.self_attn.index_q_proj.weight", "model.layers.1.self_attn.index_k_norm.weight",
              "model.layers.1.block_sparse_moe.gate.weight", "model.layers.1.block_sparse_moe.e_score_correction_bias",
              "model.layers.2.block_sparse_moe.experts.3.w2.weight",
              "model.layers.2.block_sparse_moe.shared_experts.down_proj.weight"):
        assert n in names, n
    assert "model.layers.0.self_attn.index_q_proj.weight" not in names
    with safe_open(str(tmp_path / SINGLE_FILE), framework="pt") as f:
        assert f.get_tensor("model.layers.1.block_sparse_moe.experts.0.w1.weight").shape == (32, 64)
        assert f.get_tensor("model.layers.1.block_sparse_moe.experts.0.w2.weight").shape == (64, 32)
    loaded = M3ForCausalLM.from_pretrained(tmp_path)
    assert loaded.config == model.config.replace(torch_dtype="float32")
    ids = torch.randint(0, 256, (2, 30))
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    for (n1, t1), (n2, t2) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and torch.equal(t1, t2)
    bf = M3ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert bf.lm_head.weight.dtype == torch.bfloat16
    assert bf.moe_layers()[0].gate.weight.dtype == torch.float32


def test_sharded_roundtrip(tmp_path: Path) -> None:
    model = make(small_cfg())
    model.save_pretrained(tmp_path, max_shard_size=40_000)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 2 and not (tmp_path / SINGLE_FILE).exists()
    assert set(index["weight_map"]) == {n for n, _ in hf_state_items(model)}
    loaded = M3ForCausalLM.from_pretrained(tmp_path)
    ids = torch.randint(0, 256, (1, 20))
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    model.save_pretrained(tmp_path)  # back to one file: the old shards are removed
    assert (tmp_path / SINGLE_FILE).is_file() and not (tmp_path / INDEX_FILE).exists()
    assert not list(tmp_path.glob("model-*-of-*.safetensors"))


def test_load_prefix_and_errors(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    model = make(small_cfg())
    model.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / SINGLE_FILE))
    # the VL checkpoint form: language_model. prefix, plus vision tensors the text model skips
    vl = {f"language_model.{k}": v for k, v in tensors.items()}
    vl["vision_tower.patch_embed.weight"] = torch.zeros(2)
    save_file(vl, str(tmp_path / SINGLE_FILE))
    ids = torch.randint(0, 256, (1, 10))
    assert torch.equal(M3ForCausalLM.from_pretrained(tmp_path)(ids).logits, model(ids).logits)

    def check(mutate, pattern: str) -> None:
        t = dict(tensors)
        mutate(t)
        save_file(t, str(tmp_path / SINGLE_FILE))
        with pytest.raises(ValueError, match=pattern):
            M3ForCausalLM.from_pretrained(tmp_path)

    check(lambda t: t.pop("model.layers.1.block_sparse_moe.experts.2.w3.weight"), r"missing .*experts\.2\.w3")
    check(lambda t: t.update({"model.layers.1.extra.weight": torch.zeros(1)}), r"unexpected .*extra")
    check(lambda t: t.update({"lm_head.weight": torch.zeros(3, 3)}), r"shape mismatch .*lm_head")
