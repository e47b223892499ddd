"""`index_topk`: per (batch, group, query) the top-k key blocks by max index score."""

from __future__ import annotations

import torch

from ..checks import check_cu_seqlens, check_finite_inputs, check_index_qk
from ..dispatch import use_triton
from .reference import (
    attention_block_mass,
    block_scores,
    fp8_scoring_inputs,
    index_topk_reference,
    query_positions,
    rank_blocks,
    select_blocks,
    selected_token_mask,
)
from .settings import SCORE_DTYPES, Selection, check_selection

__all__ = ["index_topk", "index_topk_reference", "select_blocks", "rank_blocks", "block_scores",
           "selected_token_mask", "attention_block_mass", "query_positions", "Selection", "check_selection", "SCORE_DTYPES"]


@torch.library.custom_op("msakit::index_topk", mutates_args=())
def _index_topk_op(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    block_size: int,
    topk: int,
    local_blocks: int,
    init_blocks: int,
    score_dtype: str,
    backend: str,
) -> torch.Tensor:
    sd = score_dtype or None
    if use_triton("index_topk", backend, q_idx.device):
        from .triton import index_topk_triton

        sel = Selection(block_size, topk, local_blocks, init_blocks)
        return index_topk_triton(q_idx, k_idx, sel, cu_seqlens=cu_seqlens, score_dtype=sd)
    if sd == "fp8":
        q_idx, k_idx = fp8_scoring_inputs(q_idx, k_idx)
    return index_topk_reference(
        q_idx, k_idx, block_size=block_size, topk=topk, local_blocks=local_blocks, init_blocks=init_blocks,
        cu_seqlens=cu_seqlens,
    )


@_index_topk_op.register_fake
def _index_topk_fake(q_idx, k_idx, cu_seqlens, block_size, topk, local_blocks, init_blocks, score_dtype, backend):
    B, T, G, _ = q_idx.shape
    return q_idx.new_empty((B, G, T, topk), dtype=torch.int32)


def index_topk(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    *,
    block_size: int = 128,
    topk: int = 16,
    local_blocks: int = 1,
    init_blocks: int = 0,
    cu_seqlens: torch.Tensor | None = None,
    score_dtype: str | None = None,
    backend: str = "auto",
    check_finite: bool = False,
) -> torch.Tensor:
    """Select, for every (batch b, group r, query i), `topk` key blocks.

    q_idx [B, T, G, Di] and k_idx [B, T, Di] (same dtype and device) -> block_idx int32
    [B, G, T, topk].  Block b is scored by M(i, b) = max over its tokens j <= i of
    q_idx(r, i) . k_idx(j).  The query's own block, the `local_blocks - 1` blocks before it and
    the first `init_blocks` blocks are always selected; the other slots take the valid blocks
    (b <= i // block_size) with the highest M, ties to the lower id.  Valid ids come first,
    then -1 padding when fewer than `topk` blocks are valid.  See docs/msa.md.

    cu_seqlens (int32 [ndocs + 1]): packed documents, q_idx [1, total, G, Di] and k_idx
    [1, total, Di]; each document is an independent sequence whose block ids count from its
    first token.  score_dtype: None scores in the inputs' dtype (fp32 accumulation); "fp8"
    quantizes q_idx and k_idx per row to float8_e4m3fn and ranks q8 . k8 * k_scale (see
    reference.fp8_scoring_inputs).  backend: "auto" | "triton" | "reference" (msakit.ops.dispatch).
    No gradient (int32 output); registered as the custom op msakit::index_topk so that models
    using it trace under torch.compile.

    NaN: a NaN score counts as -inf, in the reference and the kernel alike, so NaN in q_idx or
    k_idx never wins a slot (a block whose every visible score is NaN is left out, -1 padding
    instead, unless it is forced).  check_finite=True raises ValueError when q_idx or k_idx
    holds NaN or inf instead (it reads the tensors: a host sync on CUDA).
    """
    check_index_qk(q_idx, k_idx)
    check_selection(block_size, topk, local_blocks, init_blocks)
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, q_idx.shape[0], q_idx.shape[1], q_idx.device, name="q_idx",
                         check_values=cu_seqlens.device.type == "cpu")  # no host sync on CUDA
    if score_dtype not in SCORE_DTYPES:
        raise ValueError(f"score_dtype must be one of {SCORE_DTYPES}, got {score_dtype!r}")
    use_triton("index_topk", backend, q_idx.device)  # validates backend before anything runs
    if check_finite:
        check_finite_inputs(q_idx=q_idx, k_idx=k_idx)
    return _index_topk_op(
        q_idx, k_idx, cu_seqlens, block_size, topk, local_blocks, init_blocks, score_dtype or "", backend
    )
