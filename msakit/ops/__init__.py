"""Functional MSA ops on tensors (nothing here imports the rest of msakit).

Layouts (docs/msa.md):  q [B, T, Hq, D];  k, v [B, T, G, D];  q_idx [B, T, G, Di];
k_idx [B, T, Di];  block_idx int32 [B, G, T, topk] (-1 padded).  Head h is in group
r = h // (Hq // G).  Each op's meaning is its `reference.py`; fast kernels sit beside it.
"""

from __future__ import annotations

import torch

from .dense import dense_attention
from .fp8 import quantize_fp8
from .index_kl import index_kl_loss
from .index_topk import check_selection, index_topk
from .sparse_attention import sparse_attention

__all__ = ["index_topk", "sparse_attention", "msa_attention", "dense_attention", "index_kl_loss", "quantize_fp8"]


def msa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    *,
    block_size: int = 128,
    topk: int = 16,
    local_blocks: int = 1,
    init_blocks: int = 0,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    return_block_idx: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    score_dtype: str | None = None,
    backend: str = "auto",
):
    """MiniMax Sparse Attention: `index_topk(q_idx, k_idx)` then `sparse_attention(q, k, v)`.

    Returns o [B, T, Hq, D]; with return_lse also lse [B, Hq, T]; with return_block_idx also the
    selection [B, G, T, topk] (in that order after o).  `cu_seqlens` (packed documents, B = 1),
    `score_dtype` ("fp8" scoring) and `backend` pass through to both ops.
    """
    check_selection(block_size, topk, local_blocks, init_blocks)
    if q_idx.shape[:3] != k.shape[:3]:
        raise ValueError(f"q_idx must have shape [B, T, G, Di] matching k's {tuple(k.shape[:3])}, got {tuple(q_idx.shape)}")
    with torch.no_grad():
        block_idx = index_topk(
            q_idx, k_idx, block_size=block_size, topk=topk, local_blocks=local_blocks, init_blocks=init_blocks,
            cu_seqlens=cu_seqlens, score_dtype=score_dtype, backend=backend,
        )
    res = sparse_attention(
        q, k, v, block_idx, block_size=block_size, softmax_scale=softmax_scale, return_lse=return_lse,
        cu_seqlens=cu_seqlens, backend=backend, validate=False,  # index_topk's selection is valid
    )
    res = res if isinstance(res, tuple) else (res,)
    if return_block_idx:
        res = res + (block_idx,)
    return res[0] if len(res) == 1 else res
