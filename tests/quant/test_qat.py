"""QAT (msakit.quant.qat): the straight-through estimator, once-per-step weight quantization,
convert == the QAT forward, the fused kernels against the reference, frozen scales, errors."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F

import msakit.quant.qat as qat_mod
from msakit.models import M3Config, M3ForCausalLM
from msakit.quant import (
    PackedExperts,
    PackedLinear,
    convert,
    fake_quantize_weight,
    is_qat,
    pack_weight,
    plan_tensor,
    prepare_qat,
    qat_stats,
    qat_step,
    quantization_plan,
    remove_qat,
    resolve_plan,
    unpack_weight,
)
from msakit.quant.linear import (
    mxfp8_fake_quantize_to,
    mxfp8_quantize_with_scales,
    nvfp4_fake_quantize_grouped,
    nvfp4_global_scales,
    nvfp4_quantize_grouped,
    nvfp4_quantize_with_scales,
)
from msakit.quant.qat import QATGroupedExperts, QATLinear

INTERP = os.environ.get("TRITON_INTERPRET", "0") == "1"
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


def small(layers: int = 2, vocab: int = 256, seed: int = 0) -> M3ForCausalLM:
    torch.manual_seed(seed)
    return M3ForCausalLM(M3Config.preset("tiny", vocab_size=vocab, num_hidden_layers=layers, max_position_embeddings=256))


def batch(B: int = 1, T: int = 64, vocab: int = 256, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (B, T), generator=g)


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


# ----------------------------------------------------------------------------------------------


def test_ste_gradient_is_the_gradient_wrt_the_dequantized_weight():
    """Without activation quantization the QAT forward is the model with every planned weight
    replaced by its fake-quantized value; the master weights get exactly that model's grads."""
    m = small()
    ids = batch()
    q = prepare_qat(copy.deepcopy(m), quantize_activations=False)
    ref = copy.deepcopy(m)
    plan = quantization_plan(m)
    with torch.no_grad():
        for e in resolve_plan(ref, plan):
            if e.fmt == "fp32":
                continue
            t = plan_tensor(ref, e)
            if e.expert is None or e.fmt != "nvfp4":
                t.copy_(fake_quantize_weight(t, e.fmt))
        for layer in ref.model.layers:  # NVFP4 experts: w1/w3 share a global scale per expert
            if layer.is_moe:
                ex = layer.block_sparse_moe.experts
                g13 = nvfp4_global_scales(ex.w1, ex.w3)
                for w, g in (("w1", g13), ("w3", g13), ("w2", nvfp4_global_scales(ex.w2))):
                    p = getattr(ex, w)
                    p.copy_(nvfp4_fake_quantize_grouped(p, g))
    out_q = q(ids, labels=ids)
    out_r = ref(ids, labels=ids)
    assert torch.equal(out_q.logits, out_r.logits)
    (out_q.loss + out_q.kl).backward()
    (out_r.loss + out_r.kl).backward()
    for (n, pq), (_, pr) in zip(q.named_parameters(), ref.named_parameters()):
        if pq.grad is None:
            assert pr.grad is None, n
            continue
        assert torch.equal(pq.grad, pr.grad), n


def test_activation_ste_on_one_linear():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32, bias=False)
    model = torch.nn.Sequential(lin)
    prepare_qat(model, {"0": "mxfp8"})
    assert isinstance(lin, QATLinear)
    x = (torch.randn(5, 64) * 3).requires_grad_(True)
    y = model(x)
    g = torch.randn_like(y)
    y.backward(g)
    xh = mxfp8_fake_quantize_to(x.detach())
    wh = fake_quantize_weight(lin.weight, "mxfp8")
    assert torch.equal(y, F.linear(xh, wh))
    assert torch.allclose(x.grad, g @ wh, rtol=0, atol=1e-6)
    assert torch.allclose(lin.weight.grad, g.T @ xh, rtol=0, atol=1e-6)


