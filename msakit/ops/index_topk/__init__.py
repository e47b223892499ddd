"""`index_topk`: per (batch, group, query) the top-k key blocks by max index score."""

from __future__ import annotations

import torch

from .._checks import check_index_qk, check_positive_int
from .reference import index_topk_reference

__all__ = ["index_topk", "index_topk_reference"]


def check_selection(block_size: int, topk: int, local_blocks: int, init_blocks: int) -> None:
    check_positive_int("block_size", block_size)
    check_positive_int("topk", topk)
    check_positive_int("local_blocks", local_blocks)
    check_positive_int("init_blocks", init_blocks, minimum=0)
    if topk < local_blocks + init_blocks:
        raise ValueError(
            f"topk={topk} must be >= local_blocks + init_blocks = {local_blocks} + {init_blocks}: "
            "the forced blocks must fit in the selection"
        )


def index_topk(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    *,
    block_size: int = 128,
    topk: int = 16,
    local_blocks: int = 1,
    init_blocks: int = 0,
) -> torch.Tensor:
    """Select, for every (batch b, group r, query i), `topk` key blocks.

    q_idx [B, T, G, Di] and k_idx [B, T, Di] (same dtype and device) -> block_idx int32
    [B, G, T, topk].  Block b is scored by M(i, b) = max over its tokens j <= i of
    q_idx(r, i) . k_idx(j).  The query's own block, the `local_blocks - 1` blocks before it and
    the first `init_blocks` blocks are always selected; the other slots take the valid blocks
    (b <= i // block_size) with the highest M, ties to the lower id.  Valid ids come first,
    then -1 padding when fewer than `topk` blocks are valid.  See docs/msa.md.
    """
    check_index_qk(q_idx, k_idx)
    check_selection(block_size, topk, local_blocks, init_blocks)
    return index_topk_reference(
        q_idx, k_idx, block_size=block_size, topk=topk, local_blocks=local_blocks, init_blocks=init_blocks
    )
