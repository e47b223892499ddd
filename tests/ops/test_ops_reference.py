"""The reference ops against hand-computed cases and against tests/naive.py."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from msakit import ops
from naive import naive_index_kl, naive_index_topk, naive_sparse_attention, selected_token_set


def as_sets(block_idx):
    return [[sorted(int(x) for x in row if x >= 0) for row in grp] for b in block_idx for grp in b]


def rows_valid_first(block_idx):
    """Valid entries first, then -1."""
    v = block_idx >= 0
    return bool((v[..., 1:] <= v[..., :-1]).all())


# ---------------------------------------------------------------- index_topk, by hand
def test_index_topk_hand_two_blocks_partial_last():
    # T = 6, block 4: blocks {0,1,2,3} and {4,5} (partial).  Di = 1, q_idx = 1, so s(i, j) = k(j).
    k = torch.tensor([0.0, 5.0, 1.0, 2.0, 3.0, 9.0]).view(1, 6, 1)
    q = torch.ones(1, 6, 1, 1)
    bi = ops.index_topk(q, k, block_size=4, topk=2)
    assert bi.dtype == torch.int32 and bi.shape == (1, 1, 6, 2)
    # queries 0..3 see one block: [0, -1]; queries 4, 5: own block 1 forced plus block 0
    assert bi[0, 0, :4].tolist() == [[0, -1]] * 4
    assert as_sets(bi[:, :, 4:]) == [[[0, 1], [0, 1]]]


def test_index_topk_hand_max_respects_causality():
    # block 1 = tokens 4..7; its max token (7) lies in the future of query 8? no: query 8 is in block 2.
    # query 5 (own block 1) and topk = 1: only its own block.  Query 8 with topk 2: own block 2 plus
    # the better of block 0 (max k = 1) and block 1 (max k = 4 at token 7, visible to query 8).
    k = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 4.0, 0.0]).view(1, 9, 1)
    q = torch.ones(1, 9, 1, 1)
    bi = ops.index_topk(q, k, block_size=4, topk=2)
    assert as_sets(bi[:, :, 8:9]) == [[[1, 2]]]
    # query 6 (block 1) cannot see token 7: block 1 max is 0, block 0 max is 1; both valid -> {0, 1}
    assert as_sets(bi[:, :, 6:7]) == [[[0, 1]]]


def test_index_topk_ties_go_to_lower_block():
    k = torch.ones(1, 16, 1)
    q = torch.ones(1, 16, 1, 1)
    bi = ops.index_topk(q, k, block_size=4, topk=2)
    # query 15 (block 3): forced 3; blocks 0, 1, 2 tie -> block 0
    assert as_sets(bi[:, :, 15:16]) == [[[0, 3]]]


def test_index_topk_init_and_local_blocks():
    T, bs = 20, 4
    k = torch.arange(T, dtype=torch.float32).view(1, T, 1)  # later blocks score higher
    q = -torch.ones(1, T, 1, 1)  # ...but q = -1 flips it: earlier blocks score higher
    bi = ops.index_topk(q, k, block_size=bs, topk=4, local_blocks=2, init_blocks=1)
    # query 19 (block 4): forced 4, 3 (local) and 0 (init); best remaining by max(-k) is block 1
    assert as_sets(bi[:, :, 19:20]) == [[[0, 1, 3, 4]]]
    # query 5 (block 1): forced 1, 0 (local) and 0 (init, same): 2 valid entries, then -1
    assert bi[0, 0, 5].tolist()[2:] == [-1, -1]
    assert as_sets(bi[:, :, 5:6]) == [[[0, 1]]]


def test_index_topk_groups_select_differently_and_batches():
    T, bs = 12, 4
    k = torch.zeros(2, T, 2)
    k[0, 1, 0] = 1.0  # block 0, dim 0
    k[0, 5, 1] = 1.0  # block 1, dim 1
    k[1, 5, 0] = 1.0  # batch 1: block 1, dim 0
    q = torch.zeros(2, T, 2, 2)
    q[:, :, 0, 0] = 1.0  # group 0 looks at dim 0
    q[:, :, 1, 1] = 1.0  # group 1 looks at dim 1
    bi = ops.index_topk(q, k, block_size=bs, topk=2)
    assert as_sets(bi[:, :, 11:12]) == [[[0, 2]], [[1, 2]], [[1, 2]], [[0, 2]]]


def test_index_topk_T1_and_T_below_block():
    q, k = torch.randn(1, 1, 2, 3), torch.randn(1, 1, 3)
    assert ops.index_topk(q, k, block_size=128, topk=16)[0, :, 0].tolist() == [[0] + [-1] * 15] * 2
    q, k = torch.randn(2, 50, 2, 3), torch.randn(2, 50, 3)
    bi = ops.index_topk(q, k, block_size=128, topk=4)
    assert (bi[..., 0] == 0).all() and (bi[..., 1:] == -1).all()


@settings(max_examples=25, deadline=None)
@given(
    B=st.integers(1, 2), T=st.integers(1, 40), G=st.integers(1, 3), Di=st.integers(1, 5),
    bs=st.sampled_from([1, 3, 4, 8]), topk=st.integers(2, 6), local=st.integers(1, 2),
    init=st.integers(0, 1), seed=st.integers(0, 2**16),
)
def test_index_topk_matches_naive(B, T, G, Di, bs, topk, local, init, seed):
    if topk < local + init:
        topk = local + init
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, G, Di, generator=g, dtype=torch.float64)
    k = torch.randn(B, T, Di, generator=g, dtype=torch.float64)
    bi = ops.index_topk(q, k, block_size=bs, topk=topk, local_blocks=local, init_blocks=init)
    assert rows_valid_first(bi)
    assert as_sets(bi) == as_sets(naive_index_topk(q, k, bs, topk, local, init))


@settings(max_examples=25, deadline=None)
@given(
    B=st.integers(1, 2), T=st.integers(1, 6), Lk=st.integers(1, 40), G=st.integers(1, 3),
    bs=st.sampled_from([1, 3, 4, 8]), topk=st.integers(2, 6), local=st.integers(1, 2), init=st.integers(0, 1),
    seed=st.integers(0, 2**16),
)
def test_select_blocks_at_any_positions_matches_naive(B, T, Lk, G, bs, topk, local, init, seed):
    """The one selection rule at arbitrary per-row query positions (rows of different lengths, queries
    anywhere in the keys): the exact row order of the naive restatement, and the token mask."""
    from msakit.ops.index_topk import select_blocks, selected_token_mask

    topk = max(topk, local + init)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, G, 3, generator=g, dtype=torch.float64)
    k = torch.randn(B, Lk, 3, generator=g, dtype=torch.float64)
    pos = torch.randint(0, Lk, (B, T), generator=g)
    bi = select_blocks(q, k, block_size=bs, topk=topk, local_blocks=local, init_blocks=init, positions=pos)
    assert torch.equal(bi, naive_index_topk(q, k, bs, topk, local, init, positions=pos.tolist()))
    mask = selected_token_mask(bi, pos, Lk, block_size=bs)
    for b in range(B):
        for r in range(G):
            for t in range(T):
                want = selected_token_set(bi[b, r, t].tolist(), int(pos[b, t]), bs)
                assert mask[b, r, t].nonzero().flatten().tolist() == want


# ---------------------------------------------------------------- sparse_attention
def test_sparse_attention_hand():
    # one head, D = 1, scale 1: query 2 selects block 0 only (tokens 0, 1) -> softmax over k = [0, ln 3]
    bs = 2
    q = torch.ones(1, 3, 1, 1)
    k = torch.tensor([0.0, math.log(3.0), 5.0]).view(1, 3, 1, 1)
    v = torch.tensor([1.0, 5.0, 100.0]).view(1, 3, 1, 1)
    bi = torch.tensor([[0, -1], [0, -1], [0, -1]], dtype=torch.int32).view(1, 1, 3, 2)
    o, lse = ops.sparse_attention(q, k, v, bi, block_size=bs, softmax_scale=1.0, return_lse=True)
    assert o[0, 2, 0, 0].item() == pytest.approx(0.25 * 1 + 0.75 * 5)
    assert lse[0, 0, 2].item() == pytest.approx(math.log(4.0))
    assert o[0, 0, 0, 0].item() == pytest.approx(1.0)  # query 0 sees only token 0
    assert lse.dtype == torch.float32 and o.dtype == q.dtype


def test_sparse_attention_empty_row_and_duplicates():
    q, k, v = torch.randn(1, 6, 2, 4), torch.randn(1, 6, 1, 4), torch.randn(1, 6, 1, 4)
    bi = torch.full((1, 1, 6, 3), -1, dtype=torch.int32)
    bi[0, 0, 4] = torch.tensor([2, 2, 0])  # block 2 is in query 4's future: only block 0 counts
    bi[0, 0, 5] = torch.tensor([0, 0, 1])
    o, lse = ops.sparse_attention(q, k, v, bi, block_size=2, return_lse=True)
    assert torch.isneginf(lse[0, :, 0]).all() and (o[0, 0] == 0).all()
    ref_o, ref_lse = naive_sparse_attention(q, k, v, bi, 2)
    torch.testing.assert_close(o.double(), ref_o, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T,bs", [(1, 4), (7, 16), (33, 8), (64, 16)])
def test_sparse_all_blocks_equals_dense(T, bs):
    torch.manual_seed(T)
    B, Hq, G, D = 2, 6, 2, 16
    q, k, v = torch.randn(B, T, Hq, D), torch.randn(B, T, G, D), torch.randn(B, T, G, D)
    nb = (T + bs - 1) // bs
    bi = torch.arange(nb, dtype=torch.int32).expand(B, G, T, nb).contiguous()  # blocks after the query too
    o = ops.sparse_attention(q, k, v, bi, block_size=bs, validate=False)  # unvalidated: later blocks add nothing
    torch.testing.assert_close(o, ops.dense_attention(q, k, v), rtol=1e-5, atol=1e-5)
    if nb > 1:
        with pytest.raises(ValueError, match="block_idx.*after the query"):
            ops.sparse_attention(q, k, v, bi, block_size=bs)
    causal = bi.masked_fill(bi > (torch.arange(T) // bs).view(1, 1, T, 1), -1)
    torch.testing.assert_close(ops.sparse_attention(q, k, v, causal, block_size=bs), o, rtol=1e-5, atol=1e-5)


@settings(max_examples=15, deadline=None)
@given(B=st.integers(1, 2), T=st.integers(1, 24), G=st.integers(1, 2), hpg=st.integers(1, 3),
       bs=st.sampled_from([2, 4, 8]), topk=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_msa_attention_matches_naive(B, T, G, hpg, bs, topk, seed):
    g = torch.Generator().manual_seed(seed)
    D, Di = 4, 3
    q = torch.randn(B, T, G * hpg, D, generator=g, dtype=torch.float64)
    k, v = torch.randn(B, T, G, D, generator=g, dtype=torch.float64), torch.randn(B, T, G, D, generator=g, dtype=torch.float64)
    qi, ki = torch.randn(B, T, G, Di, generator=g, dtype=torch.float64), torch.randn(B, T, Di, generator=g, dtype=torch.float64)
    o, lse, bi = ops.msa_attention(q, k, v, qi, ki, block_size=bs, topk=topk, return_lse=True, return_block_idx=True)
    assert as_sets(bi) == as_sets(naive_index_topk(qi, ki, bs, topk))
    ro, rlse = naive_sparse_attention(q, k, v, bi, bs)
    torch.testing.assert_close(o, ro, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(lse.double(), rlse, rtol=1e-6, atol=1e-6)


def test_sparse_attention_backward_matches_naive_autograd():
    torch.manual_seed(0)
    B, T, Hq, G, D, bs = 1, 10, 4, 2, 3, 4
    q = torch.randn(B, T, Hq, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, T, G, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, T, G, D, dtype=torch.float64, requires_grad=True)
    bi = ops.index_topk(torch.randn(B, T, G, 2), torch.randn(B, T, 2), block_size=bs, topk=2)
    torch.autograd.gradcheck(lambda a, b_, c: ops.sparse_attention(a, b_, c, bi, block_size=bs), (q, k, v))


# ---------------------------------------------------------------- index_kl_loss
def _kl_inputs(B=2, T=13, Hq=4, G=2, D=5, Di=3, bs=4, topk=2, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hq, D, generator=g, dtype=dtype)
    k = torch.randn(B, T, G, D, generator=g, dtype=dtype)
    qi = torch.randn(B, T, G, Di, generator=g, dtype=dtype)
    ki = torch.randn(B, T, Di, generator=g, dtype=dtype)
    bi = ops.index_topk(qi, ki, block_size=bs, topk=topk)
    return q, k, qi, ki, bi


def test_index_kl_matches_naive():
    q, k, qi, ki, bi = _kl_inputs()
    loss = ops.index_kl_loss(q, k, qi, ki, bi, block_size=4)
    assert loss.item() == pytest.approx(naive_index_kl(q, k, qi, ki, bi, 4), rel=1e-9)


def test_index_kl_zero_when_index_equals_main():
    # one head per group, same q/k in both branches and the same scale -> P == P_idx -> KL = 0
    q, k, _, _, _ = _kl_inputs(Hq=2, G=2, D=3)
    ki = k[:, :, 0]
    k1 = k[:, :, :1].expand_as(k).contiguous()
    bi = ops.index_topk(q, ki, block_size=4, topk=2)
    loss = ops.index_kl_loss(q, k1, q, ki, bi, block_size=4, softmax_scale=0.5, index_softmax_scale=0.5)
    assert abs(loss.item()) < 1e-12


def test_index_kl_gradcheck_float64():
    q, k, qi, ki, bi = _kl_inputs(B=1, T=9, Hq=2, G=1, D=3, Di=2, bs=4, topk=2)
    qi.requires_grad_(True)
    ki.requires_grad_(True)
    torch.autograd.gradcheck(lambda a, b_: ops.index_kl_loss(q, k, a, b_, bi, block_size=4), (qi, ki))


def test_index_kl_no_grad_to_main_branch():
    q, k, qi, ki, bi = _kl_inputs()
    for t in (q, k, qi, ki):
        t.requires_grad_(True)
    ops.index_kl_loss(q, k, qi, ki, bi, block_size=4).backward()
    assert q.grad is None and k.grad is None
    assert qi.grad is not None and ki.grad is not None and qi.grad.abs().sum() > 0


# ---------------------------------------------------------------- bad input
def test_bad_input_raises_value_error_naming_the_argument():
    q, k, v = torch.randn(1, 8, 4, 8), torch.randn(1, 8, 2, 8), torch.randn(1, 8, 2, 8)
    qi, ki = torch.randn(1, 8, 2, 4), torch.randn(1, 8, 4)
    bi = ops.index_topk(qi, ki, block_size=4, topk=2)
    cases = [
        (lambda: ops.sparse_attention(q[0], k, v, bi, block_size=4), "q"),
        (lambda: ops.sparse_attention(torch.randn(1, 8, 3, 8), k, v, bi, block_size=4), "Hq"),
        (lambda: ops.sparse_attention(q, k.double(), v, bi, block_size=4), "k"),
        (lambda: ops.sparse_attention(q, k, v[:, :4], bi, block_size=4), "v"),
        (lambda: ops.sparse_attention(q, k, v, bi + 5, block_size=4), "block_idx"),
        (lambda: ops.sparse_attention(q, k, v, bi.float(), block_size=4), "block_idx"),
        (lambda: ops.sparse_attention(q, k, v, bi, block_size=0), "block_size"),
        (lambda: ops.index_topk(qi, ki, block_size=4, topk=1, local_blocks=1, init_blocks=1), "topk"),
        (lambda: ops.index_topk(qi, ki[:, :5], block_size=4), "k_idx"),
        (lambda: ops.index_topk(qi, ki, block_size=-1), "block_size"),
        (lambda: ops.index_kl_loss(q, k, qi[:, :, :1], ki, bi, block_size=4), "q_idx"),
        (lambda: ops.dense_attention(q, k, v, softmax_scale=-1.0), "softmax_scale"),
        # zero-sized head / index dims (a default scale 1 / sqrt(0) used to raise ZeroDivisionError)
        (lambda: ops.sparse_attention(q[..., :0], k[..., :0], v[..., :0], bi, block_size=4), "head dim"),
        (lambda: ops.dense_attention(q[..., :0], k[..., :0], v[..., :0]), "head dim"),
        (lambda: ops.index_topk(qi[..., :0], ki[..., :0], block_size=4, topk=2), "index dim"),
        (lambda: ops.msa_attention(q, k, v, qi[..., :0], ki[..., :0], block_size=4, topk=2), "index dim"),
        (lambda: ops.msa_attention(q[..., :0], k[..., :0], v[..., :0], qi, ki, block_size=4, topk=2), "head dim"),
        (lambda: ops.index_kl_loss(q[..., :0], k[..., :0], qi, ki, bi, block_size=4), "head dim"),
    ]
    for fn, name in cases:
        with pytest.raises(ValueError, match=name):
            fn()
    # validate=False skips only the value range check (a host sync on CUDA), not the layout checks
    bad = bi.clone()
    bad[..., 0] = 99  # out of range (ignored by the attention: ids past a row's own block)
    ops.sparse_attention(q, k, v, bad, block_size=4, validate=False)
    ops.index_kl_loss(q, k, qi, ki, bad, block_size=4, validate=False)
    with pytest.raises(ValueError, match="block_idx"):
        ops.sparse_attention(q, k, v, bi.float(), block_size=4, validate=False)


def test_reference_runs_long_sequence_in_bounded_memory():
    """T = 16384 through index_topk + sparse_attention on the CPU (chunked references: 8 query
    chunks each; the dense [T, T] scores alone would be 1 GiB)."""
    torch.manual_seed(0)
    B, T, Hq, G, D, Di = 1, 16384, 2, 1, 16, 16
    q, k, v = torch.randn(B, T, Hq, D), torch.randn(B, T, G, D), torch.randn(B, T, G, D)
    qi, ki = torch.randn(B, T, G, Di), torch.randn(B, T, Di)
    o, bi = ops.msa_attention(q, k, v, qi, ki, block_size=128, topk=4, return_block_idx=True)
    assert o.shape == q.shape and torch.isfinite(o).all()
    assert (bi[0, 0, -1] >= 0).all() and int(bi[0, 0, -1].max()) == T // 128 - 1
