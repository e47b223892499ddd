"""Causal GQA attention, the dense baseline: head h reads group h // (Hq // G)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def dense_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softmax_scale: float | None = None
) -> torch.Tensor:
    """q [B,T,Hq,D], k/v [B,T,G,D] -> o [B,T,Hq,D] in q's dtype (scaled_dot_product_attention)."""
    Hq, G, D = q.shape[2], k.shape[2], q.shape[3]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    rep = Hq // G
    qh = q.transpose(1, 2)
    kh = k.transpose(1, 2).repeat_interleave(rep, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(rep, dim=1)
    o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    return o.transpose(1, 2)
