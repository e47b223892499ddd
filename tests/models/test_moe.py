"""MoE routing, SwiGLU-OAI and grouped expert compute (msakit.nn.moe, msakit.nn.mlp)."""

from __future__ import annotations

import math

import pytest
import torch

from msakit.nn import moe as moe_mod
from msakit.nn.mlp import SwiGLUMLP, swiglu_oai
from msakit.nn.moe import GroupedExperts, MoE, grouped_mm, route

pytestmark = pytest.mark.usefixtures("one_thread")


def _sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_swiglu_oai_hand_computed() -> None:
    gate = torch.tensor([2.0, 10.0, -1.0, 0.0], dtype=torch.float64)
    up = torch.tensor([0.5, -9.0, 8.0, 3.0], dtype=torch.float64)
    out = swiglu_oai(gate, up, alpha=1.702, limit=7.0)
    # gate clamped to max 7 (10 -> 7); up clamped to [-7, 7] (-9 -> -7, 8 -> 7); no lower clamp on gate
    want = [
        2.0 * _sig(1.702 * 2.0) * (0.5 + 1.0),  # = 2.903487...
        7.0 * _sig(1.702 * 7.0) * (-7.0 + 1.0),
        -1.0 * _sig(-1.702) * (7.0 + 1.0),
        0.0,
    ]
    assert want[0] == pytest.approx(2.9034870, abs=1e-6)
    torch.testing.assert_close(out, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)


def test_dense_mlp_uses_swiglu_oai() -> None:
    torch.manual_seed(0)
    mlp = SwiGLUMLP(8, 12, alpha=1.5, limit=3.0)
    x = torch.randn(5, 8) * 4
    want = mlp.down_proj(swiglu_oai(mlp.gate_proj(x), mlp.up_proj(x), 1.5, 3.0))
    torch.testing.assert_close(mlp(x), want)


def test_route_bias_changes_choice_not_weights() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    s = [_sig(v) for v in (2.0, 1.0, 0.0, -1.0)]
    w, idx = route(logits, 2, routed_scaling_factor=2.0)
    assert sorted(idx[0].tolist()) == [0, 1]
    got = dict(zip(idx[0].tolist(), w[0].tolist()))
    assert got[0] == pytest.approx(s[0] / (s[0] + s[1]) * 2.0, rel=1e-6)
    assert got[1] == pytest.approx(s[1] / (s[0] + s[1]) * 2.0, rel=1e-6)
    # a large bias on expert 2 makes it chosen; its weight is still its un-biased sigmoid score
    bias = torch.tensor([0.0, 0.0, 10.0, 0.0])
    w, idx = route(logits, 2, bias=bias, routed_scaling_factor=2.0)
    assert sorted(idx[0].tolist()) == [0, 2]
    got = dict(zip(idx[0].tolist(), w[0].tolist()))
    assert got[2] == pytest.approx(s[2] / (s[0] + s[2]) * 2.0, rel=1e-6)
    assert got[0] == pytest.approx(s[0] / (s[0] + s[2]) * 2.0, rel=1e-6)
    # without renormalisation the weights are the raw scores times the factor
    w, idx = route(logits, 2, routed_scaling_factor=2.0, norm_topk_prob=False)
    assert dict(zip(idx[0].tolist(), w[0].tolist()))[0] == pytest.approx(s[0] * 2.0, rel=1e-6)


def _moe(seed: int = 0, **kw) -> MoE:
    torch.manual_seed(seed)
    m = MoE(16, 8, 2, 24, shared_intermediate_size=20, routed_scaling_factor=2.0, **kw)
    m.reset_parameters(std=0.3)
    return m


def test_moe_bias_steers_routing_in_module() -> None:
    m = _moe()
    x = torch.randn(50, 16)
    _, load0 = m(x)
    assert load0.dtype == torch.float32 and load0.sum() == 100
    with torch.no_grad():
        m.e_score_correction_bias[5] = 10.0
    _, load1 = m(x)
    assert load1[5] == 50  # every token now picks expert 5
    w, idx = m.route(x)
    scores = torch.sigmoid(m.router_logits(x))
    chosen = scores.gather(1, idx)
    torch.testing.assert_close(w, chosen / chosen.sum(-1, keepdim=True) * 2.0)


@pytest.mark.parametrize("path", ["grouped_mm", "padded_bmm"])
def test_grouped_equals_naive_loop(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    if path == "padded_bmm":
        monkeypatch.setattr(moe_mod, "grouped_mm_ok", lambda x, w: False)
    m = _moe(1)
    x = torch.randn(37, 16, requires_grad=True)
    y, _ = m(x)
    w, idx = m.route(x)
    ref = m.experts.forward_naive(x, idx, w) + m.shared_experts(x)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, m.experts.w1, m.experts.w2, m.gate.weight], g)
    grads_ref = torch.autograd.grad(ref, [x, m.experts.w1, m.experts.w2, m.gate.weight], g)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_grouped_mm_empty_groups() -> None:
    torch.manual_seed(0)
    counts = torch.tensor([3, 0, 5, 0])
    x = torch.randn(8, 6)
    w = torch.randn(4, 6, 10)
    want = torch.cat([x[:3] @ w[0], x[3:] @ w[2]])
    torch.testing.assert_close(grouped_mm(x, w, counts), want)
    torch.testing.assert_close(moe_mod._padded_bmm(x, w, counts, counts.cumsum(0).to(torch.int32)), want)


def test_router_stays_fp32_and_bias_frozen() -> None:
    m = _moe().to(torch.bfloat16)
    assert m.gate.weight.dtype == torch.float32
    assert m.e_score_correction_bias.dtype == torch.float32
    assert not m.e_score_correction_bias.requires_grad
    assert m.experts.w1.dtype == torch.bfloat16
    y, load = m(torch.randn(4, 16, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and load.sum() == 8


def test_update_bias_sign_rule() -> None:
    m = _moe()
    load = torch.tensor([10.0, 0, 0, 0, 0, 0, 0, 6.0])  # mean 2
    m.update_bias(load, rate=0.5)
    assert m.e_score_correction_bias.tolist() == [-0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, -0.5]


def test_no_routing_bias_option() -> None:
    m = _moe(use_routing_bias=False)
    assert m.e_score_correction_bias is None
    y, load = m(torch.randn(3, 16))
    assert y.shape == (3, 16)
    m.update_bias(load)  # a no-op


def test_bad_top_k() -> None:
    with pytest.raises(ValueError, match="top_k"):
        MoE(8, 4, 5, 8)


def test_grouped_experts_autocast_cpu() -> None:
    m = _moe()
    x = torch.randn(6, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, _ = m(x)
    assert y.dtype == torch.float32  # output keeps the residual stream's dtype
    torch.testing.assert_close(y, m(x)[0], rtol=0.05, atol=0.05)


def test_experts_weight_layout() -> None:
    e = GroupedExperts(3, 16, 24)
    assert e.w1.shape == (3, 24, 16) and e.w3.shape == (3, 24, 16) and e.w2.shape == (3, 16, 24)
