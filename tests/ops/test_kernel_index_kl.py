"""The Triton `index_kl_loss` / `selected_lse` kernels against the PyTorch references.

Run under the Triton interpreter (TRITON_INTERPRET=1, set before triton is imported), small
shapes, float32 (tight tolerances) plus one bf16 smoke case.  Skipped when the kernels cannot
run here (no triton, or CPU without the interpreter).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from msakit.ops import index_kl as index_kl_ops
from msakit.ops.dispatch import interpret_mode, triton_available
from tolerances import assert_close_sums
from msakit.ops.index_kl.reference import (
    index_kl_loss_reference,
    selected_lse_reference,
)

# make_block_idx's selections hold blocks after the query on purpose (every path drops them), so
# the public ops run here without their value check (tested in test_ops_reference.py)
index_kl_loss = functools.partial(index_kl_ops.index_kl_loss, validate=False)
selected_lse = functools.partial(index_kl_ops.selected_lse, validate=False)

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(
    not triton_available() or (DEV.type != "cuda" and not interpret_mode()),
    reason="needs triton on CUDA, or TRITON_INTERPRET=1",
)


def make_block_idx(B, G, T, K, bs, gen, *, empty_rows=0, doc_rel=None):
    """Random selection: own block in a random slot, other slots random ids in [-1, nblocks)
    (duplicates, -1 and blocks past the query all occur).  doc_rel: per-token position inside its
    document (varlen), else the token index."""
    rel = torch.arange(T) if doc_rel is None else doc_rel
    nb = (T + bs - 1) // bs
    bi = torch.randint(-1, nb, (B, G, T, K), generator=gen)
    own = (rel // bs).view(1, 1, T).expand(B, G, T)
    slot = torch.randint(0, K, (B, G, T), generator=gen)
    bi.scatter_(-1, slot.unsqueeze(-1), own.unsqueeze(-1))
    if empty_rows:
        rows = torch.randint(0, T, (empty_rows,), generator=gen)
        bi[:, :, rows] = -1
    return bi.to(torch.int32)


def make_inputs(B, T, Hq, G, D, Di, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hq, D, generator=gen)
    k = torch.randn(B, T, G, D, generator=gen)
    q_idx = torch.randn(B, T, G, Di, generator=gen)
    k_idx = torch.randn(B, T, Di, generator=gen)
    return [x.to(DEV, dtype) for x in (q, k, q_idx, k_idx)], gen


def loss_and_grads(fn, q, k, q_idx, k_idx, **kw):
    qi = q_idx.detach().clone().requires_grad_(True)
    ki = k_idx.detach().clone().requires_grad_(True)
    loss = fn(q, k, qi, ki, **kw)
    loss.backward()
    return loss.detach(), qi.grad, ki.grad


def rel_err(a, b):
    """Relative norm error; against an all-zero reference gradient (T = 1: P = P_idx = 1, where
    a given lse leaves P = 1 +- an ulp) the absolute norm counts, scaled by 1e-2."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-2)).item()


# (B, T, Hq, G, D, Di, bs, K, empty_rows)
CASES = {
    "partial_last_block": (1, 70, 4, 2, 32, 16, 16, 3, 0),
    "T_lt_block": (1, 10, 4, 1, 16, 16, 16, 2, 0),
    "T_eq_1": (1, 1, 2, 1, 16, 16, 16, 2, 0),
    "fewer_blocks_than_topk": (1, 40, 4, 2, 16, 32, 16, 6, 0),
    "batch2_groups4_empty_rows": (2, 48, 8, 4, 16, 16, 16, 3, 5),
    "odd_heads_per_group": (1, 37, 6, 2, 16, 16, 16, 3, 0),
    "non_pow2_dims_and_block": (1, 61, 4, 2, 24, 20, 24, 3, 0),
}


