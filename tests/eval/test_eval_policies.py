"""Selection policies: valid block_idx within the budget, the window's and the oracle's meaning
(the oracle against a row-by-row brute force), msa = ops.index_topk."""

from __future__ import annotations

import math
import pytest
import torch

from msakit import ops
from msakit.ops.index_topk import Selection
from msakit.eval import make_policy, oracle_block_idx, window_block_idx


def _qk(B=1, T=37, Hq=4, G=2, D=8, Di=6, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    return r(B, T, Hq, D), r(B, T, G, D), r(B, T, G, Di), r(B, T, Di)


def _check_valid(bidx, T, block_size, topk, Tk=None):
    """The block_idx contract: int32 [B, G, T, topk]; valid ids first, unique, <= own block; -1 after."""
    Tk = T if Tk is None else Tk
    assert bidx.dtype == torch.int32 and bidx.shape[2:] == (T, topk)
    for row in bidx.reshape(-1, T, topk):
        for i in range(T):
            ids = row[i].tolist()
            own = (Tk - T + i) // block_size
            valid = [x for x in ids if x >= 0]
            assert ids[:len(valid)] == valid and all(x == -1 for x in ids[len(valid):])
            assert len(set(valid)) == len(valid) and all(0 <= x <= own for x in valid)
            assert own in valid  # the local block is always kept
            assert len(valid) == min(topk, own + 1)


@pytest.mark.parametrize("first_block", [False, True])
@pytest.mark.parametrize("T,bs,topk", [(37, 4, 3), (64, 8, 4), (5, 8, 2), (50, 4, 1)])
def test_window(first_block, T, bs, topk):
    if first_block and topk < 2:
        with pytest.raises(ValueError, match="topk"):
            window_block_idx(1, 2, T, block_size=bs, topk=topk, first_block=True)
        return
    bidx = window_block_idx(2, 3, T, block_size=bs, topk=topk, first_block=first_block)
    assert bidx.shape == (2, 3, T, topk)
    for i in range(T):
        own = i // bs
        span = topk - 1 if first_block else topk
        want = {b for b in range(own - span + 1, own + 1) if b >= 0} | ({0} if first_block else set())
        got = {x for x in bidx[1, 2, i].tolist() if x >= 0}
        assert got == want
    _check_valid(bidx, T, bs, topk)


def _oracle_brute(q, k, bs, topk, local, init, scale):
    """Row by row: mass(b) = mean_h sum_{j in b, j <= i} softmax_j(scale q_h(i) . k(j)); forced, then
    descending mass (ties to the lower id)."""
    B, T, Hq, D = q.shape
    G = k.shape[2]
    hpg = Hq // G
    out = []
    for b in range(B):
        for r in range(G):
            for i in range(T):
                mass = [0.0] * (i // bs + 1)
                for h in range(r * hpg, (r + 1) * hpg):
                    s = torch.stack([scale * torch.dot(q[b, i, h], k[b, j, r]) for j in range(i + 1)])
                    p = torch.softmax(s, 0)
                    for j in range(i + 1):
                        mass[j // bs] += float(p[j]) / hpg
                own = i // bs
                forced = [x for x in range(own + 1) if x > own - local or x < init]
                rest = sorted((x for x in range(own + 1) if x not in forced), key=lambda x: (-mass[x], x))
                out.append(((b, r, i), set((forced + rest)[:topk])))
    return out


@pytest.mark.parametrize("local,init", [(1, 0), (1, 1), (2, 0)])
def test_oracle_equals_brute_force(local, init):
    q, k, _, _ = _qk(B=2, T=29, Hq=4, G=2, D=8, seed=1)
    bs, topk = 4, 3
    got = oracle_block_idx(q, k, Selection(bs, topk, local, init))
    _check_valid(got, 29, bs, topk)
    for (b, r, i), want in _oracle_brute(q, k, bs, topk, local, init, 1 / math.sqrt(8)):
        assert {x for x in got[b, r, i].tolist() if x >= 0} == want, (b, r, i)


def test_oracle_chunking_and_scale():
    q, k, _, _ = _qk(B=1, T=45, seed=2)
    a = oracle_block_idx(q, k, Selection(4, 4), max_elements=1 << 30)
    b = oracle_block_idx(q, k, Selection(4, 4), max_elements=1)  # one query per chunk
    assert torch.equal(a, b)
    c = oracle_block_idx(q * 3, k, Selection(4, 4), softmax_scale=1 / (3 * math.sqrt(8)))
    assert torch.equal(a, c)


def test_oracle_picks_the_attended_block():
    """A query whose head attends one far key: the oracle selects that key's block."""
    T, bs = 32, 4
    q = torch.zeros(1, T, 2, 4, dtype=torch.float64)
    k = torch.zeros(1, T, 1, 4, dtype=torch.float64)
    k[0, 5, 0, 0] = 10.0  # block 1
    q[0, 30, :, 0] = 10.0
    got = oracle_block_idx(q, k, Selection(bs, 2))
    assert set(got[0, 0, 30].tolist()) == {7, 1}


def test_oracle_decode_rows():
    """Tk > T: the queries are the last T positions; equal to the rows of the full computation."""
    q, k, _, _ = _qk(B=1, T=40, seed=3)
    full = oracle_block_idx(q, k, Selection(4, 3))
    tail = oracle_block_idx(q[:, -7:], k, Selection(4, 3))
    _check_valid(tail, 7, 4, 3, Tk=40)
    assert torch.equal(full[:, :, -7:], tail)


@pytest.mark.parametrize("name", ["msa", "window", "window0", "oracle"])
def test_policies_through_hook_signature(name):
    q, k, qi, ki = _qk(B=2, T=50, seed=4, dtype=torch.float32)
    budget = Selection(8, 3)
    sel = Selection(8, 5)
    fn = make_policy(name, budget)
    bidx = fn(3, q, k, qi, ki, sel)
    assert bidx.shape == (2, 2, 50, 3) and bidx.dtype == torch.int32
    _check_valid(bidx, 50, 8, 3)
    if name == "msa":
        assert torch.equal(bidx, ops.index_topk(qi, ki, block_size=8, topk=3))
    # sparse attention over the policy's selection runs and, with every block selected, equals dense
    o = ops.sparse_attention(q, k, k, bidx, block_size=8)
    assert o.shape == q.shape
    full = make_policy(name, Selection(8, 7))(0, q, k, qi, ki, sel)
    tol = 1e-5
    torch.testing.assert_close(ops.sparse_attention(q, k, k, full, block_size=8), ops.dense_attention(q, k, k),
                               atol=tol, rtol=tol)


def test_policy_keeps_layer_forcing():
    q, k, qi, ki = _qk(B=1, T=64, seed=5, dtype=torch.float32)
    sel = Selection(8, 4, 1, 1)
    for name in ("msa", "oracle"):
        bidx = make_policy(name, Selection(8, 3))(0, q, k, qi, ki, sel)
        assert all(0 in row.tolist() for row in bidx.reshape(-1, 3))


def test_policy_errors():
    q, k, qi, ki = _qk(T=16, dtype=torch.float32)
    sel = Selection(16, 2)
    with pytest.raises(ValueError, match="block_size 16 but the budget"):
        make_policy("window", Selection(8, 2))(0, q, k, qi, ki, sel)
    with pytest.raises(ValueError, match="q_idx"):
        make_policy("msa", Selection(16, 2))(0, q, k, None, None, sel)
    with pytest.raises(ValueError, match="policy must be"):
        make_policy("random", Selection(8, 2))
    with pytest.raises(ValueError, match="groups"):
        oracle_block_idx(q[:, :, :3], k, Selection(4, 2))
    with pytest.raises(ValueError, match="Tk"):
        oracle_block_idx(q, k[:, :8], Selection(4, 2))


def test_budget_parse():
    b = Selection.parse("block64-top8")
    assert (b.block_size, b.topk, b.keys, str(b)) == (64, 8, 512, "block64-top8")
    for bad in ("64x8", "block0-top8", "block64-top", "block-64-top8"):
        with pytest.raises(ValueError):
            Selection.parse(bad)


def test_oracle_kernel_path_equals_chunked(monkeypatch):
    """A whole sequence on the kernel path (forced here under the interpreter) selects what the
    chunked PyTorch path selects."""
    import functools

    from msakit.eval import policies as pol
    from msakit.ops.dispatch import interpret_mode, triton_available

    if not (triton_available() and interpret_mode()):
        pytest.skip("needs triton under TRITON_INTERPRET=1")
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 50, 4, 16, generator=gen), torch.randn(1, 50, 2, 16, generator=gen)
    sel = Selection(8, 3, local_blocks=1, init_blocks=1)
    want = pol.oracle_block_idx(q, k, sel, softmax_scale=0.3)
    monkeypatch.setattr(pol, "_on_kernel", lambda q: True)
    calls = []

    def mass(*a, **kw):
        calls.append(1)
        return pol_mass(*a, backend="triton", **kw)

    pol_mass = functools.partial(pol.block_attention_mass)
    monkeypatch.setattr(pol, "block_attention_mass", mass)
    got = pol.oracle_block_idx(q, k, sel, softmax_scale=0.3)
    assert calls and torch.equal(got, want)
    monkeypatch.setattr(pol, "ORACLE_KERNEL_MAX_BYTES", 0)  # past the bound: the chunks again
    calls.clear()
    assert torch.equal(pol.oracle_block_idx(q, k, sel, softmax_scale=0.3), want) and not calls