def test_weights_quantized_once_per_step(monkeypatch):
    import msakit.quant.linear as lin_mod

    calls = []
    real = qat_mod.fake_quantize_weight

    def counting(w, fmt, *a, **k):
        calls.append(fmt)
        return real(w, fmt, *a, **k)

    launches = []  # the kernel-level entry points (one Triton launch each on CUDA)
    for fn in ("nvfp4_fake_quantize_grouped", "mxfp8_fake_quantize_to"):
        orig = getattr(lin_mod, fn)
        monkeypatch.setattr(lin_mod, fn, lambda *a, _o=orig, _n=fn, **k: (launches.append(_n), _o(*a, **k))[1])
    monkeypatch.setattr(qat_mod, "fake_quantize_weight", counting)
    m = prepare_qat(small(layers=2))
    n_tensors = sum(len(mq._qat.formats) for mq in m.modules() if hasattr(mq, "_qat"))
    n_launch = sum(f in ("nvfp4", "mxfp8") for mq in m.modules() if hasattr(mq, "_qat") for f in mq._qat.formats.values())
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)  # fused: no version-counter bump
    ids = batch()
    for _ in range(3):  # three micro-batches: one quantization of each weight
        m(ids, labels=ids).loss.backward()
    assert len(calls) == n_tensors == qat_stats(m)["weight_quantizations"]
    assert len(launches) == n_launch  # one launch per weight (all experts of a projection in one)
    opt.step()
    opt.zero_grad()
    m(ids, labels=ids).loss.backward()
    assert len(calls) == 2 * n_tensors
    m.eval()
    with torch.no_grad():  # evaluation reuses the cache
        m(ids)
    m.train()
    m.gradient_checkpointing_enable()  # the recompute in backward reuses it too
    m(ids, labels=ids).loss.backward()
    assert len(calls) == 2 * n_tensors
    qat_step(m)  # explicit invalidation (e.g. after an update through .data)
    m(ids)
    assert len(calls) == 3 * n_tensors
    with torch.no_grad():
        m.lm_head.weight.add_(0.0)  # an in-place update bumps one version counter: only that weight
    m(ids)
    assert len(calls) == 3 * n_tensors + 1
    st = qat_stats(m)
    assert st["activation_reuses"] > 0  # q/k/v, index q/k and shared gate/up read one quantized input


def test_weight_refresh_matches_the_per_module_path():
    """capture_weight_refresh (eager here; one CUDA graph on the GPU) gives bit-identical losses,
    gradients and updates over several optimizer steps, refreshing all weights once per step."""
    from msakit.quant import capture_weight_refresh

    ids = batch(B=2, T=32)
    runs = []
    for refresh in (False, True):
        m = prepare_qat(small(layers=2))
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        if refresh:
            assert capture_weight_refresh(m, torch.float32, graph=False) > 0
        losses = []
        for _ in range(3):
            for _ in range(2):  # two micro-batches per optimizer step
                loss = m(ids, labels=ids).loss
                loss.backward()
                losses.append(loss.detach())
            opt.step()
            opt.zero_grad()
        runs.append((torch.stack(losses), [p.detach().clone() for p in m.parameters()], qat_stats(m)))
    (l0, p0, _), (l1, p1, st) = runs
    assert torch.equal(bits(l0), bits(l1))
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(p0, p1))
    assert st["weight_refreshes"] == 1 + 2  # the capture's own run + one per later step with a forward
    m2 = copy.deepcopy(m)  # a copy (e.g. for convert) falls back to the per-module path
    assert all(getattr(mq, "_qat").refresher is None for mq in m2.modules() if hasattr(mq, "_qat"))
    assert torch.equal(bits(m2(ids, labels=ids).loss), bits(m(ids, labels=ids).loss))


