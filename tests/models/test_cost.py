"""Tests for msakit.cost: the published M3 / M3.1-Flash figures (MSA paper, M3.1-Flash brief) for the two fixtures."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from msakit import cost
from msakit.cli import main
from msakit.cost import ModelShape

REPO = Path(__file__).resolve().parents[2]
FLASH = "minimax-m3.1-flash"
M3 = "minimax-m3"
N128K = 131_072
N1M = 1_048_576


def fixture_config(name: str) -> Path:
    """The fixture's config.json in tests/fixtures."""
    path = REPO / "tests" / "fixtures" / name / "config.json"
    assert path.is_file(), f"fixture {path} is missing"
    return path


@pytest.fixture(scope="module")
def flash() -> ModelShape:
    return ModelShape.from_config(fixture_config(FLASH))


@pytest.fixture(scope="module")
def m3() -> ModelShape:
    return ModelShape.from_config(fixture_config(M3))


def _raw(name: str) -> dict[str, Any]:
    return json.loads(fixture_config(name).read_text())


def _flat_transformers(name: str) -> dict[str, Any]:
    """The same model written with the transformers flat names and no legacy fields."""
    text = copy.deepcopy(_raw(name)["text_config"])
    sac = text.pop("sparse_attention_config")
    moe = text.pop("moe_layer_freq")
    text.update(
        index_n_heads=sac["sparse_num_index_heads"],
        index_head_dim=sac["sparse_index_dim"],
        index_block_size=sac["sparse_block_size"],
        index_topk_blocks=sac["sparse_topk_blocks"],
        index_local_blocks=sac["sparse_local_block"],
        layer_types=["minimax_m3_sparse" if f else "full_attention"
                     for f in sac["sparse_attention_freq"]],
        mlp_layer_types=["sparse" if f else "dense" for f in moe],
    )
    return text


def _same_numbers(a: ModelShape, b: ModelShape) -> None:
    ra, rb = cost.report(a), cost.report(b)
    ra["config"].pop("name")
    rb["config"].pop("name")
    assert ra == rb


# ---------------------------------------------------------------- the fixture copies


@pytest.mark.parametrize("name", [M3, FLASH])
def test_fixture_copies_match_package_data(name: str) -> None:
    """The presets read msakit/models/configs/*.json; the tests read tests/fixtures: the same config."""
    package = REPO / "msakit" / "models" / "configs" / f"{name}.json"
    assert json.loads(fixture_config(name).read_text()) == json.loads(package.read_text())


# ---------------------------------------------------------------- config parsing


def test_shapes(flash: ModelShape, m3: ModelShape) -> None:
    for s in (flash, m3):
        assert (s.vocab_size, s.hidden_size, s.num_layers) == (200_064, 6_144, 60)
        assert (s.num_heads, s.num_kv_heads, s.head_dim) == (64, 4, 128)
        assert (s.index_n_heads, s.index_head_dim, s.block_size, s.topk) == (4, 128, 128, 16)
        assert (s.local_blocks, s.init_blocks) == (1, 0)
        assert (s.num_experts, s.top_k, s.expert_intermediate_size) == (128, 4, 3_072)
        assert (s.n_shared_experts, s.shared_intermediate_size) == (1, 3_072)
        assert s.dense_intermediate_size == 12_288
        assert s.num_moe_layers == 57 and s.moe_layers[:3] == (False,) * 3
        assert not s.tie_word_embeddings
    assert flash.num_sparse_layers == 60
    assert m3.num_sparse_layers == 57 and m3.sparse_layers[:4] == (False, False, False, True)
    assert m3.all_sparse().sparse_layers == flash.sparse_layers


def test_folder_file_and_dict_agree(flash: ModelShape) -> None:
    path = fixture_config(FLASH)
    by_dir = ModelShape.from_config(path.parent)
    by_dict = ModelShape.from_config(_raw(FLASH))
    assert by_dir == flash
    _same_numbers(by_dict, flash)
    assert by_dict.name == ""


