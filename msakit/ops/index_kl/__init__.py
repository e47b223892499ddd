"""`index_kl_loss`: the indexer's training signal, KL(main attention || index attention)."""

from __future__ import annotations

import math

import torch

from .._checks import check_block_idx, check_index_qk, check_positive_int, check_qkv, check_same, check_scale
from .reference import index_kl_loss_reference

__all__ = ["index_kl_loss", "index_kl_loss_reference"]


def index_kl_loss(
    q: torch.Tensor,
    k: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    block_idx: torch.Tensor,
    *,
    block_size: int = 128,
    softmax_scale: float | None = None,
    index_softmax_scale: float | None = None,
) -> torch.Tensor:
    """Mean over (b, r, i) of KL(P || P_idx) on the selected tokens; a scalar.

    q [B, T, Hq, D], k [B, T, G, D] (the main branch; treated as constants), q_idx [B, T, G, Di],
    k_idx [B, T, Di] (receive gradients), block_idx int32 [B, G, T, topk].  P is the group's
    head-averaged softmax(softmax_scale * q . k), P_idx = softmax(index_softmax_scale *
    q_idx . k_idx), both over the tokens j <= i of the selected blocks.  Default scales are
    1/sqrt(D) and 1/sqrt(Di).
    """
    B, T, Hq, G, D = check_qkv(q, k, None)
    Bi, Ti, Gi, Di = check_index_qk(q_idx, k_idx)
    if (Bi, Ti, Gi) != (B, T, G):
        raise ValueError(f"q_idx must have shape [B={B}, T={T}, G={G}, Di], got {tuple(q_idx.shape)}")
    check_same(("q", "q_idx"), (q, q_idx), dtype=False)
    check_positive_int("block_size", block_size)
    check_block_idx(block_idx, B, G, T, block_size, q.device)
    scale = check_scale("softmax_scale", softmax_scale, 1.0 / math.sqrt(D))
    iscale = check_scale("index_softmax_scale", index_softmax_scale, 1.0 / math.sqrt(Di))
    return index_kl_loss_reference(
        q.detach(), k.detach(), q_idx, k_idx, block_idx,
        block_size=block_size, softmax_scale=scale, index_softmax_scale=iscale,
    )
