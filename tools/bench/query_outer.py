"""The query-outer, per-token Triton design that Hopper engines run for MSA prefill today, rebuilt
from its published description as a peer for `tools/bench/peers.py` (not part of msakit).

vLLM's `MiniMaxM3SparseTritonImpl` prefill and SGLang's Triton path (see docs/kernels.md, the
peers): one program per (query token, KV group); its MMA rows are the group's query heads of
that one token (16 at the M3 shape); it walks the token's own selected blocks, loading each
block's K and V (so a block shared by many neighbouring tokens is gathered once per token), with
an online softmax and the causal mask on the token's own block.  Output and LSE as msakit's
`sparse_attention` (o [B, T, Hq, D], lse [B, Hq, T] natural log; a row with no key: o = 0,
lse = -inf).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _query_outer_kernel(q_ptr, k_ptr, v_ptr, bi_ptr, o_ptr, lse_ptr, T, scale_log2,
                        HQ: tl.constexpr, G: tl.constexpr, HPG: tl.constexpr, D: tl.constexpr,
                        BS: tl.constexpr, TOPK: tl.constexpr):
    t = tl.program_id(0)
    g = tl.program_id(1)
    b = tl.program_id(2)
    h = tl.arange(0, HPG)
    d = tl.arange(0, D)
    n = tl.arange(0, BS)
    qrow = ((b * T + t).to(tl.int64) * HQ + g * HPG + h) * D  # int64: past 2^31 elements at 1M tokens
    q = tl.load(q_ptr + qrow[:, None] + d[None, :])  # [HPG, D]
    m_i = tl.full([HPG], float("-inf"), tl.float32)
    l_i = tl.zeros([HPG], tl.float32)
    acc = tl.zeros([HPG, D], tl.float32)
    for s in range(TOPK):
        blk = tl.load(bi_ptr + ((b * G + g) * T + t) * TOPK + s)
        if blk >= 0:
            pos = blk * BS + n
            ok = (pos <= t) & (pos < T)
            kv = ((b * T + pos).to(tl.int64) * G + g)[:, None] * D + d[None, :]
            k = tl.load(k_ptr + kv, mask=ok[:, None], other=0.0)
            v = tl.load(v_ptr + kv, mask=ok[:, None], other=0.0)
            sc = tl.dot(q, tl.trans(k)) * scale_log2  # [HPG, BS], log2 units
            sc = tl.where(ok[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(sc - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    tl.store(o_ptr + qrow[:, None] + d[None, :], o.to(o_ptr.dtype.element_ty))
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
    tl.store(lse_ptr + (b * HQ + g * HPG + h).to(tl.int64) * T + t, lse)


def query_outer_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_idx: torch.Tensor, *,
                          block_size: int, softmax_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, T, Hq, D], k / v [B, T, G, D] (16-bit), block_idx int [B, G, T, topk] (-1 padded, distinct ids)
    -> (o [B, T, Hq, D] in q's dtype, lse float32 [B, Hq, T])."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(f"q must be [B, T, Hq, D] and k, v [B, T, G, D], got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    B, T, Hq, D = q.shape
    G = k.shape[2]
    if Hq % G or block_idx.shape[:3] != (B, G, T):
        raise ValueError(f"block_idx must be [B, G, T, topk] with G dividing Hq, got {tuple(block_idx.shape)}")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    o = torch.empty_like(q)
    lse = torch.empty(B, Hq, T, dtype=torch.float32, device=q.device)
    _query_outer_kernel[(T, G, B)](q.contiguous(), k.contiguous(), v.contiguous(), block_idx.to(torch.int32).contiguous(),
                                   o, lse, T, scale * 1.4426950408889634, HQ=Hq, G=G, HPG=Hq // G, D=D,
                                   BS=block_size, TOPK=block_idx.shape[3])
    return o, lse
