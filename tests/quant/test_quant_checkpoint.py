"""The ModelOpt MIXED_PRECISION checkpoint layout (msakit.quant.checkpoint): tensor names, dtypes
and shapes, bit-exact round trips, the fixture's rule form, frozen foreign scales, errors."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from msakit.generate import generate
from msakit.models import M3Config, M3ForCausalLM
from msakit.quant import convert, load_for_qat, load_quantized, prepare_qat, save_quantized
from msakit.quant.qat import qat_state
from msakit.quant.linear import mxfp8_quantize_with_scales, nvfp4_quantize_with_scales, unpack_weight

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
L1 = "model.layers.1"
EXP = f"{L1}.block_sparse_moe.experts"


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def same_files(a: Path, b: Path) -> None:
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape, k
        assert torch.equal(bits(ta[k]), bits(tb[k])), k


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A QAT model after one optimizer step, saved once."""
    torch.manual_seed(0)
    m = M3ForCausalLM(M3Config.preset("tiny", vocab_size=256, num_hidden_layers=2, max_position_embeddings=256))
    q = prepare_qat(m)
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(q.parameters(), lr=1e-2)
    q(ids, labels=ids).loss.backward()
    opt.step()
    d = tmp_path_factory.mktemp("ckpt") / "q"
    save_quantized(q, d)
    return q, ids, d