@pytest.mark.parametrize("name", [M3, FLASH])
def test_flat_transformers_config_matches_legacy(name: str) -> None:
    legacy = ModelShape.from_config(fixture_config(name))
    flat = _flat_transformers(name)
    _same_numbers(ModelShape.from_config(flat), legacy)
    # nested flat form, and the form transformers saves (flat + legacy, consistent)
    _same_numbers(ModelShape.from_config({"text_config": flat}), legacy)
    both = dict(_raw(name)["text_config"], **{k: v for k, v in flat.items()
                                              if k.startswith("index_") or k.endswith("types")})
    _same_numbers(ModelShape.from_config(both), legacy)
    # the legacy text_config written at top level (no nesting)
    _same_numbers(ModelShape.from_config(_raw(name)["text_config"]), legacy)


def test_moe_alias_accepted() -> None:
    flat = _flat_transformers(FLASH)
    flat["mlp_layer_types"] = ["moe" if t == "sparse" else t for t in flat["mlp_layer_types"]]
    flat["num_experts"] = flat.pop("num_local_experts")
    assert ModelShape.from_config(flat).num_moe_layers == 57
    assert ModelShape.from_config(flat).num_experts == 128


def test_missing_file_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        ModelShape.from_config(tmp_path / "nope.json")
    with pytest.raises(FileNotFoundError):
        ModelShape.from_config(tmp_path)  # a folder without config.json


def test_bad_json_raises_value_error(tmp_path: Path) -> None:
    p = tmp_path / "config.json"
    p.write_text("{not json")
    with pytest.raises(ValueError, match="JSON"):
        ModelShape.from_config(p)


@pytest.mark.parametrize("field", ["hidden_size", "num_key_value_heads", "head_dim",
                                   "vocab_size", "num_hidden_layers", "intermediate_size",
                                   "num_local_experts", "num_experts_per_tok",
                                   "dense_intermediate_size"])
def test_missing_field_named(field: str) -> None:
    raw = _raw(FLASH)
    del raw["text_config"][field]
    with pytest.raises(ValueError, match=field):
        ModelShape.from_config(raw)


@pytest.mark.parametrize("field", ["sparse_index_dim", "sparse_num_index_heads",
                                   "sparse_topk_blocks", "sparse_block_size"])
def test_missing_index_field_named(field: str) -> None:
    raw = _raw(FLASH)
    del raw["text_config"]["sparse_attention_config"][field]
    with pytest.raises(ValueError, match=field):
        ModelShape.from_config(raw)


def test_inconsistent_configs_raise() -> None:
    raw = _raw(FLASH)
    raw["text_config"]["moe_layer_freq"] = raw["text_config"]["moe_layer_freq"][:59]
    with pytest.raises(ValueError, match="num_hidden_layers"):
        ModelShape.from_config(raw)

    flat = _flat_transformers(FLASH)
    flat["layer_types"][0] = "sliding_window"
    with pytest.raises(ValueError, match="layer_types"):
        ModelShape.from_config(flat)

    both = _raw(M3)["text_config"]
    both["layer_types"] = ["minimax_m3_sparse"] * 60  # legacy freq says layers 0-2 are dense
    with pytest.raises(ValueError, match="disagree"):
        ModelShape.from_config(both)

    both = _raw(FLASH)["text_config"]
    both["index_topk_blocks"] = 8
    with pytest.raises(ValueError, match="index_topk_blocks"):
        ModelShape.from_config(both)

    raw = _raw(FLASH)
    raw["text_config"]["num_experts_per_tok"] = 129
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelShape.from_config(raw)


# ---------------------------------------------------------------- parameter counts (exact)


def test_pinned_parameter_counts(flash: ModelShape) -> None:
    assert cost.routed_expert_params(flash) == 413_122_166_784
    assert cost.mxfp8_group_params(flash) == 10_560_208_896
    assert cost.embedding_params(flash) == 2_458_386_432
    assert cost.router_params(flash) == 44_826_624
    # the pieces of the MXFP8 group; the index projections are part of it
    assert cost.attention_params(flash) == 6_417_285_120
    assert cost.index_params(flash) == 235_929_600 == 60 * 6_144 * (4 * 128 + 128)
    assert cost.shared_expert_params(flash) == 3_227_516_928
    assert cost.dense_mlp_params(flash) == 679_477_248
    # norms are reported apart and are tiny
    assert cost.norm_params(flash) == 60 * (2 * 6_144 + 2 * 128 + 2 * 128) + 6_144
    assert cost.router_bias_params(flash) == 57 * 128
    assert round(cost.routed_expert_params(flash) / cost.total_params(flash), 2) == 0.97


