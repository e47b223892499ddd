"""Quantization plans (msakit.quant.plan): the 3.1-Flash counts on the meta device, the tiny
preset, the fixture's rule form, recipes, the stacked-expert mapping and argument errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from msakit.models import M3Config, M3ForCausalLM
from msakit.quant import (
    module_formats,
    nvfp4_scale_groups,
    plan_counts,
    plan_entries,
    plan_from_quant_config,
    plan_tensor,
    plan_to_quant_config,
    quantization_plan,
    resolve_plan,
    validate_plan,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
FLASH_COUNTS = {"nvfp4": 413_122_166_784, "mxfp8": 10_560_208_896, "bf16": 2_458_386_432, "fp32": 44_826_624}


@pytest.fixture(scope="module")
def flash():
    cfg = M3Config.preset("minimax-m3.1-flash")
    with torch.device("meta"):
        return M3ForCausalLM(cfg, init=False)


@pytest.fixture(scope="module")
def flash_plan(flash):
    return quantization_plan(flash, recipe="m3.1-flash")


def tiny(**kw):
    torch.manual_seed(0)
    return M3ForCausalLM(M3Config.preset("tiny", vocab_size=256, **kw))


def test_flash_counts_on_meta(flash, flash_plan):
    assert plan_counts(flash, flash_plan) == FLASH_COUNTS
    p = flash_plan
    assert p["model.layers.3.block_sparse_moe.experts.7.w1"] == "nvfp4"
    assert p["model.layers.59.block_sparse_moe.experts.127.w2"] == "nvfp4"
    assert p["model.layers.3.block_sparse_moe.gate"] == "fp32"
    assert p["model.layers.3.block_sparse_moe.shared_experts.down_proj"] == "mxfp8"
    assert p["model.layers.0.mlp.gate_proj"] == "mxfp8"
    assert p["model.layers.10.self_attn.index_k_proj"] == "mxfp8"
    assert p["model.layers.10.self_attn.o_proj"] == "mxfp8"
    assert p["model.embed_tokens"] == "bf16" and p["lm_head"] == "bf16"
    assert len(p) == 57 * 128 * 3 + 60 * 6 + 57 * 4 + 3 * 3 + 2
    # the same from an M3Config (built on meta inside)
    assert plan_counts(M3Config.preset("minimax-m3.1-flash"), flash_plan) == FLASH_COUNTS


def test_fixture_rule_form_gives_the_recipe(flash, flash_plan):
    raw = json.loads((FIXTURES / "minimax-m3.1-flash" / "config.json").read_text())
    assert plan_from_quant_config(raw["quantization_config"], flash) == flash_plan
    # explicit map written by plan_to_quant_config reads back to the same plan
    q = plan_to_quant_config(flash_plan)
    assert q["quant_algo"] == "MIXED_PRECISION" and q["quant_method"] == "modelopt"
    assert q["quantized_layers"]["model.layers.3.block_sparse_moe.experts.7.w1"] == {"quant_algo": "NVFP4", "group_size": 16}
    assert q["quantized_layers"]["model.layers.3.self_attn.q_proj"] == {"quant_algo": "MXFP8"}
    assert "lm_head" in q["exclude_modules"] and "model.layers.3.block_sparse_moe.gate" in q["exclude_modules"]
    assert plan_from_quant_config(q, flash) == flash_plan


def test_tiny_plan_matches_parameter_categories():
    m = tiny()
    plan = quantization_plan(m)
    c = m.parameter_counts()
    assert plan_counts(m, plan) == {"nvfp4": c["routed_experts"], "mxfp8": c["mxfp8_group"],
                                    "bf16": c["embeddings_and_head"], "fp32": c["router"]}
    validate_plan(m, plan, complete=True)
    # HF names resolve to the stacked tensors
    e = {x.name: x for x in resolve_plan(m, plan)}["model.layers.2.block_sparse_moe.experts.5.w3"]
    assert (e.module, e.param, e.expert, e.shape, e.fmt) == ("model.layers.2.block_sparse_moe.experts", "w3", 5, (128, 128), "nvfp4")
    t = plan_tensor(m, "model.layers.2.block_sparse_moe.experts.5.w3")
    stacked = m.model.layers[2].block_sparse_moe.experts.w3
    assert t.data_ptr() == stacked[5].data_ptr() and t.shape == (128, 128)
    assert plan_tensor(m, "model.layers.1.self_attn.q_proj") is m.model.layers[1].self_attn.q_proj.weight
    fm = module_formats(m, plan)
    assert fm["model.layers.1.block_sparse_moe.experts"] == {"w1": "nvfp4", "w3": "nvfp4", "w2": "nvfp4"}
    groups = nvfp4_scale_groups(plan)
    assert ("model.layers.1.block_sparse_moe.experts.0.w1", "model.layers.1.block_sparse_moe.experts.0.w3") in groups
    assert ("model.layers.1.block_sparse_moe.experts.0.w2",) in groups
    assert sum(len(g) for g in groups) == sum(f == "nvfp4" for f in plan.values())


def test_recipes():
    m = tiny()
    n = quantization_plan(m, "nvfp4-experts")
    assert {f for k, f in n.items() if ".experts." in k} == {"nvfp4"}
    assert {f for k, f in n.items() if ".experts." not in k} == {"bf16", "fp32"}
    x = quantization_plan(m, "mxfp8")
    assert {f for k, f in x.items() if ".experts." in k or "proj" in k} == {"mxfp8"}
    b = quantization_plan(m, "bf16")
    assert set(b.values()) == {"bf16", "fp32"}
    a = quantization_plan(m, "nvfp4")  # stress recipe: every stack weight NVFP4
    assert {f for k, f in a.items() if ".experts." in k or "proj" in k} == {"nvfp4"}
    assert a["lm_head"] == "bf16" and a["model.embed_tokens"] == "bf16"
    assert {f for k, f in a.items() if k.endswith("block_sparse_moe.gate")} == {"fp32"}


def test_other_config_forms():
    m = tiny()
    entries = plan_entries(m)
    vendor = {"quant_method": "mxfp8", "activation_scheme": "dynamic", "weight_block_size": [1, 32],
              "ignored_layers": ["lm_head", "model.embed_tokens", "re:.*block_sparse_moe\\.gate$"]}
    p = plan_from_quant_config(vendor, m)
    assert p == quantization_plan(m, "mxfp8")
    single = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
              "exclude_modules": ["lm_head", "*block_sparse_moe.gate", "*self_attn*", "*mlp*", "*shared_experts*"]}
    p = plan_from_quant_config(single, m)
    assert p == quantization_plan(m, "nvfp4-experts")
    # the VL prefix in explicit names
    q = plan_to_quant_config(quantization_plan(m))
    q["quantized_layers"] = {"language_model." + k: v for k, v in q["quantized_layers"].items()}
    assert plan_from_quant_config(q, m) == quantization_plan(m)
    assert len(entries) == len(quantization_plan(m))


def test_errors():
    m = tiny()
    plan = quantization_plan(m)
    with pytest.raises(ValueError, match="unknown recipe"):
        quantization_plan(m, "int4")
    with pytest.raises(ValueError, match="nn.Module"):
        quantization_plan("tiny")
    with pytest.raises(ValueError, match="does not have"):
        resolve_plan(m, {**plan, "model.layers.9.self_attn.q_proj": "mxfp8"})
    with pytest.raises(ValueError, match="format must be one of"):
        resolve_plan(m, {**plan, "lm_head": "int8"})
    with pytest.raises(ValueError, match="routers stay 'fp32'"):
        resolve_plan(m, {**plan, "model.layers.1.block_sparse_moe.gate": "mxfp8"})
    with pytest.raises(ValueError, match="embedding can only be"):
        resolve_plan(m, {**plan, "model.embed_tokens": "mxfp8"})
    with pytest.raises(ValueError, match="leaves out"):
        validate_plan(m, {k: v for k, v in plan.items() if k != "lm_head"}, complete=True)
    mixed = dict(plan)
    mixed["model.layers.1.block_sparse_moe.experts.3.w1"] = "mxfp8"
    with pytest.raises(ValueError, match="stored stacked"):
        module_formats(m, mixed)
    partial = {k: v for k, v in plan.items() if k != "model.layers.1.block_sparse_moe.experts.3.w2"}
    with pytest.raises(ValueError, match="covers 7 of the 8"):
        module_formats(m, partial)
    # K not divisible by the block: hidden 48 -> q_proj K = 48
    odd = M3ForCausalLM(M3Config.preset("tiny", vocab_size=256, hidden_size=48, rotary_dim=16), init=False)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantization_plan(odd)
    with pytest.raises(ValueError, match="unsupported quant_method"):
        plan_from_quant_config({"quant_method": "compressed-tensors"}, m)
    with pytest.raises(ValueError, match="unsupported quant_algo"):
        plan_from_quant_config({"quant_algo": "MIXED_PRECISION", "quantized_layers": {"lm_head": {"quant_algo": "INT4"}}}, m)
    with pytest.raises(ValueError, match="group_size"):
        plan_from_quant_config({"quant_algo": "MIXED_PRECISION",
                                "quantized_layers": {"lm_head": {"quant_algo": "NVFP4", "group_size": 32}}}, m)
    with pytest.raises(ValueError, match="does not have"):
        plan_from_quant_config({"quant_algo": "MIXED_PRECISION",
                                "quantized_layers": {"model.layers.7.mlp.up_proj": {"quant_algo": "MXFP8"}}}, m)
    with pytest.raises(ValueError, match="without quantized_layers"):
        plan_from_quant_config({"quant_algo": "MIXED_PRECISION"}, m)