def test_layout_and_round_trip(trained, tmp_path):
    q, ids, d = trained
    cfg = json.loads((d / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_algo"] == "MIXED_PRECISION" and qc["quant_method"] == "modelopt" and qc["kv_cache_quant_algo"] is None
    assert qc["quantized_layers"][f"{EXP}.3.w1"] == {"quant_algo": "NVFP4", "group_size": 16}
    assert qc["quantized_layers"][f"{L1}.self_attn.index_q_proj"] == {"quant_algo": "MXFP8"}
    assert set(qc["exclude_modules"]) == {"model.embed_tokens", "lm_head", f"{L1}.block_sparse_moe.gate"}
    hf = json.loads((d / "hf_quant_config.json").read_text())
    assert hf["producer"]["name"] == "msakit" and hf["quantization"] == qc
    t = _tensors(d)
    H, I = 128, 128
    want = {
        f"{EXP}.3.w1.weight": (torch.uint8, (I, H // 2)),
        f"{EXP}.3.w1.weight_scale": (torch.float8_e4m3fn, (I, H // 16)),
        f"{EXP}.3.w1.weight_scale_2": (torch.float32, ()),
        f"{EXP}.3.w1.input_scale": (torch.float32, ()),
        f"{EXP}.3.w2.weight": (torch.uint8, (H, I // 2)),
        f"{L1}.self_attn.q_proj.weight": (torch.float8_e4m3fn, (128, H)),
        f"{L1}.self_attn.q_proj.weight_scale_inv": (torch.uint8, (128, H // 32)),
        f"{L1}.block_sparse_moe.shared_experts.down_proj.weight_scale_inv": (torch.uint8, (H, 128 // 32)),
        "model.layers.0.mlp.down_proj.weight": (torch.float8_e4m3fn, (H, 256)),
        "lm_head.weight": (torch.bfloat16, (256, H)),
        "model.embed_tokens.weight": (torch.bfloat16, (256, H)),
        f"{L1}.block_sparse_moe.gate.weight": (torch.float32, (8, H)),
        f"{L1}.block_sparse_moe.e_score_correction_bias": (torch.float32, (8,)),
        "model.norm.weight": (torch.float32, (H,)),
    }
    for k, (dt, shape) in want.items():
        assert t[k].dtype == dt and tuple(t[k].shape) == shape, k
    for e in range(8):  # w1 and w3 share one global scale per expert; M3's input_scale is 1.0
        assert torch.equal(t[f"{EXP}.{e}.w1.weight_scale_2"], t[f"{EXP}.{e}.w3.weight_scale_2"])
        assert t[f"{EXP}.{e}.w1.input_scale"] == 1.0
    # load -> the same forward as convert(QAT model); save again -> the same bits (sharded too)
    loaded = load_quantized(d)
    assert loaded.quant_report.rate() == 0.0 and loaded.quant_report.block_rate() == 0.0
    conv = convert(copy.deepcopy(q))
    with torch.no_grad():
        a, b = loaded(ids).logits, conv(ids).logits
    assert torch.equal(a, b)
    gen = generate(loaded, ids[:, :8], 3, top_k=1)  # cached decoding runs on the packed modules
    assert gen.shape == (1, 11) and torch.equal(gen[:, :8], ids[:, :8])
    save_quantized(loaded, tmp_path / "again", max_shard_size="100KB")
    assert len(list((tmp_path / "again").glob("model-*-of-*.safetensors"))) > 1
    same_files(d, tmp_path / "again")
    same_files(d, save_quantized(conv, tmp_path / "conv"))
    # load_for_qat: the QAT forward at step 0 is the checkpoint's, convert gives its bits back
    f = load_for_qat(tmp_path / "again")
    assert f.quant_report.rate() == 0.0
    with torch.no_grad():
        assert torch.equal(f(ids).logits, a)
    same_files(d, save_quantized(convert(f), tmp_path / "qat"))


def test_fixture_rule_form_and_vl_prefix(trained, tmp_path):
    q, ids, d = trained
    out = tmp_path / "rules"
    out.mkdir()
    cfg = json.loads((d / "config.json").read_text())
    fixture = json.loads((FIXTURES / "minimax-m3.1-flash" / "config.json").read_text())
    cfg["quantization_config"] = fixture["quantization_config"]
    (out / "config.json").write_text(json.dumps(cfg))
    save_file({"language_model." + k: v.contiguous() for k, v in _tensors(d).items()}, str(out / "model.safetensors"))
    a = load_quantized(out)
    b = load_quantized(d)
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)
    assert a.quantization_plan_ == b.quantization_plan_


def _off_rule_scale(A: torch.Tensor) -> torch.Tensor:
    """A global scale a few ulps above A/2688 that is not RN(x/2688) of any float32 x (e.g. what
    amax * (1/2688) gives for ~10% of tensors): our rule cannot re-derive it."""
    c = torch.tensor(2688.0)
    g = A / c
    for _ in range(16):
        g = torch.nextafter(g, torch.tensor(float("inf")))
        if (c * g) / c != g:
            return g
    raise AssertionError("no off-rule global scale near A/2688")


def test_frozen_foreign_scales(trained, tmp_path):
    q, ids, d = trained
    t = _tensors(d)
    # 1. MXFP8: scales one step larger than the rule's (codes halved): not re-derivable
    name = f"{L1}.self_attn.q_proj"
    x = unpack_weight({"weight": t[f"{name}.weight"], "weight_scale_inv": t[f"{name}.weight_scale_inv"]}, "mxfp8",
                      torch.float32)
    s_foreign = (t[f"{name}.weight_scale_inv"].to(torch.int32) + 1).to(torch.uint8)
    t[f"{name}.weight"] = mxfp8_quantize_with_scales(x, s_foreign)
    t[f"{name}.weight_scale_inv"] = s_foreign
    # 2. NVFP4 expert 2: block scales doubled (an MSE-style calibration the amax rule does not give)
    for w in ("w1", "w3"):
        k = f"{EXP}.2.{w}"
        tens = {s: t[f"{k}.{s}"] for s in ("weight", "weight_scale", "weight_scale_2")}
        xw = unpack_weight(tens, "nvfp4", torch.float32)
        bs2 = (tens["weight_scale"].float() * 2).clamp(max=448).to(torch.float8_e4m3fn)
        t[f"{k}.weight"] = nvfp4_quantize_with_scales(xw, bs2, tens["weight_scale_2"])
        t[f"{k}.weight_scale"] = bs2
    # 3. NVFP4 expert 5 w2: a global scale a few ulps off amax/2688, one no amax gives
    k = f"{EXP}.5.w2"
    w2 = q.model.layers[1].block_sparse_moe.experts.w2[5].detach()
    w2 = w2 * (0.07 / w2.abs().max())  # amax mantissa 1.12: the scales near amax/2688 have gaps
    g_off = _off_rule_scale(w2.abs().max())
    from msakit.quant.linear import nvfp4_quantize_grouped

    p5, b5 = nvfp4_quantize_grouped(w2.unsqueeze(0), g_off.reshape(1))
    t[k + ".weight"], t[k + ".weight_scale"], t[k + ".weight_scale_2"] = p5[0], b5[0], g_off.reshape(())
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    for f in ("config.json", "hf_quant_config.json"):
        shutil.copy(d / f, foreign / f)
    save_file({k: v.contiguous() for k, v in t.items()}, str(foreign / "model.safetensors"))

    rep = load_quantized(foreign).quant_report
    assert rep.frozen == {"nvfp4": 3, "mxfp8": 1}
    assert set(rep.frozen_names) == {name, f"{EXP}.2.w1", f"{EXP}.2.w3", f"{EXP}.5.w2"}
    assert rep.nudged >= 1 and rep.nudged_blocks >= 1  # MXFP8 blocks with largest code 224
    assert 0 < rep.rate() < 0.15 and rep.block_rate() > 0
    packed = load_quantized(foreign)
    f = load_for_qat(foreign)
    with torch.no_grad():
        assert torch.equal(f(ids).logits, packed(ids).logits)
    same_files(foreign, save_quantized(convert(copy.deepcopy(f)), tmp_path / "back"))
    # train: the frozen scales stay, the others follow the weights
    opt = torch.optim.SGD(f.parameters(), lr=5.0)
    f(ids, labels=ids).loss.backward()
    opt.step()
    after = _tensors(save_quantized(f, tmp_path / "after"))
    assert torch.equal(after[f"{name}.weight_scale_inv"], s_foreign)
    assert not torch.equal(bits(after[f"{name}.weight"]), bits(t[f"{name}.weight"]))
    for w in ("w1", "w3"):
        assert torch.equal(bits(after[f"{EXP}.2.{w}.weight_scale"]), bits(t[f"{EXP}.2.{w}.weight_scale"]))
        assert torch.equal(after[f"{EXP}.2.{w}.weight_scale_2"], t[f"{EXP}.2.{w}.weight_scale_2"])
    k_scale = f"{L1}.self_attn.k_proj.weight_scale_inv"
    assert not torch.equal(after[f"{EXP}.1.w1.weight_scale_2"], t[f"{EXP}.1.w1.weight_scale_2"]) or \
        not torch.equal(after[k_scale], t[k_scale])
    # freeze="all" / "none"
    fa = load_for_qat(foreign, freeze="all")
    assert len(qat_state(fa).frozen) > 0
    fn = convert(load_for_qat(foreign, freeze="none"))
    assert not torch.equal(fn.model.layers[1].self_attn.q_proj.weight_scale_inv, s_foreign)


def test_errors(trained, tmp_path):
    q, ids, d = trained
    with pytest.raises(FileNotFoundError):
        load_quantized(tmp_path / "nowhere")
    plain = tmp_path / "plain"
    M3ForCausalLM(q.config).save_pretrained(plain)
    with pytest.raises(ValueError, match="not a quantized checkpoint"):
        load_quantized(plain)

    def variant(name, edit_tensors=None, edit_cfg=None):
        out = tmp_path / name
        out.mkdir()
        cfg = json.loads((d / "config.json").read_text())
        if edit_cfg:
            edit_cfg(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
        t = _tensors(d)
        if edit_tensors:
            edit_tensors(t)
        save_file({k: v.contiguous() for k, v in t.items()}, str(out / "model.safetensors"))
        return out

    miss = variant("missing", lambda t: t.pop(f"{EXP}.4.w2.weight_scale"))
    with pytest.raises(ValueError, match="missing .*experts.4.w2.weight_scale"):
        load_quantized(miss)
    extra = variant("extra", lambda t: t.__setitem__("model.layers.1.foo.weight", torch.zeros(2)))
    with pytest.raises(ValueError, match="unexpected model.layers.1.foo.weight"):
        load_quantized(extra)
    wrong = variant("dtype", lambda t: t.__setitem__(f"{L1}.self_attn.q_proj.weight",
                                                     t[f"{L1}.self_attn.q_proj.weight"].to(torch.bfloat16)))
    with pytest.raises(ValueError, match="q_proj.weight dtype BF16"):
        load_quantized(wrong)
    shape = variant("shape", lambda t: t.__setitem__(f"{EXP}.0.w1.weight_scale", torch.zeros(128, 4, dtype=torch.float8_e4m3fn)))
    with pytest.raises(ValueError, match="shape"):
        load_quantized(shape)
    nan = variant("nan", lambda t: t[f"{L1}.self_attn.v_proj.weight_scale_inv"].__setitem__((0, 0), 255))
    with pytest.raises(ValueError, match="NaN byte"):
        load_quantized(nan)
    method = variant("method", edit_cfg=lambda c: c["quantization_config"].__setitem__("quant_method", "compressed-tensors"))
    with pytest.raises(ValueError, match="unsupported quant_method"):
        load_quantized(method)
    no_in = variant("no_input_scale", lambda t: [t.pop(k) for k in [k for k in t if k.endswith("input_scale")]])
    lq = load_quantized(no_in, dtype=torch.bfloat16)  # weight-only exports: input_scale defaults to 1.0
    assert bool((lq.model.layers[1].block_sparse_moe.experts.w2_input_scale == 1).all())
    with torch.no_grad():
        assert lq(ids).logits.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="freeze"):
        load_for_qat(d, freeze="some")
    with pytest.raises(ValueError, match="own plan"):
        save_quantized(q, tmp_path / "x", plan={"lm_head": "bf16"})