@pytest.mark.parametrize("given_lse", [False, True], ids=["lse_none", "lse_given"])
@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_grads_match_reference(case, given_lse):
    B, T, Hq, G, D, Di, bs, K, empty = CASES[case]
    (q, k, q_idx, k_idx), gen = make_inputs(B, T, Hq, G, D, Di, seed=list(CASES).index(case))
    bi = make_block_idx(B, G, T, K, bs, gen, empty_rows=empty).to(DEV)
    lse = selected_lse_reference(q, k, bi, block_size=bs) if given_lse else None
    ref = loss_and_grads(index_kl_loss_reference, q, k, q_idx, k_idx, block_idx=bi, block_size=bs)
    out = loss_and_grads(index_kl_loss, q, k, q_idx, k_idx, block_idx=bi, block_size=bs, lse=lse, backend="triton")
    assert out[0].dtype == torch.float32 and out[0].dim() == 0
    torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-6)
    tol = 1e-4 if T == 1 else 1e-5  # T = 1: gradients are round-off around 0 (see rel_err)
    assert rel_err(out[1], ref[1]) < tol
    assert rel_err(out[2], ref[2]) < tol


@pytest.mark.parametrize("case", ["partial_last_block", "T_lt_block", "T_eq_1", "batch2_groups4_empty_rows",
                                  "odd_heads_per_group", "non_pow2_dims_and_block"])
def test_over_all_matches_reference(case):
    """over="all" runs the kernel on every causal block (`causal_blocks`): the KL over all causal
    tokens, equal to the reference's dense definition; a given block_idx is ignored."""
    B, T, Hq, G, D, Di, bs, K, _ = CASES[case]
    (q, k, q_idx, k_idx), gen = make_inputs(B, T, Hq, G, D, Di, seed=7 + list(CASES).index(case))
    ref = loss_and_grads(index_kl_loss_reference, q, k, q_idx, k_idx, block_idx=None, block_size=bs, over="all")
    ignored = make_block_idx(B, G, T, K, bs, gen).to(DEV)
    for bi in (None, ignored):
        out = loss_and_grads(index_kl_loss, q, k, q_idx, k_idx, block_idx=bi, block_size=bs, over="all",
                             backend="triton")
        torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-6)
        tol = 1e-4 if T == 1 else 1e-5
        assert rel_err(out[1], ref[1]) < tol
        assert rel_err(out[2], ref[2]) < tol


def test_over_all_causal_blocks_and_bound(monkeypatch):
    """`causal_blocks` holds each row's causal blocks then -1; past ALL_KL_MAX_BYTES the chunked
    path runs, with a warning, and gives the same loss."""
    bi = index_kl_ops.causal_blocks(2, 3, 9, 4, DEV)
    assert bi.shape == (2, 3, 9, 3) and bi.dtype == torch.int32
    assert bi[1, 2, 3].tolist() == [0, -1, -1] and bi[0, 0, 4].tolist() == [0, 1, -1]
    assert bi[0, 1, 8].tolist() == [0, 1, 2]
    B, T, Hq, G, D, Di, bs, K, _ = CASES["partial_last_block"]
    (q, k, q_idx, k_idx), _ = make_inputs(B, T, Hq, G, D, Di, seed=5)
    ref = index_kl_loss_reference(q, k, q_idx, k_idx, None, block_size=bs, over="all")
    monkeypatch.setattr(index_kl_ops, "ALL_KL_MAX_BYTES", 0)
    from msakit.ops import dispatch
    monkeypatch.setattr(dispatch, "_warned", set())
    with pytest.warns(RuntimeWarning, match="chunked PyTorch path"):
        out = index_kl_loss(q, k, q_idx, k_idx, None, block_size=bs, over="all", backend="triton")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_selected_lse_matches_reference():
    B, T, Hq, G, D, bs, K = 2, 53, 6, 2, 16, 16, 3
    (q, k, _, _), gen = make_inputs(B, T, Hq, G, D, 16, seed=3)
    bi = make_block_idx(B, G, T, K, bs, gen, empty_rows=3).to(DEV)
    ref = selected_lse_reference(q, k, bi, block_size=bs, softmax_scale=0.3)
    out = selected_lse(q, k, bi, block_size=bs, softmax_scale=0.3, backend="triton")
    assert out.shape == (B, Hq, T) and out.dtype == torch.float32 and out.is_contiguous()
    assert torch.equal(torch.isinf(out), torch.isinf(ref)) and bool(torch.isinf(ref).any())
    fin = torch.isfinite(ref)
    torch.testing.assert_close(out[fin], ref[fin], rtol=1e-5, atol=1e-5)
    # the same quantity sparse_attention returns with return_lse (what index_kl_loss takes as lse)
    from msakit.ops.sparse_attention.reference import sparse_attention_reference

    _, lse_sa = sparse_attention_reference(q, k, k, bi, block_size=bs, softmax_scale=0.3, return_lse=True)
    torch.testing.assert_close(out[fin], lse_sa[fin], rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.isinf(lse_sa), torch.isinf(ref))


