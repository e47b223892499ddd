"""The union-tile forward of sparse_attention (msakit/ops/sparse_attention/union.py): its plan against
Python sets, the kernel against the reference, the sampled ratio and the choice."""

import math

import pytest
import torch

from msakit.ops.sparse_attention import sparse_attention
from msakit.ops.sparse_attention.reference import sparse_attention_reference
from msakit.ops.sparse_attention.union import sparse_attention_fwd_union, union_plan, union_q_tile, union_supports
from tools.bench.sparse_attention import random_block_idx


def shared_selection(B, G, T, bs, topk, q_tile, g):
    """Every run of q_tile queries takes its first query's selection, clipped to blocks it may see."""
    bi = random_block_idx(B, G, T, bs, topk, g)
    first = bi[:, :, (torch.arange(T) // q_tile) * q_tile]
    return torch.where(first <= (torch.arange(T) // bs).view(1, 1, T, 1), first, -1)


def test_plan_matches_sets():
    g = torch.Generator().manual_seed(0)
    bi = random_block_idx(2, 2, 37, 4, 3, g)
    bi[0, 0, 3, 0] = bi[0, 0, 3, 1]  # a repeated id
    bi[1, 1, 9] = -1
    ulist, ucnt, bits, ratio = union_plan(bi, 8)
    B, G, T, K = bi.shape
    for b in range(B):
        for gg in range(G):
            for t in range(ulist.shape[2]):
                rows = range(t * 8, min(T, t * 8 + 8))
                u = sorted({x for i in rows for x in bi[b, gg, i].tolist() if x >= 0})
                assert ucnt[b, gg, t] == len(u) and ulist[b, gg, t, :len(u)].tolist() == u
                assert (ulist[b, gg, t, len(u):] == -1).all()
                per_row = [len({x for x in bi[b, gg, i].tolist() if x >= 0}) for i in rows]
                assert ratio[b, gg, t] == pytest.approx(len(u) / max(sum(per_row) / len(per_row), 1.0))
                for i in rows:
                    sel = {x for x in bi[b, gg, i].tolist() if x >= 0}
                    got = {u[s] for s in range(len(u)) if (int(bits[b, gg, i, s // 32]) >> (s % 32)) & 1}
                    assert got == sel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_union_kernel_matches_reference(dtype):
    g = torch.Generator().manual_seed(1)
    B, T, Hq, G, D, bs, K = 1, 70, 32, 2, 16, 16, 3
    q, k, v = (torch.randn(B, T, h, D, generator=g).to(dtype) for h in (Hq, G, G))
    bi = random_block_idx(B, G, T, bs, K, g)
    bi[0, :, 16:24] = bi[0, :, 16:17]  # a tile sharing one selection
    bi[0, 1, 40] = -1  # a row with no key
    o, lse = sparse_attention_fwd_union(q, k, v, bi, bs, 1 / math.sqrt(D), q_tile=2)
    ro, rl = sparse_attention_reference(q.float(), k.float(), v.float(), bi, block_size=bs, return_lse=True)
    tol = 1e-4 if dtype == torch.float32 else 4 * 2.0 ** -8  # bf16: rounding of o and of P
    assert o.dtype == dtype and (o.float() - ro).abs().max() < tol
    fin = torch.isfinite(rl)
    assert torch.equal(fin, torch.isfinite(lse)) and not fin.all()
    assert torch.allclose(lse[fin], rl[fin], atol=1e-3)
    assert (o[0, 40, Hq // G:] == 0).all()


def test_ratio_and_choice():
    g = torch.Generator().manual_seed(3)
    # M3's 16 heads per group (8-query tiles); T=128 with topk 2 leaves random selections a ratio near
    # 2 (above UNION_MAX_RATIO: the KV-outer path) at a fraction of T=256's interpreter time
    B, T, Hq, G, D, bs, K = 1, 128, 32, 2, 16, 16, 2
    qt = union_q_tile(Hq // G, K)
    assert qt == 8 and union_supports(Hq // G, qt, D, bs) and not union_supports(3, qt, D, bs)
    shared = shared_selection(B, G, T, bs, K, qt, g)
    assert float(union_plan(shared, qt)[3].mean()) == pytest.approx(1.0)
    rnd = random_block_idx(B, G, T, bs, K, g)
    assert float(union_plan(rnd, qt)[3].mean()) > 1.6  # neighbours rarely share here
    # the public op takes either path and equals the reference on both
    q, k, v = (torch.randn(B, T, h, D, generator=g) for h in (Hq, G, G))
    for bi in (shared, rnd):
        o, lse = sparse_attention(q, k, v, bi, block_size=bs, return_lse=True, backend="triton")
        ro, rl = sparse_attention_reference(q, k, v, bi, block_size=bs, return_lse=True)
        assert torch.allclose(o, ro, atol=1e-4)


def test_union_forward_then_kv_outer_backward():
    """Where the union kernel runs the forward, the KV-outer backward (from its o and lse) gives the
    reference's gradients."""
    g = torch.Generator().manual_seed(5)
    B, T, Hq, G, D, bs, K = 1, 64, 32, 2, 16, 16, 3
    bi = shared_selection(B, G, T, bs, K, union_q_tile(Hq // G, K), g)
    q, k, v = (torch.randn(B, T, h, D, generator=g) for h in (Hq, G, G))
    do = torch.randn(B, T, Hq, D, generator=g)
    grads = []
    for backend in ("triton", "reference"):
        qs, ks, vs = (t.clone().requires_grad_(True) for t in (q, k, v))
        o = sparse_attention(qs, ks, vs, bi, block_size=bs, backend=backend)
        o.backward(do)
        grads.append((o.detach(), qs.grad, ks.grad, vs.grad))
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()
