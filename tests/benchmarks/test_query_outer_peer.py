"""The query-outer peer (tools/bench/query_outer.py) computes msakit's sparse-attention meaning."""

import math

import pytest
import torch

from msakit.ops.sparse_attention.reference import sparse_attention_reference
from tools.bench.query_outer import query_outer_attention
from tools.bench.sparse_attention import random_block_idx


@pytest.mark.parametrize("T,bs,topk", [(80, 16, 3), (64, 16, 6)])
def test_query_outer_matches_reference(T, bs, topk):
    g = torch.Generator().manual_seed(T + topk)
    B, Hq, G, D = 2, 32, 2, 16
    q = torch.randn(B, T, Hq, D, generator=g).half()
    k = torch.randn(B, T, G, D, generator=g).half()
    v = torch.randn(B, T, G, D, generator=g).half()
    bi = random_block_idx(B, G, T, bs, topk, g)
    bi[0, 1, 5] = -1  # a row with no key
    o, lse = query_outer_attention(q, k, v, bi, block_size=bs)
    ro, rlse = sparse_attention_reference(q.float(), k.float(), v.float(), bi, block_size=bs, return_lse=True)
    tol = 4 * 2.0 ** -10 * math.sqrt(topk * bs)  # fp16 inputs to the products, fp32 sums
    assert torch.allclose(o.float(), ro, atol=tol, rtol=0)
    fin = torch.isfinite(rlse)
    assert torch.equal(fin, torch.isfinite(lse)) and not fin.all()
    assert torch.allclose(lse[fin], rlse[fin], atol=tol, rtol=0)
    assert (o[0, 5, Hq // G:] == 0).all()


def test_query_outer_rejects_bad_shapes():
    q = torch.zeros(1, 8, 4, 16, dtype=torch.half)
    k = torch.zeros(1, 8, 3, 16, dtype=torch.half)
    with pytest.raises(ValueError, match="block_idx"):
        query_outer_attention(q, k, k, torch.zeros(1, 3, 8, 2, dtype=torch.int32), block_size=4)