def _varlen_setup(seed=5):
    cu_list = [0, 5, 5, 40, 77, 93]  # docs of 5, 0 (empty), 35, 37, 16 tokens
    T, Hq, G, D, Di, bs, K = cu_list[-1], 4, 2, 16, 16, 16, 3
    (q, k, q_idx, k_idx), gen = make_inputs(1, T, Hq, G, D, Di, seed=seed)
    cu = torch.tensor(cu_list, dtype=torch.int32)
    doc = torch.searchsorted(cu[1:], torch.arange(T), right=True)
    rel = torch.arange(T) - cu.long()[doc]
    bi = make_block_idx(1, G, T, K, bs, gen, doc_rel=rel).to(DEV)
    return q, k, q_idx, k_idx, bi, cu.to(DEV), bs


@pytest.mark.parametrize("given_lse", [False, True], ids=["lse_none", "lse_given"])
def test_varlen_matches_reference(given_lse):
    q, k, q_idx, k_idx, bi, cu, bs = _varlen_setup()
    lse = selected_lse_reference(q, k, bi, block_size=bs, cu_seqlens=cu) if given_lse else None
    ref = loss_and_grads(index_kl_loss_reference, q, k, q_idx, k_idx, block_idx=bi, cu_seqlens=cu,
                         block_size=bs)
    out = loss_and_grads(index_kl_loss, q, k, q_idx, k_idx, block_idx=bi, block_size=bs, lse=lse, cu_seqlens=cu,
                         backend="triton")
    torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-6)
    assert rel_err(out[1], ref[1]) < 1e-5
    assert rel_err(out[2], ref[2]) < 1e-5
    # the reference backend with cu_seqlens is the varlen reference
    ref2 = index_kl_loss(q, k, q_idx, k_idx, bi, block_size=bs, cu_seqlens=cu, backend="reference")
    torch.testing.assert_close(ref2, ref[0])


def test_varlen_selected_lse():
    q, k, _, _, bi, cu, bs = _varlen_setup(seed=6)
    ref = selected_lse_reference(q, k, bi, block_size=bs, cu_seqlens=cu)
    out = selected_lse(q, k, bi, block_size=bs, cu_seqlens=cu, backend="triton")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_varlen_equals_batched_for_equal_documents():
    B, T, Hq, G, D, Di, bs, K = 2, 40, 4, 2, 16, 16, 16, 3
    (q, k, q_idx, k_idx), gen = make_inputs(B, T, Hq, G, D, Di, seed=8)
    bi = make_block_idx(B, G, T, K, bs, gen).to(DEV)
    batched = index_kl_loss(q, k, q_idx, k_idx, bi, block_size=bs, backend="triton")
    flat = lambda x: x.reshape(1, B * T, *x.shape[2:])
    bi_flat = bi.permute(1, 0, 2, 3).reshape(1, G, B * T, K)
    cu = torch.tensor([0, T, 2 * T], dtype=torch.int32, device=DEV)
    varlen = index_kl_loss(flat(q), flat(k), flat(q_idx), flat(k_idx), bi_flat, block_size=bs, cu_seqlens=cu,
                           backend="triton")
    # the same KL terms summed over other tiles: a reduction over every (token, group, slot)
    assert_close_sums(varlen, batched, n=B * T * G * K, msg="loss")


