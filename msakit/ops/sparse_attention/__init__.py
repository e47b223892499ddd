"""`sparse_attention`: attention restricted to the selected key blocks of each (group, query)."""

from __future__ import annotations

import math

import torch

from .._checks import check_block_idx, check_positive_int, check_qkv, check_scale
from .reference import sparse_attention_reference

__all__ = ["sparse_attention", "sparse_attention_reference"]


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_idx: torch.Tensor,
    *,
    block_size: int = 128,
    softmax_scale: float | None = None,
    return_lse: bool = False,
):
    """Block-sparse causal GQA attention.

    q [B, T, Hq, D]; k, v [B, T, G, D]; block_idx int32 [B, G, T, topk] (ids of key blocks of
    `block_size` tokens, -1 = none).  Head h of group r = h // (Hq // G) at query i attends the
    tokens j <= i of the blocks block_idx[b, r, i].  Returns o [B, T, Hq, D] in q's dtype and,
    with return_lse, lse [B, Hq, T] float32 (natural log; -inf for a row selecting nothing).
    """
    B, T, Hq, G, D = check_qkv(q, k, v)
    check_positive_int("block_size", block_size)
    check_block_idx(block_idx, B, G, T, block_size, q.device)
    scale = check_scale("softmax_scale", softmax_scale, 1.0 / math.sqrt(D))
    return sparse_attention_reference(
        q, k, v, block_idx, block_size=block_size, softmax_scale=scale, return_lse=return_lse
    )
