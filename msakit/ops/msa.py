"""The composite MSA ops: selection + attention (`msa_attention`) and the training layer's
attention + index KL from one forward (`sparse_attention_with_kl`).

Layouts (docs/msa.md): q [B, T, Hq, D]; k, v [B, T, G, D]; q_idx [B, T, G, Di]; k_idx [B, T, Di];
block_idx int32 [B, G, T, topk] (-1 padded); lse [B, Hq, T] float32.
"""

from __future__ import annotations

import torch

from .index_kl import index_kl_loss
from .index_topk import index_topk
from .sparse_attention import sparse_attention

__all__ = ["msa_attention", "sparse_attention_with_kl"]


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
    check_finite: bool = False,
):
    """MiniMax Sparse Attention: `index_topk(q_idx, k_idx)` then `sparse_attention(q, k, v)`.

    Returns o [B, T, Hq, D]; with return_lse also lse [B, Hq, T]; with return_block_idx also the
    selection [B, G, T, topk] (in that order after o).  `cu_seqlens` (packed documents, B = 1),
    `score_dtype` ("fp8" scoring) and `backend` pass through to both ops.  check_finite=True
    raises ValueError when q_idx or k_idx (checked by `index_topk`) or q, k or v (checked by
    `sparse_attention`) holds NaN or inf; it reads them (host syncs on CUDA).
    """
    if q_idx.shape[:3] != k.shape[:3]:
        raise ValueError(f"q_idx must have shape [B, T, G, Di] matching k's {tuple(k.shape[:3])}, got {tuple(q_idx.shape)}")
    with torch.no_grad():
        block_idx = index_topk(
            q_idx, k_idx, block_size=block_size, topk=topk, local_blocks=local_blocks, init_blocks=init_blocks,
            cu_seqlens=cu_seqlens, score_dtype=score_dtype, backend=backend, check_finite=check_finite,
        )
    res = sparse_attention(
        q, k, v, block_idx, block_size=block_size, softmax_scale=softmax_scale, return_lse=return_lse,
        cu_seqlens=cu_seqlens, backend=backend, validate=False,  # index_topk's selection is valid
        check_finite=check_finite,
    )
    res = res if isinstance(res, tuple) else (res,)
    if return_block_idx:
        res = res + (block_idx,)
    return res[0] if len(res) == 1 else res


def sparse_attention_with_kl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    block_idx: torch.Tensor,
    *,
    block_size: int = 128,
    softmax_scale: float | None = None,
    index_softmax_scale: float | None = None,
    over: str = "selected",
    return_lse: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
    validate: bool = True,
    check_finite: bool = False,
):
    """A sparse MSA layer's attention and its index KL in one call: (o, kl), or (o, kl, lse).

    o [B, T, Hq, D] = `sparse_attention(q, k, v, block_idx)` (differentiable in q, k, v, and
    through lse when returned); kl (fp32 scalar) = `index_kl_loss(q, k, q_idx, k_idx,
    block_idx)` (differentiable in q_idx, k_idx only; q and k are constants to it).  With
    over="selected" (default) the KL reuses the forward's lse [B, Hq, T] instead of computing
    the main branch's log-sum-exp again, and block_idx's values are range-checked once
    (validate=True; a host sync on CUDA) for both ops.  over="all" takes the KL over every
    token j <= i (`index_kl_loss(over="all")`): nothing of the forward is shared then.

    q [B, T, Hq, D]; k, v [B, T, G, D]; q_idx [B, T, G, Di]; k_idx [B, T, Di]; block_idx int32
    [B, G, T, topk] (-1 padded, e.g. `index_topk`'s output); cu_seqlens int32 [ndocs + 1] for
    packed documents (B = 1); backend: "auto" | "triton" | "reference" for both ops.
    validate checks block_idx's values as `sparse_attention` does (in range, causal).
    check_finite=True raises ValueError when q, k, v (checked by `sparse_attention`), q_idx or
    k_idx (checked by `index_kl_loss`) holds NaN or inf.
    """
    if over not in ("selected", "all"):
        raise ValueError(f"over must be 'selected' or 'all', got {over!r}")
    o, lse = sparse_attention(
        q, k, v, block_idx, block_size=block_size, softmax_scale=softmax_scale, return_lse=True,
        cu_seqlens=cu_seqlens, backend=backend, validate=validate, check_finite=check_finite,
    )
    kl = index_kl_loss(
        q, k, q_idx, k_idx, block_idx, block_size=block_size, softmax_scale=softmax_scale,
        index_softmax_scale=index_softmax_scale, lse=lse.detach() if over == "selected" else None,
        cu_seqlens=cu_seqlens, over=over, backend=backend, validate=False, check_finite=check_finite,
    )
    return (o, kl, lse) if return_lse else (o, kl)
