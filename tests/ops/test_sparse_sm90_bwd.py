"""The sm_90 CuTe DSL sparse-attention backward: its host side on the CPU (the key-block-outer
work list against a list-based definition, the kernel's per-item algorithm emulated in torch
against the reference's autograd, the dQ accumulator's layout, argument checks), its compile for
sm_90a where CUTLASS's DSL imports, and the kernel on an sm_90 GPU with the DSL (skipped
elsewhere)."""

from __future__ import annotations

import math

import pytest
import torch

from msakit.ops.sparse_attention import sm90
from msakit.ops.sparse_attention.reference import sparse_attention_reference
from msakit.ops.sparse_attention.sm90.consts import MB_BITS, MB_QUERIES
from msakit.ops.sparse_attention.sm90.worklist import tile_count, union_worklist
from msakit.ops.sparse_attention.sm90.worklist_bwd import (bwd_worklist, bwd_worklist_from_union,
                                                           bwd_worklist_reference, dq_from_accum, mblock_count)

pytestmark = pytest.mark.usefixtures("one_thread")


def _selection(B, G, T, K, bs, gen):
    """A valid selection with -1 padding, repeated ids, the own block forced and a row that
    selects nothing."""
    own = (torch.arange(T) // bs).view(1, 1, T, 1)
    bi = (torch.rand(B, G, T, K, generator=gen) * (own + 1)).long()
    bi[..., -1:] = own[..., 0:1]
    bi = torch.where(torch.rand(B, G, T, K, generator=gen) < 0.3, torch.full_like(bi, -1), bi)
    bi[..., 0] = bi[..., 1]
    bi[:, :, T // 3] = -1
    return bi.int()


def _items_as_dict(items, ent, G):
    got: dict = {}
    for bg, blk, start, n in items.tolist():
        got.setdefault((bg // G, bg % G, blk), []).extend(
            (int(e) >> MB_BITS, int(e) & ((1 << MB_BITS) - 1)) for e in ent[start:start + n])
    return got


@pytest.mark.parametrize("T,K,bs,queries,chunk", [(37, 4, 8, 8, 3), (100, 6, 16, 4, 128), (5, 3, 4, 8, 1),
                                                  (64, 8, 8, 8, 5), (300, 16, 128, 8, 2)])
def test_bwd_worklist_matches_definition(T, K, bs, queries, chunk):
    gen = torch.Generator().manual_seed(T * 3 + K)
    B, G = 2, 3
    bi = _selection(B, G, T, K, bs, gen)
    nb = tile_count(T, bs)
    work, count = union_worklist(bi, queries, nb)
    items, ent = bwd_worklist_from_union(work, count, queries, nb, chunk)
    assert items.dtype == torch.int32 and ent.dtype == torch.int32 and items.shape[1] == 4
    assert bool((items[:, 3] >= 1).all()) and bool((items[:, 3] <= chunk).all())
    assert bool((items[:-1, 3] >= items[1:, 3]).all())  # longest first
    ref = bwd_worklist_reference(bi)
    assert _items_as_dict(items, ent, G) == ref
    assert int(items[:, 3].sum()) == ent.numel() == sum(len(x) for x in ref.values())
    # runs of one key are disjoint and cover its entries; m-blocks ascend within a key
    assert sorted((s, s + n) for _, _, s, n in items.tolist())[-1][1] == ent.numel()
    a, b = bwd_worklist(bi, nb, chunk)
    assert _items_as_dict(a, b, G) == ref


def test_bwd_worklist_checks_arguments():
    work = torch.zeros(1, 1, 2, 3, dtype=torch.int32)
    count = torch.zeros(1, 1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="queries"):
        bwd_worklist_from_union(work, count, 6, 4)
    with pytest.raises(ValueError, match="chunk"):
        bwd_worklist_from_union(work, count, 8, 4, 0)
    with pytest.raises(ValueError, match="work must be"):
        bwd_worklist_from_union(work, count[0], 8, 4)
    items, ent = bwd_worklist_from_union(work, count, 8, 4)  # nothing selected
    assert items.shape == (0, 4) and ent.numel() == 0


def test_dq_from_accum_layout():
    B, G, T, hpg, D = 2, 3, 10, 16, 128
    nmb = mblock_count(T)
    acc = torch.zeros(B, G, nmb, 2, 64, 64)
    want = torch.randn(B, nmb * MB_QUERIES, G * hpg, D)
    for b in range(B):
        for g in range(G):
            for mb in range(nmb):
                for r in range(64):
                    t, h = mb * MB_QUERIES + r // hpg, g * hpg + r % hpg
                    for c in range(D):
                        acc[b, g, mb, c // 64, r, (c % 64) ^ (8 * (r % 8))] = want[b, t, h, c]
    torch.testing.assert_close(dq_from_accum(acc, B, G, T, hpg, D), want[:, :T], rtol=0, atol=0)


def emulate_bwd(do, q, k, v, lse, delta, items, ent, bs, scale):
    """The kernel's algorithm in float64 torch: per item (b, g, blk, entries) K and V of the block
    (zero past T), per m-block entry the 64 rows (query-in-m-block * hpg + head), S^T = K Q^T,
    P^T = exp2(S^T scale log2(e) - lse2) where the row's query selected the block and the key is
    <= the query (else 0), dP^T = V dO^T, dS^T = P^T (dP^T - delta), dV += P^T dO, dK += dS^T Q,
    dQ = dS K into the accumulator layout of `dq_from_accum`; dK and dV added per item.  delta
    [B, T, Hq] = rowsum(dO * O).  Returns (dq, dk, dv) float64."""
    B, T, Hq, D = q.shape
    G = k.shape[2]
    hpg = Hq // G
    nmb = mblock_count(T)
    f = torch.float64
    log2e = 1.0 / math.log(2.0)
    lse2 = torch.zeros(B, nmb * MB_QUERIES, Hq, dtype=f)
    lse2[:, :T] = lse.transpose(1, 2).double() * log2e
    dq_acc = torch.zeros(B, G, nmb, 2, 64, 64, dtype=f)
    dk_acc = torch.zeros(B, T, G, D, dtype=f)
    dv_acc = torch.zeros(B, T, G, D, dtype=f)
    qp = torch.zeros(B, nmb * MB_QUERIES, Hq, D, dtype=f)
    qp[:, :T] = q.double()
    dop = torch.zeros_like(qp)
    dop[:, :T] = do.double()
    rows = torch.arange(64)
    sw = (torch.arange(64).view(1, 64) ^ (8 * (rows.view(64, 1) % 8)))
    for bg, blk, start, n in items.tolist():
        b, g = bg // G, bg % G
        keys = torch.arange(blk * bs, blk * bs + bs)
        inb = keys < T
        kk = torch.zeros(bs, D, dtype=f)
        vv = torch.zeros(bs, D, dtype=f)
        kk[inb], vv[inb] = k[b, keys[inb], g].double(), v[b, keys[inb], g].double()
        dk = torch.zeros(bs, D, dtype=f)
        dv = torch.zeros(bs, D, dtype=f)
        for e in ent[start:start + n].tolist():
            mb, mask = e >> MB_BITS, e & ((1 << MB_BITS) - 1)
            t = mb * MB_QUERIES + rows // hpg
            h = g * hpg + rows % hpg
            qm, dom = qp[b, t, h], dop[b, t, h]
            dl = delta[b, t.clamp(max=T - 1), h] * (t < T)
            st = kk @ qm.T  # [keys, rows]
            ok = (((mask >> (rows // hpg)) & 1).bool().view(1, 64)) & (keys.view(-1, 1) <= t.view(1, -1))
            pt = torch.where(ok, torch.exp2(st * scale * log2e - lse2[b, t, h].view(1, 64)), torch.zeros_like(st))
            dpt = vv @ dom.T
            dst = pt * (dpt - dl.view(1, 64))
            dv += pt @ dom
            dk += dst @ qm
            dqm = dst.T @ kk  # [rows, D]
            for w in range(2):
                dq_acc[b, g, mb, w].scatter_add_(1, sw, dqm[:, 64 * w:64 * w + 64])
        dk_acc[b, keys[inb], g] += dk[inb]
        dv_acc[b, keys[inb], g] += dv[inb]
    dq = dq_from_accum(dq_acc, B, G, T, hpg, D) * scale
    return dq, dk_acc * scale, dv_acc


@pytest.mark.parametrize("T", [300, 133])
def test_bwd_algorithm_equals_reference_autograd(T):
    """The per-item algorithm over the work list (ragged T: a partial last block and m-block, -1
    padding, repeated ids, a row that selects nothing) gives the reference's gradients."""
    gen = torch.Generator().manual_seed(T)
    B, G, hpg, D, bs, K = 2, 2, 16, 128, 128, 3
    Hq = G * hpg
    q = torch.randn(B, T, Hq, D, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, T, G, D, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, T, G, D, generator=gen, dtype=torch.float64, requires_grad=True)
    do = torch.randn(B, T, Hq, D, generator=gen, dtype=torch.float64)
    bi = _selection(B, G, T, K, bs, gen)
    scale = 1.0 / math.sqrt(D)
    o, lse = sparse_attention_reference(q, k, v, bi, block_size=bs, softmax_scale=scale, return_lse=True)
    dq_r, dk_r, dv_r = torch.autograd.grad(o, (q, k, v), do)
    items, ent = bwd_worklist(bi, tile_count(T, bs), chunk=2)
    delta = (do * o.detach()).sum(-1)  # [B, T, Hq]
    dq, dk, dv = emulate_bwd(do, q.detach(), k.detach(), v.detach(), lse.detach(), delta, items, ent, bs, scale)
    for got, want in ((dq, dq_r), (dk, dk_r), (dv, dv_r)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # the reference softmax is fp32
    assert (dq[:, T // 3] == 0).all()


def test_gpu_diag_reference_and_votes():
    """tools/bench/sparse_sm90_bwd.py --diag: its float64 replay of hand-made items equals the
    emulation above, and its offset vote names an r / c0 swap of the P^T fragment."""
    from tools.bench import sparse_sm90_bwd as bench

    gen = torch.Generator().manual_seed(3)
    B, G, T, D = 1, 2, 259, 128
    q, k, v, do = (torch.randn(B, T, n, D, generator=gen).bfloat16() for n in (32, G, G, 32))
    lse2 = 8.0 + torch.randn(B, T, 32, generator=gen)
    delta = 4.0 * torch.randn(B, T, 32, generator=gen)
    items = torch.tensor([[1, 0, 0, 1], [1, 2, 1, 1], [0, 1, 2, 2]], dtype=torch.int32)
    ent = torch.tensor([(32 << MB_BITS) | 15, (64 << MB_BITS) | 7, (40 << MB_BITS) | 11, (41 << MB_BITS) | 15],
                       dtype=torch.int32)
    scale = 1.0 / math.sqrt(D)
    dq, dk, dv, (pt, _) = bench._diag_reference(q, k, v, do, lse2, delta, items, ent, scale / math.log(2.0))
    lse = lse2.transpose(1, 2) * math.log(2.0)
    edq, edk, edv = emulate_bwd(do, q, k, v, lse, delta.double(), items, ent, 128, scale)
    for got, want in ((dq * scale, edq), (dk * scale, edk), (dv, edv)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # lse2 -> lse: fp32 rounding
    ptb = pt.bfloat16().double()
    assert bench._votes(ptb, ptb) == "exact"
    swapped = ptb.view(8, 2, 8, 32, 2).permute(0, 4, 2, 3, 1).reshape(128, 64)  # key bit 3 <-> row bit 0
    msg = bench._votes(swapped, ptb)
    assert "(8,-1)" in msg and "(-8,1)" in msg, msg


def test_bwd_unsupported_reason():
    q = torch.zeros(1, 8, 64, 128, dtype=torch.bfloat16)
    k = torch.zeros(1, 8, 4, 128, dtype=torch.bfloat16)
    assert sm90.unsupported_reason(q, k, 128, None, need_device=False) is None
    with pytest.raises(ValueError, match="device"):
        sm90.sparse_attention_bwd_sm90(q, q, k, k, q, torch.zeros(1, 64, 8), torch.zeros(1, 4, 8, 2, dtype=torch.int32),
                                       128, 0.1)
    with pytest.raises(ValueError, match="do"):
        sm90.sparse_attention_bwd_sm90(q[:, :4], q, k, k, q, torch.zeros(1, 64, 8),
                                       torch.zeros(1, 4, 8, 2, dtype=torch.int32), 128, 0.1, need_device=False)


def _cutlass():
    try:
        import cutlass  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.skipif(not _cutlass(), reason="nvidia-cutlass-dsl not installed (tools/bench/sparse_sm90_bwd.py --compile-only)")
def test_bwd_kernel_compiles_for_sm90a(tmp_path):
    """PTX for sm_90a: five MMAs per m-block (S^T, dP^T: 8 k-blocks; dV, dK: 4; dQ: 8), the bulk
    reduce of dQ and the TMA loads."""
    from msakit.ops.sparse_attention.sm90.kernel_bwd import compile_check_bwd

    res = compile_check_bwd(str(tmp_path))
    ptx = [f for f in res["files"] if f.endswith(".ptx")]
    assert ptx
    text = (tmp_path / ptx[0]).read_text()
    assert text.count("wgmma.mma_async") == 8 + 8 + 4 + 4 + 8
    assert "cp.reduce.async.bulk" in text and "cp.async.bulk.tensor" in text and "setmaxnreg.inc" in text


def _on_hopper_with_dsl():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and sm90.dsl_available()


@pytest.mark.skipif(not _on_hopper_with_dsl(), reason="needs an sm_90 GPU and nvidia-cutlass-dsl")
@pytest.mark.parametrize("T", [1000, 2125])
def test_bwd_kernel_matches_reference_cuda(T):
    gen = torch.Generator().manual_seed(T)
    B, G, Hq, D, bs, K = 2, 4, 64, 128, 128, 16
    dev = torch.device("cuda")
    q, k, v, do = (torch.randn(B, T, n, D, generator=gen).to(dev, torch.bfloat16) for n in (Hq, G, G, Hq))
    bi = _selection(B, G, T, K, bs, gen).to(dev)
    scale = 1.0 / math.sqrt(D)
    qf, kf, vf = (t.float().requires_grad_(True) for t in (q, k, v))
    o, lse = sparse_attention_reference(qf, kf, vf, bi, block_size=bs, softmax_scale=scale, return_lse=True)
    ref = torch.autograd.grad(o, (qf, kf, vf), do.float())
    got = sm90.sparse_attention_bwd_sm90(do, q, k, v, o.detach().to(torch.bfloat16), lse.detach(), bi, bs, scale)
    for g_, r_ in zip(got, ref):
        assert torch.isfinite(g_).all()
        assert float((g_.double() - r_.double()).norm() / r_.double().norm()) < 2e-2
