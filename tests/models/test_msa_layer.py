"""MSAAttention: parameter names, modes, RoPE/norm, and the indexer's stop-gradients."""

from __future__ import annotations

import pytest
import torch

from msakit import ops
from msakit.nn import GemmaRMSNorm, MSAAttention, MSAConfig, apply_partial_rope, rope_cos_sin
from msakit.ops.index_topk import Selection

SELECTION = ("block_size", "topk", "local_blocks", "init_blocks")


def small_cfg(**kw):
    sel = dict(block_size=4, topk=2)
    sel.update({k: kw.pop(k) for k in SELECTION if k in kw})
    base = dict(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, index_dim=8, rotary_dim=4, rope_theta=1e4)
    base.update(kw)
    return MSAConfig(selection=Selection(**sel), **base)


def make_layer(mode="sparse", seed=0, **kw):
    torch.manual_seed(seed)
    m = MSAAttention(small_cfg(**kw), mode=mode)
    m.reset_parameters(0.2)
    for n in (m.q_norm, m.k_norm, m.index_q_norm, m.index_k_norm):
        torch.nn.init.normal_(n.weight, std=0.1)
    return m


def test_parameter_names_follow_hf_checkpoint():
    names = {n for n, _ in make_layer().named_parameters()}
    expected = {f"{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm",
                                         "index_q_proj", "index_k_proj", "index_q_norm", "index_k_norm")}
    assert names == expected
    m = make_layer()
    assert m.index_q_proj.weight.shape == (2 * 8, 32) and m.index_k_proj.weight.shape == (8, 32)


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_forward_shapes_and_kl(mode):
    m = make_layer(mode)
    x = torch.randn(2, 11, 32)
    out, kl, _ = m(x)
    assert out.shape == x.shape and kl.dim() == 0 and kl.item() >= 0
    out2, kl2, _ = m(x, compute_kl=False)
    assert kl2 is None and torch.equal(out, out2)


def test_sparse_with_every_block_equals_dense():
    m = make_layer("sparse", topk=4)  # T = 16, block 4 -> 4 blocks: everything is selected
    x = torch.randn(1, 16, 32)
    o_s = m(x, compute_kl=False)[0]
    m.mode = "dense"
    o_d = m(x, compute_kl=False)[0]
    torch.testing.assert_close(o_s, o_d, rtol=1e-5, atol=1e-6)


def test_layer_matches_ops_on_its_projections():
    m = make_layer("sparse")
    x = torch.randn(1, 13, 32)
    q, k, v, qi, ki = m.project(x)
    o = ops.msa_attention(q, k, v, qi, ki, block_size=4, topk=2)
    out, kl, _ = m(x)
    torch.testing.assert_close(out, m.o_proj(o.reshape(1, 13, -1)))
    bi = ops.index_topk(qi, ki, block_size=4, topk=2)
    torch.testing.assert_close(kl, ops.index_kl_loss(q, k, qi, ki, bi, block_size=4))


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_kl_weight_does_not_change_backbone_gradients(mode):
    """The seed's stop-gradients: KL weight 0 and 1 give identical gradients everywhere outside
    the index branch (and the input), while the index branch does learn from the KL."""
    x0 = torch.randn(2, 12, 32)
    grads = []
    for w in (0.0, 1.0):
        m = make_layer(mode, seed=1)
        x = x0.clone().requires_grad_(True)
        out, kl, _ = m(x)
        ((out ** 2).mean() + w * kl).backward()
        grads.append({n: p.grad.clone() if p.grad is not None else None for n, p in m.named_parameters()} | {"input": x.grad.clone()})
    g0, g1 = grads
    for n in g0:
        if n.startswith("index_"):
            continue
        assert torch.equal(g0[n], g1[n]), n
    assert g0["index_q_proj.weight"] is None or g0["index_q_proj.weight"].abs().sum() == 0
    assert g1["index_q_proj.weight"].abs().sum() > 0 and g1["index_k_proj.weight"].abs().sum() > 0


def test_gemma_norm_and_partial_rope():
    n = GemmaRMSNorm(4)
    x = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    torch.testing.assert_close(n(x), x, atol=1e-5, rtol=0)  # rms 1, weight 0 -> (1 + 0)
    with torch.no_grad():
        n.weight.fill_(1.0)
    torch.testing.assert_close(n(x), 2 * x, atol=1e-5, rtol=0)
    # partial rope: dims beyond rotary_dim unchanged; a rotation preserves the norm of the rotated part;
    # position 0 is the identity; relative property: <R_m q, R_n k> depends on m - n only
    cos, sin = rope_cos_sin(torch.arange(6).unsqueeze(0), 4, 100.0)
    q = torch.randn(1, 6, 1, 8)
    rq = apply_partial_rope(q, cos, sin)
    assert torch.equal(rq[..., 4:], q[..., 4:])
    torch.testing.assert_close(rq[:, 0], q[:, 0])
    torch.testing.assert_close(rq[..., :4].norm(dim=-1), q[..., :4].norm(dim=-1))
    a, b = torch.randn(8), torch.randn(8)
    qa = apply_partial_rope(a.expand(1, 6, 1, 8), cos, sin)[0, :, 0]
    kb = apply_partial_rope(b.expand(1, 6, 1, 8), cos, sin)[0, :, 0]
    assert torch.allclose(qa[3] @ kb[1], qa[4] @ kb[2], atol=1e-5)


def test_bad_config_and_input():
    with pytest.raises(ValueError, match="num_heads"):
        small_cfg(num_heads=3)
    with pytest.raises(ValueError, match="topk"):
        small_cfg(topk=1, init_blocks=1)
    with pytest.raises(ValueError, match="mode"):
        MSAAttention(small_cfg(), mode="flash")
    with pytest.raises(ValueError, match="hidden"):
        make_layer()(torch.randn(1, 4, 31))
