"""`dense_attention`: causal GQA attention, the baseline MSA is compared against."""

from __future__ import annotations

import math

import torch

from ..checks import check_qkv, check_scale
from .reference import dense_attention_reference

__all__ = ["dense_attention"]


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softmax_scale: float | None = None
) -> torch.Tensor:
    """Causal GQA attention: q [B, T, Hq, D], k/v [B, T, G, D] -> [B, T, Hq, D] in q's dtype."""
    _, _, _, _, D = check_qkv(q, k, v)
    scale = check_scale("softmax_scale", softmax_scale, 1.0 / math.sqrt(D))
    return dense_attention_reference(q, k, v, softmax_scale=scale)