def test_m3_parameter_counts(m3: ModelShape, flash: ModelShape) -> None:
    # M3's three dense-attention layers have no index projections
    assert cost.routed_expert_params(m3) == 413_122_166_784
    assert cost.index_params(m3) == 57 * 6_144 * 640
    assert cost.mxfp8_group_params(m3) == 10_560_208_896 - 3 * 6_144 * 640


def test_tied_embeddings_halve(flash: ModelShape) -> None:
    import dataclasses
    tied = dataclasses.replace(flash, tie_word_embeddings=True)
    assert cost.embedding_params(tied) == 2_458_386_432 // 2


def test_active_parameters(flash: ModelShape) -> None:
    assert cost.active_routed_params(flash) == 57 * 4 * 3 * 6_144 * 3_072 == 12_910_067_712
    assert round(cost.active_params_per_token(flash) / 1e9, 1) == 23.5
    assert cost.active_params_per_token(flash, include_small=False) == (
        10_560_208_896 + 12_910_067_712 + 44_826_624)
    # "the rest of the network costs about 47 GFLOPs per token"
    assert cost.linear_flops_per_token(flash) / 1e9 == pytest.approx(47.0, abs=0.05)


# ---------------------------------------------------------------- attention FLOPs


def test_attention_flops(flash: ModelShape) -> None:
    assert cost.dense_attention_flops(flash, N128K) == 16_384 * N128K
    assert cost.msa_attention_flops(flash, N128K) == 512 * N128K + 67_108_864
    assert cost.dense_attention_flops(flash, N128K) / 1e9 == pytest.approx(2.15, abs=0.005)
    assert cost.msa_attention_flops(flash, N128K) / 1e9 == pytest.approx(0.13, abs=0.005)
    assert cost.dense_attention_flops(flash, N1M) / 1e9 == pytest.approx(17.2, abs=0.05)
    assert cost.msa_attention_flops(flash, N1M) / 1e9 == pytest.approx(0.60, abs=0.005)
    assert cost.attention_flop_ratio(flash, N128K) == pytest.approx(16.0, abs=0.05)
    assert cost.attention_flop_ratio(flash, N1M) == pytest.approx(28.4, abs=0.05)
    assert cost.attention_flop_ratio_limit(flash) == 32.0
    # the index branch is about 8/9 of MSA at 1M
    idx = 512 * N1M / cost.msa_attention_flops(flash, N1M)
    assert idx == pytest.approx(8 / 9, abs=0.01)


def test_dense_layers_share(m3: ModelShape, flash: ModelShape) -> None:
    mm = cost.model_attention_flops(m3, N1M)
    assert mm["dense_layers"] / 1e9 == pytest.approx(51.5, abs=0.05)
    assert mm["sparse_layers"] / 1e9 == pytest.approx(34.4, abs=0.05)
    assert mm["total"] / 1e9 == pytest.approx(86.0, abs=0.05)
    assert cost.model_attention_flops(flash, N1M)["total"] / 1e9 == pytest.approx(36.2, abs=0.05)
    assert cost.dense_layer_share(m3, N1M) == pytest.approx(0.60, abs=0.005)
    assert cost.dense_layer_share(m3, N128K) == pytest.approx(0.46, abs=0.005)
    assert cost.all_sparse_saving(m3, N1M) == pytest.approx(2.4, abs=0.05)
    assert cost.all_sparse_saving(m3, N128K) == pytest.approx(1.75, abs=0.05)
    assert cost.dense_layer_share(flash, N1M) == 0.0
    assert cost.all_sparse_saving(flash, N1M) == 1.0
    assert cost.all_sparse_saving(flash, N128K) == 1.0


# ---------------------------------------------------------------- decode, KV cache, experts


def test_decode_reads(flash: ModelShape) -> None:
    assert cost.dense_decode_reads(flash, N1M) == 1_024 * N1M  # 1,074 M
    assert cost.msa_decode_reads(flash, N1M) == 128 * N1M + 2_097_152  # 136 M
    assert cost.dense_decode_reads(flash, N1M) / 1e6 == pytest.approx(1_074, abs=0.5)
    assert cost.msa_decode_reads(flash, N1M) / 1e6 == pytest.approx(136, abs=0.5)
    assert cost.decode_read_ratio(flash, N1M) == pytest.approx(7.9, abs=0.05)


