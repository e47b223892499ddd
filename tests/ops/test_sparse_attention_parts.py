"""Parts of the Triton sparse attention tested on their own, on the CPU through the Triton
interpreter: the forward's slot merge and the backward's dq reduce on synthetic partials (only
valid slots are read), the work list against a plain-torch oracle (integers: exact), and the
whole forward / backward on NaN-poisoned buffers against the reference."""

from __future__ import annotations

import math

import pytest  # noqa: E402
import torch  # noqa: E402

from msakit.ops.dispatch import interpret_mode  # noqa: E402
from msakit.ops.sparse_attention import sparse_attention_reference  # noqa: E402
from tolerances import assert_close_sums  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not interpret_mode(), reason="needs TRITON_INTERPRET=1 before triton is imported"),
    pytest.mark.usefixtures("one_thread"),
]


def kernels():
    from msakit.ops.sparse_attention import triton as k

    return k


def inputs(B, T, Hq, G, D, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, h, D, generator=g).to(dtype) for h in (Hq, G, G))
    return q, k, v


def messy(B, G, T, bs, topk, seed=0, dtype=torch.int32, empty_rows=0):
    """Ids in [-1, nblocks): duplicates, future blocks, -1 anywhere, the own block last."""
    g = torch.Generator().manual_seed(seed + 1)
    nb = (T + bs - 1) // bs
    bi = torch.randint(-1, nb, (B, G, T, topk), generator=g, dtype=torch.int64)
    if topk > 1:
        bi[..., 1] = bi[..., 0]
    bi[..., -1] = (torch.arange(T) // bs).view(1, 1, T)
    if empty_rows:
        bi[0, :, torch.randperm(T, generator=g)[:empty_rows]] = -1
    return bi.to(dtype)


def varlen_case(seed=11, G=2, topk=3, bs=16):
    cu = torch.tensor([0, 5, 5, 37, 80, 81], dtype=torch.int32)  # an empty and a 1-token document
    total = 81
    g = torch.Generator().manual_seed(seed)
    bi = torch.randint(-1, 3, (1, G, total, topk), generator=g, dtype=torch.int32)
    starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1])
    bi[..., -1] = ((torch.arange(total) - starts) // bs).to(torch.int32)
    return cu, bi


# B, T, Hq, G, D, bs, topk
CASES = {
    "partial_last_block": (1, 75, 4, 2, 32, 16, 3),
    "groups4_batch2": (2, 64, 8, 4, 16, 16, 3),
    "odd_heads_dims": (2, 45, 6, 2, 24, 12, 5),  # 3 heads per group, D = 24, odd topk
    "hpg16": (1, 40, 16, 1, 16, 8, 4),  # M3's 16 heads per group
    "groups3_empty_group": (1, 64, 9, 3, 16, 8, 3),  # see `case_selection`: groups without entries in a chunk
    "hpg7": (1, 40, 14, 2, 16, 8, 3),  # 7 heads per group (7:1 GQA)
}


def case_selection(case: str):
    B, T, Hq, G, D, bs, topk = CASES[case]
    bi = messy(B, G, T, bs, topk, seed=T, empty_rows=3)
    if case == "groups3_empty_group":  # with 29-row chunks: group 1 selects nothing in chunk 0, group 2 in chunk 1
        bi[:, 1, :29] = -1
        bi[:, 2, 29:58] = -1
    return bi


def _check_ref(o, lse, q, k, v, bi, bs, cu=None):
    if cu is None:
        ro, rl = sparse_attention_reference(q, k, v, bi, block_size=bs, return_lse=True)
    else:
        ro, rl = sparse_attention_reference(q, k, v, bi, cu_seqlens=cu, block_size=bs, return_lse=True)
    n = q.shape[-1] + bs + bi.shape[-1]
    assert_close_sums(lse, rl, n=n, msg="lse")
    assert_close_sums(o, ro, n=n, msg="o")


def build_items_torch(
    sel: torch.Tensor,
    doc_start: torch.Tensor,
    pos: torch.Tensor,
    n0: int,
    N: int,
    block_size: int,
    item_queries: int,
    nkeys_bound: int,
) -> dict:
    """The work list of rows n0 .. n0+C-1 in plain torch ops (sel = their selections, int [G, C, K]):
    the oracle of the kernels' `_build_items` (same fields; padding items aside)."""
    G, C, K = sel.shape
    dev = sel.device
    # canonical selection: a set of blocks with a token j <= i, ascending, valid first
    s = sel.long().sort(dim=-1).values
    dup = torch.zeros_like(s, dtype=torch.bool)
    dup[..., 1:] = s[..., 1:] == s[..., :-1]
    s = s.masked_fill(dup | (s * block_size > pos.view(1, C, 1)), -1)
    big = torch.iinfo(torch.int64).max
    s = torch.where(s < 0, torch.full_like(s, big), s).sort(dim=-1).values
    valid = s != big
    nvalid = valid.sum(dim=-1, dtype=torch.int32)
    # key = g * N + start token of the block; sentinel G * N sorts last
    kspace = G * N
    kdt = torch.int32 if kspace < 2**31 - 1 else torch.int64
    gg = torch.arange(G, device=dev, dtype=torch.int64).view(G, 1, 1) * N
    key = torch.where(valid, gg + doc_start.view(1, C, 1) + s.clamp(max=N) * block_size, torch.full_like(s, kspace))
    skey, order = torch.sort(key.reshape(-1).to(kdt), stable=True)
    M = G * C * K
    ent_q = (n0 + (order // K) % C).to(torch.int32)
    inv = torch.empty(M, dtype=torch.int32, device=dev)
    inv[order] = torch.arange(M, device=dev, dtype=torch.int32)
    idx = torch.arange(M, device=dev, dtype=torch.int64)
    # first entry of each entry's key run, and one past its last (binary searches in the sorted
    # keys: torch's cummax / cummin scans took 45 ms of a 103 ms forward at T = 128K on the H200)
    run_start = torch.searchsorted(skey, skey, right=False)
    run_end = torch.searchsorted(skey, skey, right=True)
    rank = idx - run_start
    first = (skey < kspace) & (rank % item_queries == 0)
    cnt = torch.clamp(run_end - idx, max=item_queries)
    max_items = (M + item_queries - 1) // item_queries + min(M, nkeys_bound)
    # item t starts at the (t+1)-th `first` entry (no scatter, no host sync)
    csum = torch.cumsum(first, 0)
    st = torch.searchsorted(csum, torch.arange(1, max_items + 1, device=dev, dtype=csum.dtype))
    real = st < M
    st = st.clamp(max=M - 1)
    it_start = st
    it_count = torch.where(real, cnt[st], torch.zeros_like(st)).to(torch.int32)
    it_key = skey[st].long()
    # group g's entries and items: those whose key lies below (g + 1) * N and not below g * N
    bounds = torch.arange(G + 1, device=dev, dtype=torch.int64) * N
    grp_ent = (skey.long().view(1, -1) < bounds.view(-1, 1)).sum(1).to(torch.int32)
    grp_item = ((it_key.view(1, -1) < bounds.view(-1, 1)) & real.view(1, -1)).sum(1).to(torch.int32)
    return dict(ent_q=ent_q, it_key=it_key, it_start=it_start, it_count=it_count, nvalid=nvalid, inv=inv,
                grp_ent=grp_ent, grp_item=grp_item, max_items=max_items)




def _valid_entries(it, G, c, topk):
    used = torch.zeros(G * c * topk, dtype=torch.bool)
    for g in range(G):
        for t in range(c):
            nv = int(it.nvalid[g, t])
            used[it.inv[(g * c + t) * topk : (g * c + t) * topk + nv].long()] = True
    return used


@pytest.mark.parametrize("case", list(CASES))
def test_merge_kernels(case):
    """The forward's slot merge and the backward's dq reduce on synthetic partials, NaN in every
    entry no valid slot names, at two chunk offsets: equal to the merge written in torch (a
    logsumexp-weighted sum / a plain sum over the row's valid slots) up to summation order."""
    K = kernels()
    B, T, Hq, G, D, bs, topk = CASES[case]
    N = B * T
    bi = messy(B, G, T, bs, topk, seed=T, empty_rows=3)
    geo = K._Geom(B, T, N, Hq, G, D, topk, Hq // G, bs, G * (N // bs + B + 1))
    sel = K._selection_rows(bi, geo)
    gen = torch.Generator().manual_seed(len(case))
    for n0, c in ((0, N), (5, min(29, N - 5))):
        it = K._items(sel, n0, c, geo, None, bs, 4, "cpu")
        used = _valid_entries(it, G, c, topk)
        P = torch.randn(G * c * topk, geo.hpg, D, generator=gen)
        LP = torch.randn(G * c * topk, geo.hpg, generator=gen) * 3
        P[~used], LP[~used] = float("nan"), float("nan")
        o = torch.full((B, T, Hq, D), float("nan"))
        lse = torch.full((B, Hq, T), float("nan"))
        dq = torch.full((B, T, Hq, D), float("nan"))
        for g in range(G):  # group g's partials alone, entry-major from its first entry, NaN after
            e0, e1 = int(it.grp_ent[g]), int(it.grp_ent[g + 1])
            Pg = torch.full((e1 - e0 + 2, geo.hpg, D), float("nan"))
            LPg = torch.full((e1 - e0 + 2, geo.hpg), float("nan"))
            Pg[: e1 - e0], LPg[: e1 - e0] = P[e0:e1], LP[e0:e1]
            K._fwd_merge(Pg, LPg, it, o, lse, n0, c, geo, g)
            K._dq_reduce(Pg, it, dq, n0, c, geo, g)
        # the same merges in torch, per (group, row): slots s < nvalid name entries inv[g, t, s]
        want_o = torch.zeros(c, Hq, D, dtype=torch.float64)
        want_l = torch.full((c, Hq), float("-inf"), dtype=torch.float64)
        want_dq = torch.zeros(c, Hq, D, dtype=torch.float64)
        for g in range(G):
            for t in range(c):
                nv = int(it.nvalid[g, t])
                ents = it.inv[(g * c + t) * topk : (g * c + t) * topk + nv].long()
                heads = slice(g * geo.hpg, (g + 1) * geo.hpg)
                if nv == 0:
                    continue
                lp, p = LP[ents].double(), P[ents].double()  # [nv, hpg], [nv, hpg, D]
                l = torch.logsumexp(lp, 0)
                want_l[t, heads] = l
                want_o[t, heads] = (torch.exp(lp - l)[..., None] * p).sum(0)
                want_dq[t, heads] = p.sum(0)
        rows = slice(n0, n0 + c)
        got_o = o.reshape(N, Hq, D)[rows]
        got_l = lse.permute(0, 2, 1).reshape(N, Hq)[rows]
        got_dq = dq.reshape(N, Hq, D)[rows]
        empty = torch.isneginf(want_l)
        assert torch.equal(torch.isneginf(got_l), empty)
        assert not torch.isnan(got_o).any() and not torch.isnan(got_dq).any()
        assert_close_sums(got_o, want_o.float(), n=topk, dtype=torch.float32, msg="o")
        assert_close_sums(got_l.masked_fill(empty, 0), want_l.float().masked_fill(empty, 0), n=topk, dtype=torch.float32, msg="lse")
        assert_close_sums(got_dq, want_dq.float(), n=topk, dtype=torch.float32, msg="dq")


@pytest.mark.parametrize("case", ["odd_heads_dims", "hpg16", "varlen", "groups3_empty_group", "hpg7"])
def test_poisoned_end_to_end(case):
    """Forward and backward with NaN-poisoned partials (again before every group and chunk) and
    outputs and small chunks: every output element is written, the forward equals the reference
    and the backward the reference's gradients (up to summation order); also with a group that
    has no entry in a chunk, and 3 or 7 heads per group."""
    K = kernels()
    cu = None
    if case == "varlen":
        cu, bi = varlen_case()
        B, T, Hq, G, D, bs = 1, 81, 4, 2, 16, 16
    else:
        B, T, Hq, G, D, bs, topk = CASES[case]
        bi = case_selection(case)
    q, k, v = inputs(B, T, Hq, G, D, seed=len(case))
    scale = 1.0 / math.sqrt(D)
    o = torch.full_like(q, float("nan"))
    lse = torch.full((B, Hq, T), float("nan"))
    K.sparse_attention_fwd_triton(q, k, v, bi, cu, bs, scale, out=o, lse_out=lse, poison=True, chunk_rows=29)
    _check_ref(o, lse, q, k, v, bi, bs, cu)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(3))
    dq = torch.full_like(q, float("nan"))
    dq, dk, dv = K.sparse_attention_bwd_triton(do, q, k, v, o, lse, None, bi, cu, bs, scale, dq_out=dq, poison=True,
                                               chunk_rows=29)
    qs, ks, vs = (t.clone().requires_grad_(True) for t in (q, k, v))
    if cu is None:
        ro = sparse_attention_reference(qs, ks, vs, bi, block_size=bs, softmax_scale=scale)
    else:
        ro = sparse_attention_reference(qs, ks, vs, bi, cu_seqlens=cu, block_size=bs, softmax_scale=scale)
    want = torch.autograd.grad(ro, (qs, ks, vs), do)
    n = D + T * (Hq // G) * bi.shape[-1]
    for name, a, b in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        assert_close_sums(a, b, n=n, msg=name)


def _same_items(a, b: dict):
    assert a.max_items == b["max_items"]
    for f in ("ent_q", "inv", "nvalid", "it_count", "grp_ent", "grp_item"):
        x, y = getattr(a, f), b[f]
        assert x.dtype == y.dtype and torch.equal(x, y), f
    real = a.it_count > 0
    for f in ("it_key", "it_start"):
        x, y = getattr(a, f), b[f]
        assert x.dtype == y.dtype and torch.equal(x[real], y[real]), f


def _group_bounds_hold(it, entry_bound: int, item_q: int, geo):
    """Each group's valid entries fit the host-side bound that sizes the partial buffer, and
    its items the launch grid derived from it."""
    ents = (it.grp_ent[1:] - it.grp_ent[:-1]).tolist()
    items = (it.grp_item[1:] - it.grp_item[:-1]).tolist()
    assert max(ents) <= entry_bound, (ents, entry_bound)
    assert max(items) <= kernels()._group_grid(entry_bound, item_q, geo), (items, entry_bound)


@pytest.mark.parametrize("topk,dtype", [(1, torch.int32), (4, torch.int64), (6, torch.int32)])
def test_work_list_equals_oracle(topk, dtype):
    """`_build_items` (Triton kernels) builds the torch oracle's work list: same entries, inverse
    map, valid counts and items, for chunk offsets, item sizes, batch > 1 (a strided selection
    view), documents given explicitly or as the B rows, int32 / int64 ids."""
    K = kernels()
    for B, T, G, bs in ((1, 90, 2, 8), (3, 37, 2, 8), (2, 20, 4, 16)):
        N = B * T
        bi = messy(B, G, T, bs, topk, seed=B * T + topk, dtype=dtype, empty_rows=2)
        geo = K._Geom(B, T, N, 2 * G, G, 16, topk, 2, bs, G * (N // bs + B + 1))
        sel = K._selection_rows(bi, geo)
        for n0, C in ((0, N), (7, min(33, N - 7)), (N - 5, 5)):
            for item_q in (1, 3, 64):
                ds, pos = K._row_docs(n0, C, T, None, "cpu")
                want = build_items_torch(sel[:, n0 : n0 + C], ds, pos, n0, N, bs, item_q, geo.nkeys_bound)
                got = K._build_items(sel[:, n0 : n0 + C], None, None, n0, N, bs, item_q, geo.nkeys_bound, T)
                _same_items(got, want)
                got = K._build_items(sel[:, n0 : n0 + C], ds, pos, n0, N, bs, item_q, geo.nkeys_bound)
                _same_items(got, want)
                _group_bounds_hold(got, K._entry_bound(n0, C, geo, None), item_q, geo)


def test_work_list_varlen():
    K = kernels()
    cu, bi = varlen_case(G=2, topk=4)
    N, G, bs = 81, 2, 16
    sel = bi[0]
    for n0, C in ((0, N), (3, 40)):
        ds, pos = K._row_docs(n0, C, N, cu, "cpu")
        want = build_items_torch(sel[:, n0 : n0 + C], ds, pos, n0, N, bs, 4, G * (N // bs + 7))
        got = K._build_items(sel[:, n0 : n0 + C], ds, pos, n0, N, bs, 4, G * (N // bs + 7))
        _same_items(got, want)
        geo = K._Geom(1, N, N, 2 * G, G, 16, 4, 2, bs, G * (N // bs + 7))
        _group_bounds_hold(got, K._entry_bound(n0, C, geo, cu), 4, geo)


def test_entry_bound_equals_brute_force():
    """`_entry_bound` (closed form) = the count of min(KS, pos // bs + 1) over the rows, for
    chunks starting anywhere (inside a document, at its start, spanning several), and it is
    the valid-slot count of one group of a selection that takes every block up to the row's."""
    K = kernels()
    for B, T, KS, bs in ((3, 37, 4, 8), (2, 50, 1, 16), (1, 100, 6, 7), (4, 9, 3, 16), (2, 64, 8, 8)):
        N = B * T
        geo = K._Geom(B, T, N, 2, 1, 16, KS, 2, bs, N // bs + B + 1)
        for n0 in sorted({0, 1, T - 1, T, T + 3, N // 2, N - 1} & set(range(N))):
            for c in sorted({1, 5, T, T + 7, N - n0}):
                c = min(c, N - n0)
                want = sum(min(KS, (m % T) // bs + 1) for m in range(n0, n0 + c))
                assert K._entry_bound(n0, c, geo, None) == want, (B, T, KS, bs, n0, c)
        assert K._entry_bound(2, 5, geo, torch.tensor([0, N], dtype=torch.int32)) == 5 * KS  # documents given: c * KS
        # tight: the full selection (own block and the ones before it; ids < 0 drop out)
        pos = torch.arange(N) % T
        full = (pos // bs).view(1, N, 1) - torch.arange(KS).view(1, 1, KS)
        for n0, c in ((0, N), (T // 2, min(N - T // 2, T + 3))):
            it = K._build_items(full[:, n0 : n0 + c].to(torch.int32), None, None, n0, N, bs, 4, geo.nkeys_bound, T)
            assert int(it.grp_ent[1]) == K._entry_bound(n0, c, geo, None)


def test_partials_hold_one_group(monkeypatch):
    """The forward's and backward's partial buffers hold one KV group: rows = HPG x the largest
    chunk's entry bound, G-fold fewer elements than the (rows, slots, all heads) buffers of the
    same chunks; allocated once per call."""
    K = kernels()
    B, T, Hq, G, D, bs, topk = CASES["groups4_batch2"]
    bi = messy(B, G, T, bs, topk, seed=T)
    q, k, v = inputs(B, T, Hq, G, D, seed=4)
    geo = K._geom(q, k, bi, bs, None)
    seen = []
    real = K._partial_buffers

    def spy(entries, geo_, dtype, with_lse, device, poison):
        bufs = real(entries, geo_, dtype, with_lse, device, poison)
        seen.append((entries, [b.numel() for b in bufs]))
        return bufs

    monkeypatch.setattr(K, "_partial_buffers", spy)
    for C in (29, None):  # several chunks; one
        seen.clear()
        o, lse = K.sparse_attention_fwd_triton(q, k, v, bi, None, bs, 0.25, chunk_rows=C)
        K.sparse_attention_bwd_triton(torch.ones_like(o), q, k, v, o, lse, None, bi, None, bs, 0.25, chunk_rows=C)
        c = C or B * T
        bound = max(K._entry_bound(n0, min(c, B * T - n0), geo, None) for n0 in range(0, B * T, c))
        assert bound < c * topk  # the first rows of a document select fewer blocks
        assert [s[0] for s in seen] == [bound, bound]  # forward, backward
        (_, (op, lp)), (_, (dqp,)) = seen
        assert op == dqp == bound * (Hq // G) * D and lp == bound * (Hq // G)
        assert op * G <= c * topk * Hq * D and lp * G <= c * topk * Hq


def test_chunk_rows_rule():
    """`chunk_rows_for`: one group's partials + 48 B of work list per (group, slot) entry per
    row; whole sequences when they fit; else multiples of 256 rows, balanced over the chunks
    (no more chunks than the unbalanced rule gives); arguments checked."""
    K = kernels()
    shape = dict(heads=64, groups=4, head_dim=128, topk=16, elt_bytes=2, lse_bytes=4)
    per_row = 16 * 16 * (128 * 2 + 4) + 4 * 16 * 48
    assert K.chunk_rows_for(per_row * 5000, tokens=4096, **shape) == 4096
    assert K.chunk_rows_for(per_row * 4096, tokens=4096, **shape) == 4096
    for tokens, budget_rows in ((1 << 20, 50116), (1 << 17, 50116), (100_000, 1000), (70_000, 300), (999, 10)):
        rows = K.chunk_rows_for(per_row * budget_rows + per_row - 1, tokens=tokens, **shape)
        unbalanced = budget_rows // 256 * 256 if budget_rows > 256 else budget_rows
        assert rows <= unbalanced and -(-tokens // rows) == -(-tokens // unbalanced)
        if unbalanced >= 256:
            assert rows % 256 == 0
    assert K.chunk_rows_for(1 << 40, tokens=10, heads=6, groups=2, head_dim=24, topk=5, elt_bytes=4) == 10
    with pytest.raises(ValueError, match="groups"):
        K.chunk_rows_for(1 << 30, tokens=10, heads=6, groups=4, head_dim=24, topk=5, elt_bytes=4)
    with pytest.raises(ValueError, match="topk"):
        K.chunk_rows_for(1 << 30, tokens=10, heads=6, groups=2, head_dim=24, topk=0, elt_bytes=4)


def test_config_must_be_a_kernel_config():
    K = kernels()
    q, k, v = inputs(1, 16, 2, 1, 16)
    bi = messy(1, 1, 16, 16, 1)
    with pytest.raises(ValueError, match="KernelConfig"):
        K.sparse_attention_fwd_triton(q, k, v, bi, None, 16, 0.25, config="m64w4p128")