def test_no_grad_to_q_k_and_grad_scaling():
    B, T, Hq, G, D, Di, bs, K = 1, 33, 4, 2, 16, 16, 16, 2
    (q, k, q_idx, k_idx), gen = make_inputs(B, T, Hq, G, D, Di, seed=11)
    bi = make_block_idx(B, G, T, K, bs, gen).to(DEV)
    q.requires_grad_(True)
    k.requires_grad_(True)
    qi = q_idx.clone().requires_grad_(True)
    ki = k_idx.clone().requires_grad_(True)
    loss = index_kl_loss(q, k, qi, ki, bi, block_size=bs, backend="triton")
    (3.0 * loss).backward()
    assert q.grad is None and k.grad is None
    _, gq, gk = loss_and_grads(index_kl_loss_reference, q.detach(), k.detach(), q_idx, k_idx, block_idx=bi,
                               block_size=bs)
    assert rel_err(qi.grad, 3.0 * gq) < 1e-5 and rel_err(ki.grad, 3.0 * gk) < 1e-5
    # only k_idx trainable; and no autograd at all
    ki2 = k_idx.clone().requires_grad_(True)
    index_kl_loss(q, k, q_idx, ki2, bi, block_size=bs, backend="triton").backward()
    assert rel_err(ki2.grad, gk) < 1e-5
    with torch.no_grad():
        l0 = index_kl_loss(q, k, q_idx, k_idx, bi, block_size=bs, backend="triton")
    torch.testing.assert_close(l0, loss.detach())