def test_kv_cache(flash: ModelShape, m3: ModelShape) -> None:
    assert cost.kv_cache_values_per_token(flash) == 69_120
    assert cost.kv_cache_values_per_token(m3) == 57 * 1_152 + 3 * 1_024  # no index key in dense
    assert cost.kv_cache_values_per_token(flash) * 2 == 138_240  # "138 KB per token"
    gb = cost.kv_cache_bytes(flash, N1M) / cost.GB
    assert cost.GB == 1e9
    assert gb == pytest.approx(144.96, abs=0.01)  # "about 145 GB"
    assert cost.kv_cache_bytes(flash, N1M, 1.0) / cost.GB == pytest.approx(gb / 2)


def test_expert_bytes(flash: ModelShape) -> None:
    e = cost.expert_bytes_per_token(flash)
    assert e["active_routed_params"] == 12_910_067_712  # "12.9B parameters"
    assert e["bf16_bytes"] / 1e9 == pytest.approx(25.8, abs=0.05)
    assert e["nvfp4_packed_bytes"] / 1e9 == pytest.approx(6.5, abs=0.05)
    assert e["nvfp4_scale_bytes"] == e["active_routed_params"] / 16
    assert e["nvfp4_total_bytes"] == e["nvfp4_packed_bytes"] + e["nvfp4_scale_bytes"]
    assert e["ratio_bf16_to_packed"] == 4.0


# ---------------------------------------------------------------- report and CLI


def test_report_structure(m3: ModelShape) -> None:
    r = cost.report(m3, 200_000)
    json.dumps(r)  # serialisable
    assert [row["context"] for row in r["table"]] == [16_384, 131_072, 200_000, 1_048_576]
    assert r["parameters"]["routed_experts"] == 413_122_166_784
    assert r["attention_flops_per_token"]["context"] == 200_000
    assert r["units"]["GB"] == "1e9 bytes"
    text = cost.format_report(r)
    assert "200,000" in text and "1,048,576" in text and "131,072" in text
    with pytest.raises(ValueError):
        cost.report(m3, 0)


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cost", "--config", str(fixture_config(FLASH)), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    p = r["parameters"]
    assert p["routed_experts"] == 413_122_166_784
    assert p["mxfp8_group"]["total"] == 10_560_208_896
    assert p["embeddings_and_head"] == 2_458_386_432
    assert p["router"] == 44_826_624
    assert r["context"] == N1M
    assert r["attention_flops_per_token"]["ratio"] == pytest.approx(28.4, abs=0.05)
    assert r["decode_reads_per_step"]["ratio"] == pytest.approx(7.9, abs=0.05)
    assert r["kv_cache"]["values_per_token"] == 69_120
    table = {row["context"]: row for row in r["table"]}
    assert table[N128K]["flop_ratio"] == pytest.approx(16.0, abs=0.05)


def test_cli_text_m3(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cost", "--config", str(fixture_config(M3).parent), "--context", "65536"]) == 0
    out = capsys.readouterr().out
    for s in ("413,122,166,784", "65,536", "131,072", "1,048,576", "60.0 %", "2.37 x",
              "28.4 x", "7.9 x", "68,736", "GB"):
        assert s in out, s


def test_cli_missing_file_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cost", "--config", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("msakit cost: error:") and "\n" not in err


def test_cli_bad_config_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raw = _raw(FLASH)
    del raw["text_config"]["hidden_size"]
    p = tmp_path / "config.json"
    p.write_text(json.dumps(raw))
    assert main(["cost", "--config", str(p)]) == 2
    assert "hidden_size" in capsys.readouterr().err


def test_cli_requires_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cost"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--config" in err and "\n" not in err


# Dense HF configs as transformers saves them (no expert fields, no head_dim): Llama-3.1-8B and
# Qwen2-0.5B. Their published parameter counts are 8,030,261,248 and 494,032,768; the cost
# model counts no biases, and Qwen2's q/k/v biases are 24 * (896 + 2 * 128) = 27,648.
LLAMA_31_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
               "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
               "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
               "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
               "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
QWEN2_05B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
             "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
             "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
             "max_window_layers": 24, "sliding_window": 32768, "use_sliding_window": False,
             "tie_word_embeddings": True, "torch_dtype": "bfloat16"}