def test_convert_matches_the_qat_forward():
    m = small()
    ids = batch()
    q = prepare_qat(m)
    opt = torch.optim.AdamW(q.parameters(), lr=1e-2)
    q(ids, labels=ids).loss.backward()
    opt.step()
    with torch.no_grad():
        want = q(ids, labels=ids)
    c = convert(copy.deepcopy(q))
    assert not is_qat(c)
    assert isinstance(c.model.layers[1].block_sparse_moe.experts, PackedExperts)
    assert isinstance(c.model.layers[1].self_attn.q_proj, PackedLinear)
    assert type(c.model.layers[1].block_sparse_moe.gate) is torch.nn.Linear  # the router stays fp32
    with torch.no_grad():
        got = c(ids, labels=ids)
    assert torch.equal(got.logits, want.logits) and torch.equal(got.loss, want.loss)
    # the dequantized weights are the QAT weights, bit for bit
    ex_q = q.model.layers[1].block_sparse_moe.experts
    ex_c = c.model.layers[1].block_sparse_moe.experts
    for a, b in zip(ex_q.expert_weights(), ex_c.expert_weights()):
        assert torch.equal(bits(a), bits(b))
    # the active-expert chunked path (full-size models) agrees
    for layer in c.model.layers:
        if layer.is_moe:
            layer.block_sparse_moe.experts.max_dequant_bytes = 3 * 128 * 128 * 4 * 3  # 3 experts per chunk
    with torch.no_grad():
        chunked = c(ids, labels=ids)
    assert torch.allclose(chunked.logits, want.logits, rtol=0, atol=1e-5)
    # under bfloat16 autocast both keep agreeing
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        a = q(ids).logits
        b = convert(copy.deepcopy(q))(ids).logits
    assert torch.equal(a, b)
    # PTQ of a plain model = convert with the default plan; remove_qat gives the float model back
    plain = remove_qat(copy.deepcopy(q))
    assert not is_qat(plain) and type(plain.model.layers[1].self_attn.q_proj) is torch.nn.Linear
    with torch.no_grad():
        assert torch.equal(convert(copy.deepcopy(plain))(ids).logits, want.logits)


