"""Selection policies: which key blocks each (batch, group, query) of a sparse layer attends.

A policy is a function ``fn(layer_idx, q, k, q_idx, k_idx, sel) -> block_idx`` over one layer's
projected tensors (after RoPE), the layouts of docs/msa.md:

    q [B, T, Hq, D]   k [B, Tk, G, D]   q_idx [B, T, G, Di] or None   k_idx [B, Tk, Di] or None
    block_idx int32 [B, G, T, K]   (-1 padded; the queries are the last T of the Tk keys)

``sel`` is the layer's `Selection`.  The returned ids count blocks of ``sel.block_size`` tokens
(the size the layer's sparse attention uses); the key budget ``K`` is the policy's own (a
`Selection` whose block size and top-k are the budget: "block64-top8"), so one model can be
evaluated at several budgets of its block size.  The forced blocks are the layer's.

Policies (all pure functions of their inputs):

- ``msa``: the model's indexer (`msakit.nn.core.select`) with the layer's forcing;
- ``window``: the query's own block and the ``K - 1`` blocks before it (a sliding window of
  ``K * block_size`` keys);
- ``window0``: block 0, the own block and the ``K - 2`` blocks before it (same budget);
- ``oracle``: the ``K`` blocks of largest true attention mass (`attention_block_mass`: the block
  sums of ``softmax(scale * q_h(i) . k(j))`` over ``j <= i``, averaged over the group's query
  heads), ranked by the one selection rule (`rank_blocks`: the layer's forced blocks kept, ties to
  the lower block id).  A whole sequence on the GPU uses the KL kernel's statistics pass for the
  masses; otherwise chunked over queries so a 32K context fits in memory.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from msakit.nn.core import select
from msakit.ops.dispatch import triton_available
from msakit.ops.index_kl import block_attention_mass
from msakit.ops.index_topk import Selection, attention_block_mass, query_positions, rank_blocks

__all__ = [
    "Policy",
    "POLICY_NAMES",
    "make_policy",
    "oracle_block_idx",
    "window_block_idx",
]

Policy = Callable[[int, torch.Tensor, torch.Tensor, "torch.Tensor | None", "torch.Tensor | None", Any], torch.Tensor]
POLICY_NAMES = ("msa", "window", "window0", "oracle")
# the oracle of a whole sequence on the GPU runs `ops.index_kl.block_attention_mass` (the KL
# kernel's statistics, B * T * nblocks * Hq fp32) up to this size, else query chunks in PyTorch
ORACLE_KERNEL_MAX_BYTES = 4 << 30


def _check_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int, int, int, int]:
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q must be a [B, T, Hq, D] tensor, got {getattr(q, 'shape', type(q).__name__)}")
    if not isinstance(k, torch.Tensor) or k.dim() != 4:
        raise ValueError(f"k must be a [B, Tk, G, D] tensor, got {getattr(k, 'shape', type(k).__name__)}")
    B, T, Hq, D = q.shape
    Bk, Tk, G, Dk = k.shape
    if Bk != B or Dk != D or Tk < T:
        raise ValueError(f"k {tuple(k.shape)} must be [B={B}, Tk>={T}, G, D={D}] for q {tuple(q.shape)}")
    if G < 1 or Hq % G:
        raise ValueError(f"q's {Hq} heads must be a multiple of k's {G} groups")
    if q.device != k.device:
        raise ValueError(f"q is on {q.device} but k is on {k.device}")
    return B, T, Tk, Hq, G


def window_block_idx(
    B: int, G: int, T: int, *, block_size: int, topk: int, first_block: bool = False,
    Tk: int | None = None, device: Any = None,
) -> torch.Tensor:
    """Sliding window of `topk` blocks -> int32 [B, G, T, topk] (ValueError unless topk >= 1, and >= 2
    with `first_block`).

    Query i (position ``Tk - T + i``) with own block o gets o, o - 1, ..., o - topk + 1 (those
    >= 0); with `first_block`, block 0 takes the last slot instead (o, ..., o - topk + 2 and 0).
    Rows are ascending valid ids, then -1."""
    Selection(block_size, topk, 1, int(first_block))  # checks the settings
    Tk = T if Tk is None else Tk
    if Tk < T:
        raise ValueError(f"Tk={Tk} must be >= T={T}")
    rows = torch.arange(Tk - T, Tk, device=device)
    own = (rows // block_size).view(-1, 1)
    span = topk - 1 if first_block else topk
    back = torch.arange(span - 1, -1, -1, device=device).view(1, -1)
    ids = own - back  # [T, span] ascending
    if first_block:
        ids = torch.cat([torch.zeros_like(own), ids], dim=1)
        # block 0 already inside the window: drop the duplicate
        ids[:, 1:] = ids[:, 1:].masked_fill(ids[:, 1:] == 0, -1)
    ids = ids.masked_fill(ids < 0, -1)
    ids = torch.sort(torch.where(ids < 0, torch.full_like(ids, 1 << 30), ids), dim=1).values
    ids = ids.masked_fill(ids == 1 << 30, -1).to(torch.int32)
    return ids.view(1, 1, T, topk).expand(B, G, T, topk).contiguous()


def _on_kernel(q: torch.Tensor) -> bool:
    return q.is_cuda and triton_available()


def oracle_block_idx(
    q: torch.Tensor, k: torch.Tensor, sel: Selection, *, softmax_scale: float | None = None,
    max_elements: int = 1 << 26,
) -> torch.Tensor:
    """Oracle selection: `rank_blocks` over `attention_block_mass` -> int32 [B, G, T, sel.topk]
    (the queries are the last T of the Tk keys).  A whole sequence (T == Tk) on the GPU takes its
    masses from `msakit.ops.index_kl.block_attention_mass` (up to ORACLE_KERNEL_MAX_BYTES of its
    statistics); otherwise queries are chunked so one chunk's scores hold at most `max_elements`
    values (the memory bound: about 4 bytes times that, a few times over)."""
    B, T, Tk, Hq, G = _check_qk(q, k)
    if max_elements < 1:
        raise ValueError(f"max_elements must be >= 1, got {max_elements}")
    bs = sel.block_size
    pos = query_positions(T, Tk, q.device)
    nblk = -(-Tk // bs)
    if T == Tk and q.dtype != torch.float64 and _on_kernel(q) and B * T * nblk * Hq * 4 <= ORACLE_KERNEL_MAX_BYTES:
        # a whole sequence on the GPU: the block masses from the KL kernel's statistics pass (q and
        # k read once per block; the chunks below move B * Hq * T * Tk fp32 scores several times)
        mass = block_attention_mass(q, k, block_size=bs, softmax_scale=softmax_scale)
        return rank_blocks(mass, pos, block_size=bs, topk=sel.topk, local_blocks=sel.local_blocks,
                           init_blocks=sel.init_blocks)
    out = torch.full((B, G, T, sel.topk), -1, dtype=torch.int32, device=q.device)
    C = max(1, min(T, max_elements // max(1, B * Hq * Tk)))
    for i0 in range(0, T, C):
        i1 = min(T, i0 + C)
        jmax = min(Tk, ((Tk - T + i1 - 1) // bs + 1) * bs)  # keys any row of the chunk sees, whole blocks
        mass = attention_block_mass(q[:, i0:i1], k[:, :jmax], pos[:, i0:i1], block_size=bs, softmax_scale=softmax_scale)
        out[:, :, i0:i1] = rank_blocks(mass, pos[:, i0:i1], block_size=bs, topk=sel.topk,
                                       local_blocks=sel.local_blocks, init_blocks=sel.init_blocks)
    return out


def make_policy(name: str, budget: Selection, *, softmax_scale: float | None = None,
                max_elements: int = 1 << 26) -> Policy:
    """The policy `name` (one of POLICY_NAMES) at `budget` (its block size and top-k), as
    ``fn(layer_idx, q, k, q_idx, k_idx, sel)``.

    The layer's ``sel.block_size`` must equal ``budget.block_size`` (block ids are counted in the
    layer's blocks); ``msa`` and ``oracle`` keep the layer's ``local_blocks`` / ``init_blocks``."""
    if name not in POLICY_NAMES:
        raise ValueError(f"policy must be one of {POLICY_NAMES}, got {name!r}")
    if not isinstance(budget, Selection):
        raise ValueError(f"budget must be a Selection, got {type(budget).__name__}")

    def policy(layer_idx: int, q, k, q_idx, k_idx, sel: Selection) -> torch.Tensor:
        bs = sel.block_size
        if bs != budget.block_size:
            raise ValueError(f"layer {layer_idx} uses block_size {bs} but the budget is {budget}: convert the model "
                             f"with block size {budget.block_size} or pick a budget of block {bs}")
        at_budget = sel.replace(topk=budget.topk, score_dtype=None)
        if name == "msa":
            if q_idx is None or k_idx is None:
                raise ValueError("the msa policy needs the layer's index tensors q_idx and k_idx (a layer with an "
                                 "index branch)")
            return select(q_idx, k_idx, at_budget)
        if name == "oracle":
            with torch.no_grad():
                return oracle_block_idx(q, k, at_budget, softmax_scale=softmax_scale, max_elements=max_elements)
        B, T, Tk, _, G = _check_qk(q, k)
        return window_block_idx(B, G, T, block_size=bs, topk=budget.topk, first_block=name == "window0", Tk=Tk,
                                device=q.device)

    policy.__name__ = f"{name}_policy"
    policy.__qualname__ = policy.__name__
    return policy
