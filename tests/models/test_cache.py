"""msakit.cache.PagedKVCache: allocation, append, prefill, fork / copy-on-write, free, fp8."""

from __future__ import annotations

import pytest
import torch

from msakit.cache import PagedKVCache, quantize_fp8

G, D, DI, PS = 2, 8, 4, 4
FP8 = torch.float8_e4m3fn


def make(num_layers=1, pages=16, kv=torch.float32, idx=torch.float32, index_layers=None):
    return PagedKVCache(num_layers, pages, num_kv_heads=G, head_dim=D, index_dim=DI, page_size=PS,
                        kv_dtype=kv, index_dtype=idx, index_layers=index_layers)


def toks(T, L=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    lead = () if L is None else (L,)
    return (torch.randn(*lead, T, G, D, generator=g), torch.randn(*lead, T, G, D, generator=g),
            torch.randn(*lead, T, DI, generator=g))


def check_seq(cache, sid, k, v, ki, layer=0, atol=0.0):
    gk, gv, gi = cache.gather(layer, sid)
    assert gk.shape == k.shape and gi.shape == ki.shape
    torch.testing.assert_close(gk.float(), k.float(), atol=atol, rtol=atol)
    torch.testing.assert_close(gv.float(), v.float(), atol=atol, rtol=atol)
    torch.testing.assert_close(gi.float(), ki.float(), atol=atol, rtol=atol)


def test_layout_and_views():
    c = make(num_layers=3, index_layers=[1, 2])
    assert c.k.shape == (3, 16, G, PS, D) and c.k_idx.shape == (2, 16, PS, DI)
    assert c.layer(0).k_idx is None and c.layer(1).k_idx is not None
    assert c.layer(2).k.data_ptr() == c.k[2].data_ptr()  # a view
    with pytest.raises(ValueError):
        c.layer(3)
    with pytest.raises(ValueError):
        make(kv=torch.int8)


def test_prefill_whole_pages_equals_token_appends():
    k, v, ki = toks(11)
    a, b = make(), make()
    sa = a.allocate()
    a.prefill(sa, k, v, ki)
    sb = b.allocate()
    for j0 in range(0, 11, 3):  # appends of 3, 3, 3, 2 tokens
        b.append(sb, k[j0:j0 + 3], v[j0:j0 + 3], ki[j0:j0 + 3])
    assert a.length(sa) == b.length(sb) == 11 and len(a.pages(sa)) == 3
    check_seq(a, sa, k, v, ki)
    check_seq(b, sb, k, v, ki)
    # prefill after a partial page falls back to token writes
    k2, v2, ki2 = toks(6, seed=1)
    a.prefill(sa, k2, v2, ki2)
    check_seq(a, sa, torch.cat([k, k2]), torch.cat([v, v2]), torch.cat([ki, ki2]))


def test_multi_layer_append_and_slots():
    c = make(num_layers=2)
    k, v, ki = toks(5, L=2)
    s = c.allocate()
    slots = c.prefill(s, k, v, ki)
    assert slots.tolist() == [c.pages(s)[j // PS] * PS + j % PS for j in range(5)]
    for l in range(2):
        check_seq(c, s, k[l], v[l], ki[l], layer=l)
    # the model path: reserve once, write per layer
    k2, v2, ki2 = toks(2, L=2, seed=3)
    slots = c.append_slots([s], [2])
    for l in range(2):
        c.write(l, slots, k2[l], v2[l], ki2[l])
        check_seq(c, s, torch.cat([k[l], k2[l]]), torch.cat([v[l], v2[l]]), torch.cat([ki[l], ki2[l]]), layer=l)


def test_free_returns_pages_and_out_of_pages():
    c = make(pages=4)
    s1, s2 = c.allocate(), c.allocate()
    c.prefill(s1, *toks(9))  # 3 pages
    assert c.num_free_pages == 1
    with pytest.raises(ValueError, match="out of pages"):
        c.append_slots([s2], [8])  # needs 2 pages
    assert c.length(s2) == 0 and c.num_free_pages == 1  # nothing changed
    c.free(s1)
    assert c.num_free_pages == 4
    c.prefill(s2, *toks(16))
    assert c.num_free_pages == 0
    with pytest.raises(ValueError):
        c.free(s1)  # unknown now


def test_fork_copy_on_write_partial_page():
    c = make(pages=8)
    k, v, ki = toks(6)  # pages: full [0..3], partial [4, 5]
    p = c.allocate()
    c.prefill(p, k, v, ki)
    ch = c.fork(p)
    assert c.pages(ch) == c.pages(p) and all(c.refcount(x) == 2 for x in c.pages(p))
    free0 = c.num_free_pages
    # child appends into the shared partial page: it gets a private copy
    kc, vc, kic = toks(3, seed=5)
    c.append(ch, kc, vc, kic)
    assert c.pages(ch)[0] == c.pages(p)[0]  # the full page stays shared
    assert c.pages(ch)[1] != c.pages(p)[1]
    assert c.refcount(c.pages(p)[0]) == 2 and c.refcount(c.pages(p)[1]) == 1
    assert c.num_free_pages == free0 - 2  # the copy of the partial page + one new page (9 tokens)
    check_seq(c, p, k, v, ki)  # the parent is untouched
    check_seq(c, ch, torch.cat([k, kc]), torch.cat([v, vc]), torch.cat([ki, kic]))
    # the parent now owns its partial page alone: appends in place, no copy
    last = c.pages(p)[1]
    kp, vp, kip = toks(1, seed=6)
    c.append(p, kp, vp, kip)
    assert c.pages(p)[1] == last
    check_seq(c, p, torch.cat([k, kp]), torch.cat([v, vp]), torch.cat([ki, kip]))
    check_seq(c, ch, torch.cat([k, kc]), torch.cat([v, vc]), torch.cat([ki, kic]))
    c.free(p)
    assert c.refcount(c.pages(ch)[0]) == 1
    c.free(ch)
    assert c.num_free_pages == 8


def test_fork_at_page_boundary_copies_nothing():
    c = make(pages=8)
    p = c.allocate()
    c.prefill(p, *toks(8))
    ch = c.fork(p)
    before = c.num_free_pages
    c.append(ch, *toks(1, seed=2))
    assert c.num_free_pages == before - 1  # one fresh page, no copy
    assert c.pages(ch)[:2] == c.pages(p)


def test_fork_both_sides_append_after_fork():
    c = make(pages=8)
    k, v, ki = toks(5)
    p = c.allocate()
    c.prefill(p, k, v, ki)
    ch = c.fork(p)
    a, b = toks(2, seed=8), toks(2, seed=9)
    slots = c.append_slots([p, ch], [2, 2])  # both CoW-check in one call
    c.write(0, slots[:2], *a)
    c.write(0, slots[2:], *b)
    check_seq(c, p, *(torch.cat([x, y]) for x, y in zip((k, v, ki), a)))
    check_seq(c, ch, *(torch.cat([x, y]) for x, y in zip((k, v, ki), b)))
    with pytest.raises(ValueError):
        c.append_slots([p, p], [1, 1])


def test_fp8_round_trip():
    c = make(kv=FP8, idx=FP8)
    k, v, ki = toks(7)
    s = c.allocate()
    c.prefill(s, k[:5], v[:5], ki[:5])
    c.append(s, k[5:], v[5:], ki[5:])
    gk, gv, gi = c.gather(0, s)
    for got, ref in ((gk, k), (gv, v), (gi, ki)):
        amax = ref.abs().amax(-1, keepdim=True)
        assert ((got - ref).abs() <= amax / 16 + 1e-6).all()  # e4m3: 3 mantissa bits, per-row scale
    codes, scale = quantize_fp8(k)
    torch.testing.assert_close(gk, codes.float() * scale.unsqueeze(-1))
    assert c.layer(0).k_scale.shape == (16, G, PS) and c.layer(0).k_idx_scale.shape == (16, PS)


def test_fp8_fork_copies_scales():
    c = make(kv=FP8, idx=FP8)
    k, v, ki = toks(6)
    p = c.allocate()
    c.prefill(p, k, v, ki)
    ch = c.fork(p)
    c.append(ch, *toks(1, seed=4))
    torch.testing.assert_close(c.gather(0, ch)[0][:6], c.gather(0, p)[0])
    torch.testing.assert_close(c.gather(0, ch)[2][:6], c.gather(0, p)[2])


def test_decode_metadata():
    c = make(pages=16)
    s1, s2 = c.allocate(), c.allocate()
    c.prefill(s1, *toks(9))
    c.prefill(s2, *toks(2))
    m = c.decode_metadata([s1, None, s2])
    assert m.page_table.dtype == torch.int32 and m.seq_lens.dtype == torch.int32
    assert m.seq_lens_host == [9, 0, 2] and m.width == 3
    assert m.page_table[0].tolist() == c.pages(s1) and m.page_table[2, 0].item() == c.pages(s2)[0]
    m2 = c.decode_metadata([s1, s2, None], width=8)
    assert m2.width == 8
    c.append(s2, *toks(3))
    c.decode_metadata([s2, s1, None], out=m2)  # refill in place (static CUDA-graph buffers)
    assert m2.seq_lens.tolist() == [5, 9, 0] and m2.page_table[0, :2].tolist() == c.pages(s2)
    with pytest.raises(ValueError):
        c.decode_metadata([s1], width=2)


def test_write_checks():
    c = make(num_layers=2, index_layers=[1])
    s = c.allocate()
    slots = c.append_slots([s], [2])
    k, v, ki = toks(2)
    with pytest.raises(ValueError):
        c.write(0, slots, k, v, ki)  # layer 0 has no index keys
    with pytest.raises(ValueError):
        c.write(1, slots, k, v, None)
    with pytest.raises(ValueError):
        c.write(1, slots, k[:1], v, ki)
    c.write(0, slots, k, v)
    c.write(1, slots, k, v, ki)


def test_truncate_releases_pages_and_appends_again():
    c = make(pages=6)
    sid = c.allocate()
    k, v, ki = toks(10)
    c.append(sid, k, v, ki)  # 3 pages
    other = c.fork(sid)
    c.truncate(sid, 5)  # keeps 2 pages (one shared, one shared partial)
    assert c.length(sid) == 5 and len(c.pages(sid)) == 2 and c.num_free_pages == 3
    k2, v2, ki2 = toks(3, seed=1)
    c.append(sid, k2, v2, ki2)  # the shared partial page is copied before the write
    check_seq(c, sid, torch.cat([k[:5], k2]), torch.cat([v[:5], v2]), torch.cat([ki[:5], ki2]))
    check_seq(c, other, k, v, ki)  # the fork still sees its own tokens
    c.truncate(other, 0)
    assert c.pages(other) == [] and c.length(other) == 0
    with pytest.raises(ValueError, match="length"):
        c.truncate(sid, 9)


def test_caches_share_the_protocol_and_only_store():
    from msakit.cache import (DeferredPagedStep, KVCache, KVCacheProtocol, PagedKeys, PagedRows, PagedStep,
                              RollbackCache)
    from msakit.speculative.cache import SpecCache

    for cls in (KVCache, PagedStep, DeferredPagedStep, PagedRows, SpecCache):
        assert issubclass(cls, KVCacheProtocol)
        assert not hasattr(cls, "attend")  # a cache stores and views; the core attends
    assert issubclass(KVCache, RollbackCache) and issubclass(SpecCache, RollbackCache)
    assert not issubclass(PagedStep, RollbackCache) and not issubclass(PagedRows, RollbackCache)
    rows = PagedRows(make(pages=8), 2, 10)
    assert rows.page_table.shape == (2, 3)  # every page reserved up front
    with pytest.raises(ValueError, match="place"):
        rows.begin(2, 2, torch.device("cpu"))
    rows.place(torch.tensor([3, 7]))
    pos = rows.begin(2, 2, torch.device("cpu"))
    assert pos.tolist() == [[3, 4], [7, 8]]
    assert isinstance(rows.view(0), PagedKeys)
    ps = PS
    table = rows.page_table.long()
    want = [int(table[b, p // ps]) * ps + p % ps for b, r in enumerate(pos.tolist()) for p in r]
    assert rows.step.slots.tolist() == want and rows.step.seq_lens.tolist() == [5, 9]