@pytest.mark.parametrize("tpp,hc", [(1, 1), (4, 2)])
def test_other_tilings(tpp, hc):
    from msakit.ops.index_kl.triton import index_kl_fwd_triton

    B, T, Hq, G, D, Di, bs, K = 1, 90, 4, 2, 16, 16, 16, 4
    (q, k, q_idx, k_idx), gen = make_inputs(B, T, Hq, G, D, Di, seed=13)
    bi = make_block_idx(B, G, T, K, bs, gen).to(DEV)
    ref = loss_and_grads(index_kl_loss_reference, q, k, q_idx, k_idx, block_idx=bi, block_size=bs,
                         softmax_scale=0.2, index_softmax_scale=0.3)
    cfg = dict(QT=16, TPP=tpp, HC=hc, num_warps=4, num_stages=1, ST_HC=4 // hc)
    loss, dq, dk = index_kl_fwd_triton(q, k, q_idx, k_idx, bi, None, None, bs, 0.2, 0.3, True, config=cfg)
    torch.testing.assert_close(loss, ref[0], rtol=1e-5, atol=1e-6)
    assert rel_err(dq, ref[1]) < 1e-5 and rel_err(dk, ref[2]) < 1e-5


def test_half_precision_inputs():
    # bf16 on CUDA; fp16 under the interpreter (whose bf16 tl.dot is wrong in triton 3.6)
    dtype = torch.bfloat16 if DEV.type == "cuda" else torch.float16
    B, T, Hq, G, D, Di, bs, K = 1, 48, 4, 2, 32, 32, 16, 3
    (q, k, q_idx, k_idx), gen = make_inputs(B, T, Hq, G, D, Di, dtype=dtype, seed=17)
    bi = make_block_idx(B, G, T, K, bs, gen).to(DEV)
    ref = loss_and_grads(index_kl_loss_reference, q, k, q_idx, k_idx, block_idx=bi, block_size=bs)
    out = loss_and_grads(index_kl_loss, q, k, q_idx, k_idx, block_idx=bi, block_size=bs, backend="triton")
    assert out[1].dtype == dtype and out[2].dtype == dtype
    torch.testing.assert_close(out[0], ref[0].float(), rtol=1e-3, atol=1e-4)
    assert rel_err(out[1], ref[1]) < 2e-2 and rel_err(out[2], ref[2]) < 2e-2


def test_dispatch_and_checks():
    B, T, Hq, G, D, Di, bs, K = 1, 20, 4, 2, 16, 16, 16, 2
    (q, k, q_idx, k_idx), gen = make_inputs(B, T, Hq, G, D, Di, seed=19)
    bi = make_block_idx(B, G, T, K, bs, gen).to(DEV)
    ref = index_kl_loss_reference(q, k, q_idx, k_idx, bi, block_size=bs)
    torch.testing.assert_close(index_kl_loss(q, k, q_idx, k_idx, bi, block_size=bs, backend="reference"), ref)
    if DEV.type == "cpu":  # auto on CPU tensors is the chunked path, equal to the reference
        torch.testing.assert_close(index_kl_loss(q, k, q_idx, k_idx, bi, block_size=bs), ref)
    with pytest.raises(ValueError, match="lse"):
        index_kl_loss(q, k, q_idx, k_idx, bi, block_size=bs, lse=torch.zeros(B, Hq, T + 1, device=DEV))
    with pytest.raises(ValueError, match="cu_seqlens"):
        index_kl_loss(q, k, q_idx, k_idx, bi, block_size=bs, cu_seqlens=torch.tensor([0, 5, 19], device=DEV))
    with pytest.raises(ValueError, match="backend"):
        index_kl_loss(q, k, q_idx, k_idx, bi, block_size=bs, backend="cuda")
    q64, k64, qi64, ki64 = (x.double() for x in (q, k, q_idx, k_idx))
    with pytest.raises(ValueError, match="float64"):
        index_kl_loss(q64, k64, qi64, ki64, bi, block_size=bs, backend="triton")


def test_custom_op_registration():
    B, T, Hq, G, D, Di, bs, K = 1, 20, 2, 1, 16, 16, 16, 2
    (q, k, q_idx, k_idx), gen = make_inputs(B, T, Hq, G, D, Di, seed=23)
    bi = make_block_idx(B, G, T, K, bs, gen).to(DEV)
    args = (q, k, q_idx.requires_grad_(True), k_idx.requires_grad_(True), bi, None, None, bs, 0.25, 0.25, True)
    res = torch.library.opcheck(torch.ops.msakit.index_kl_fwd.default, args)
    assert all(v == "SUCCESS" for v in res.values()), res
    mode = torch._subclasses.fake_tensor.FakeTensorMode()
    fq, fk, fqi, fki, fbi = (mode.from_tensor(x.detach()) for x in (q, k, q_idx, k_idx, bi))
    with mode:
        loss, dq, dk = torch.ops.msakit.index_kl_fwd(fq, fk, fqi, fki, fbi, None, None, bs, 0.25, 0.25, True)
        assert loss.shape == () and dq.shape == q_idx.shape and dk.shape == k_idx.shape


def test_scale_defaults():
    B, T, Hq, G, D, Di, bs, K = 1, 30, 2, 1, 16, 32, 16, 2
    (q, k, q_idx, k_idx), gen = make_inputs(B, T, Hq, G, D, Di, seed=29)
    bi = make_block_idx(B, G, T, K, bs, gen).to(DEV)
    a = index_kl_loss(q, k, q_idx, k_idx, bi, block_size=bs, backend="triton")
    b = index_kl_loss(q, k, q_idx, k_idx, bi, block_size=bs, softmax_scale=1 / math.sqrt(D),
                      index_softmax_scale=1 / math.sqrt(Di), backend="triton")
    torch.testing.assert_close(a, b)


def test_sm90_build_fits_without_spills():
    """Compile the default sm_90 config offline (Triton's bundled ptxas, no GPU needed; a fresh
    process, since the interpreter replaces @triton.jit): no register spills, shared memory
    within the 227 KB a Hopper block may use."""
    import json
    import os
    import subprocess
    import sys

    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("triton's bundled ptxas is not available")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import json; from tools.bench.index_kl import ptxas_report; print(json.dumps(ptxas_report()))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    for r in rows:
        assert r["spill_bytes"] == 0 and r["registers"] <= 255 and r["smem_bytes"] <= 227 * 1024, r


@pytest.mark.parametrize("shape", [(1, 70, 4, 2, 32, 16), (2, 37, 6, 2, 16, 8), (1, 10, 4, 1, 16, 16),
                                   (1, 61, 4, 2, 24, 24)])
def test_block_attention_mass_matches_reference(shape):
    """The kernel's statistics pass on every causal block gives the oracle's block masses."""
    B, T, Hq, G, D, bs = shape
    (q, k, _, _), _ = make_inputs(B, T, Hq, G, D, 16, seed=T)
    out = index_kl_ops.block_attention_mass(q, k, block_size=bs, softmax_scale=0.2, backend="triton")
    ref = index_kl_ops.block_attention_mass(q, k, block_size=bs, softmax_scale=0.2, backend="reference")
    assert out.shape == (B, G, T, -(-T // bs)) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.sum(-1), torch.ones_like(out[..., 0]), rtol=1e-5, atol=1e-5)
    own = torch.arange(T, device=out.device) // bs
    assert (out[..., torch.arange(out.shape[-1], device=out.device)[None, :] > own[:, None]] == 0).all()