@pytest.mark.parametrize("raw, total", [(LLAMA_31_8B, 8_030_261_248),
                                        (QWEN2_05B, 494_032_768 - 27_648)])
def test_dense_hf_config_is_dense_with_no_experts(raw: dict[str, Any], total: int) -> None:
    s = ModelShape.from_config(raw)
    assert (s.num_moe_layers, s.num_experts, s.top_k, s.n_shared_experts) == (0, 0, 0, 0)
    assert s.num_dense_mlp_layers == s.num_layers == raw["num_hidden_layers"]
    assert s.dense_intermediate_size == raw["intermediate_size"]
    assert s.head_dim == raw["hidden_size"] // raw["num_attention_heads"]
    assert s.num_sparse_layers == 0 and not s.use_qk_norm
    assert cost.total_params(s) == total
    assert cost.routed_expert_params(s) == cost.router_params(s) == cost.router_bias_params(s) == 0
    assert cost.active_routed_params(s) == 0


def test_cli_dense_hf_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_31_8B))
    assert main(["cost", "--config", str(tmp_path), "--context", "8192"]) == 0
    out = capsys.readouterr().out
    assert "FFN 0 MoE + 32 dense" in out and "8,030,261,248" in out
    assert main(["cost", "--config", str(tmp_path), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["parameters"]["routed_experts"] == 0 and r["config"]["num_experts"] == 0
    assert "msa_per_layer" not in r["attention_flops_per_token"]


def test_dense_hf_config_needs_its_fields() -> None:
    raw = dict(LLAMA_31_8B, hidden_size=4100)  # not a multiple of the heads: head_dim unknown
    with pytest.raises(ValueError, match="head_dim"):
        ModelShape.from_config(raw)
    raw = {k: v for k, v in LLAMA_31_8B.items() if k != "intermediate_size"}
    with pytest.raises(ValueError, match="intermediate_size"):
        ModelShape.from_config(raw)
    # naming experts makes it a MoE config again (transformers' M3 default: every layer MoE),
    # which must give head_dim and the routing fields
    with pytest.raises(ValueError, match="head_dim"):
        ModelShape.from_config(dict(LLAMA_31_8B, num_local_experts=8))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelShape.from_config(dict(LLAMA_31_8B, num_local_experts=8, head_dim=128))


def test_module_does_not_import_torch() -> None:
    code = "import sys, msakit.cost; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# ---------------------------------------------------------------- properties


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=1 << 24),
    dn=st.integers(min_value=1, max_value=1 << 24),
    kv=st.sampled_from([1, 2, 4, 8]),
    group=st.sampled_from([1, 4, 8, 16]),
    dh=st.sampled_from([64, 128, 256]),
    didx=st.sampled_from([32, 64, 128]),
    k=st.integers(min_value=1, max_value=64),
    bk=st.sampled_from([16, 32, 64, 128]),
)
def test_ratios_increase_with_context_and_stay_below_limit(
        n: int, dn: int, kv: int, group: int, dh: int, didx: int, k: int, bk: int) -> None:
    s = ModelShape(vocab_size=1000, hidden_size=1024, num_layers=4, num_heads=kv * group,
                   num_kv_heads=kv, head_dim=dh, expert_intermediate_size=256, num_experts=8,
                   top_k=2, sparse_layers=(False, True, True, True), moe_layers=(True,) * 4,
                   index_n_heads=kv, index_head_dim=didx, block_size=bk, topk=k)
    n2 = n + max(dn, n // 4096)  # a step large enough for float64 to resolve
    limit = cost.attention_flop_ratio_limit(s)
    r1, r2 = cost.attention_flop_ratio(s, n), cost.attention_flop_ratio(s, n2)
    assert 0 < r1 < r2 < limit
    d1, d2 = cost.decode_read_ratio(s, n), cost.decode_read_ratio(s, n2)
    assert 0 < d1 < d2 < 2 * kv * dh / didx
    share1, share2 = cost.dense_layer_share(s, n), cost.dense_layer_share(s, n2)
    assert 0 < share1 < share2 < 1
    assert cost.all_sparse_saving(s, n2) > cost.all_sparse_saving(s, n) > 0