@pytest.mark.skipif(not INTERP, reason="the Triton kernels run on CPU only under TRITON_INTERPRET=1")
def test_triton_backend_matches_reference():
    torch.manual_seed(0)
    x = torch.randn(3, 16, 64) * torch.tensor([1e-3, 1.0, 1e3]).view(3, 1, 1)
    x[1, 2, :16] = 0
    g = nvfp4_global_scales(x)
    p0, s0 = nvfp4_quantize_grouped(x, g, backend="reference")
    p1, s1 = nvfp4_quantize_grouped(x, g, backend="triton")
    assert torch.equal(p0, p1) and torch.equal(bits(s0), bits(s1))
    for dt in (torch.float32, torch.bfloat16):
        a = nvfp4_fake_quantize_grouped(x, g, dt, backend="reference")
        b = nvfp4_fake_quantize_grouped(x, g, dt, backend="triton")
        assert torch.equal(bits(a), bits(b))
        a = mxfp8_fake_quantize_to(x.bfloat16(), dt, backend="reference")
        b = mxfp8_fake_quantize_to(x.bfloat16(), dt, backend="triton")
        assert torch.equal(bits(a), bits(b))
    # a QAT MoE block (NVFP4 experts, MXFP8 shared expert with activation quantization)
    from msakit.nn.moe import MoE

    moe = MoE(64, 4, 2, 32, shared_intermediate_size=32)
    moe.reset_parameters()
    plan = {f"experts.{e}.{w}": "nvfp4" for e in range(4) for w in ("w1", "w3", "w2")}
    plan.update({f"shared_experts.{n}_proj": "mxfp8" for n in ("gate", "up", "down")})
    xs = torch.randn(2, 16, 64)
    outs = []
    for be in ("reference", "triton"):
        mq = prepare_qat(copy.deepcopy(moe), plan, backend=be)
        y, _ = mq(xs)
        y.square().sum().backward()
        outs.append((y, mq.experts.w1.grad, mq.shared_experts.up_proj.weight.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_frozen_scales():
    torch.manual_seed(3)
    w = torch.randn(4, 32, 64) * torch.logspace(-2, 1, 4).view(4, 1, 1)
    g = nvfp4_global_scales(w)
    packed = pack_weight(w, "nvfp4", global_scale=g)
    # with the rule's own scales the frozen path reproduces the rule bit for bit
    same = pack_weight(w, "nvfp4", frozen={"weight_scale": packed["weight_scale"], "weight_scale_2": packed["weight_scale_2"]})
    assert all(torch.equal(bits(same[k]), bits(packed[k])) for k in packed)
    assert torch.equal(nvfp4_quantize_with_scales(w, packed["weight_scale"], g), packed["weight"])
    mx = pack_weight(w, "mxfp8")
    assert torch.equal(bits(mxfp8_quantize_with_scales(w, mx["weight_scale_inv"])), bits(mx["weight"]))
    # other scales: block scales doubled for experts 1 and 3 only (mask)
    bs2 = (packed["weight_scale"].float() * 2).to(torch.float8_e4m3fn)
    mask = torch.tensor([False, True, False, True])
    fr = {"weight_scale": bs2, "weight_scale_2": g, "mask": mask}
    p2 = pack_weight(w, "nvfp4", global_scale=g, frozen=fr)
    assert torch.equal(bits(p2["weight_scale"][1]), bits(bs2[1])) and torch.equal(bits(p2["weight_scale"][0]), bits(packed["weight_scale"][0]))
    fq = fake_quantize_weight(w, "nvfp4", global_scale=g, frozen=fr)
    assert torch.equal(fq, unpack_weight(p2, "nvfp4", torch.float32))
    # frozen scales through prepare_qat / convert: one MXFP8 linear and one expert pair
    m = small(layers=2)
    plan = quantization_plan(m)
    lin = m.model.layers[1].self_attn.o_proj
    foreign = (pack_weight(lin.weight, "mxfp8")["weight_scale_inv"].to(torch.int32) + 1).to(torch.uint8)
    ex = m.model.layers[1].block_sparse_moe.experts
    g13 = nvfp4_global_scales(ex.w1[2], ex.w3[2]) * 2
    frozen = {"model.layers.1.self_attn.o_proj": {"weight_scale_inv": foreign}}
    for w_ in ("w1", "w3"):
        bsw = pack_weight(getattr(ex, w_)[2], "nvfp4", global_scale=g13)["weight_scale"]
        frozen[f"model.layers.1.block_sparse_moe.experts.2.{w_}"] = {"weight_scale": bsw, "weight_scale_2": g13}
    q = prepare_qat(copy.deepcopy(m), plan, frozen=frozen)
    opt = torch.optim.SGD(q.parameters(), lr=0.5)
    ids = batch()
    q(ids, labels=ids).loss.backward()
    opt.step()
    with torch.no_grad():
        want = q(ids).logits
    c = convert(copy.deepcopy(q))
    assert torch.equal(c.model.layers[1].self_attn.o_proj.weight_scale_inv, foreign)
    ce = c.model.layers[1].block_sparse_moe.experts
    assert ce.w1_weight_scale_2[2] == g13 and ce.w3_weight_scale_2[2] == g13
    assert ce.w1_weight_scale_2[1] == ce.w3_weight_scale_2[1] != g13
    with torch.no_grad():
        assert torch.equal(c(ids).logits, want)


def test_errors():
    m = small(layers=2)
    q = prepare_qat(copy.deepcopy(m))
    with pytest.raises(ValueError, match="already prepared"):
        prepare_qat(q)
    with pytest.raises(ValueError, match="packed"):
        prepare_qat(convert(copy.deepcopy(m)))
    with pytest.raises(ValueError, match="not prepared"):
        qat_step(m)
    with pytest.raises(ValueError, match="scale_rule"):
        prepare_qat(copy.deepcopy(m), scale_rule="nearest")
    with pytest.raises(ValueError, match="backend"):
        prepare_qat(copy.deepcopy(m), backend="cuda")
    with pytest.raises(ValueError, match="nn.Module"):
        prepare_qat("model")
    with pytest.raises(ValueError, match="not in the plan"):
        prepare_qat(copy.deepcopy(m), frozen={"model.layers.9.mlp.up_proj": {"weight_scale_inv": torch.zeros(1)}})
    with pytest.raises(ValueError, match="planned as 'bf16'"):
        prepare_qat(copy.deepcopy(m), frozen={"lm_head": {"weight_scale_inv": torch.zeros(1)}})
    ex = m.model.layers[1].block_sparse_moe.experts
    one = {"model.layers.1.block_sparse_moe.experts.0.w1": {
        "weight_scale": torch.zeros(128, 8, dtype=torch.float8_e4m3fn), "weight_scale_2": torch.tensor(1.0)}}
    with pytest.raises(ValueError, match="freeze both or neither"):
        prepare_qat(copy.deepcopy(m), frozen=one)
    with pytest.raises(ValueError, match="shape"):
        prepare_qat(copy.deepcopy(m), frozen={"model.layers.0.mlp.up_proj": {"weight_scale_inv": torch.zeros(3, dtype=torch.uint8)}})
    with pytest.raises(ValueError, match="NaN or inf"):
        w = ex.w1.detach().clone()
        w[0, 0, 0] = float("nan")
        pack_weight(w, "nvfp4")
    with pytest.raises(ValueError, match="own plan"):
        convert(copy.deepcopy(q), quantization_plan(m))
    assert isinstance(q.model.layers[1].block_sparse_moe.experts, QATGroupedExperts)
