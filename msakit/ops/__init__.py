"""Functional MSA ops on tensors (nothing here imports the rest of msakit).

Layouts (docs/msa.md):  q [B, T, Hq, D];  k, v [B, T, G, D];  q_idx [B, T, G, Di];
k_idx [B, T, Di];  block_idx int32 [B, G, T, topk] (-1 padded).  Head h is in group
r = h // (Hq // G).  Each op's meaning is its `reference.py`; fast kernels sit beside it.
"""

from __future__ import annotations

from .dense import dense_attention
from .fp8 import quantize_fp8
from .index_kl import index_kl_loss
from .index_topk import index_topk
from .msa import msa_attention, sparse_attention_with_kl
from .sparse_attention import sparse_attention

__all__ = [
    "index_topk", "sparse_attention", "msa_attention", "sparse_attention_with_kl", "dense_attention", "index_kl_loss",
    "quantize_fp8",
]
