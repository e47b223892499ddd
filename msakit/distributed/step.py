"""One rank's share of a training step's loss, with data and context parallelism.

The global batch (B rows of T tokens, identical on every rank) is cut into dp row blocks; the
cp ranks of a data-parallel replica share its rows and split their sequence
(`msakit.distributed.cp`).  Each rank computes its SHARE of the single-process loss:

    lm share = (sum of the rank's next-token cross-entropies) / (targets in the GLOBAL batch)
    kl share = (the model's KL on the rank's rows, itself a cp share under CP) / dp

so the shares of all ranks sum to the single-process LM loss and KL exactly (not a mean of
per-rank means).  Gradients are averaged over the ranks (FSDP2's reduce-scatter, or
`allreduce_gradients`), so a rank back-propagates world_size x its share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from msakit.distributed.cp import IGNORE_INDEX, ContextParallel
from msakit.distributed.launch import Parallel
from msakit.models.interface import document_segments
from msakit.nn.attention import MSAAttention

__all__ = ["LossShares", "next_token_targets", "loss_shares", "set_attention_context", "attention_context_supported",
           "reduce_sum"]


def next_token_targets(labels: torch.Tensor, segments: Sequence[tuple[int, int]] | None = None,
                       ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """labels [B, T] -> targets [B, T]: position i predicts labels[:, i + 1]; the last position and
    the last token of each document but the final one are `ignore_index` (as `lm_loss`)."""
    tgt = torch.full_like(labels, ignore_index)
    tgt[:, :-1] = labels[:, 1:]
    for _, e in list(segments or [])[:-1]:
        tgt[:, e - 1] = ignore_index
    return tgt


def attention_context_supported(model: torch.nn.Module) -> bool:
    """Whether the model's attention modules take a context (the hook of docs/distributed.md)."""

    mods = [m for m in model.modules() if isinstance(m, MSAAttention)]
    return bool(mods) and all(hasattr(m, "context") for m in mods)


def set_attention_context(model: torch.nn.Module, ctx: ContextParallel | None) -> None:
    """Route every attention module of `model` through `ctx.attend` (None: back to one process)."""

    if ctx is not None and not attention_context_supported(model):
        raise ValueError("context parallelism needs the attention hook (MSAAttention.context, see "
                         "docs/distributed.md); this model's attention modules do not have it")
    for m in model.modules():
        if isinstance(m, MSAAttention):
            m.context = ctx


@dataclass
class LossShares:
    lm: torch.Tensor  # this rank's share of the global mean cross-entropy (float32 scalar, with graph)
    kl: torch.Tensor  # this rank's share of the KL sum over layers (float32 scalar, with graph)
    expert_load: torch.Tensor | None  # [n_moe, E] of this rank's tokens
    comm: dict[str, Any] | None = None  # context-parallel bytes moved in the forward


def reduce_sum(x: torch.Tensor, parallel: Parallel) -> torch.Tensor:
    """A detached float32 copy of x summed over every rank of `parallel` (the global value of shares)."""
    y = x.detach().float().clone()
    if parallel.env.distributed and parallel.world_size > 1:
        dist.all_reduce(y)
    return y


def loss_shares(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    parallel: Parallel,
    *,
    cu_seqlens: Sequence[torch.Tensor] | None = None,
    compute_kl: bool = True,
) -> LossShares:
    """Forward of this rank's part of the global batch input_ids / labels [B, T] (the same on every
    rank).  cu_seqlens: per row int32 [nseg + 1] document bounds (None: one document per row).

    Under context parallelism (cp > 1) the model's attention modules keep the step's
    `ContextParallel` until `set_attention_context(model, None)`: call it after the backward."""
    B, T = input_ids.shape
    rows = parallel.batch_rows(B)
    segs_all = [document_segments(None if cu_seqlens is None else cu_seqlens[r], 1, T) for r in range(B)]
    tgt_all = torch.cat([next_token_targets(labels[r:r + 1], segs_all[r]) for r in range(B)])
    n_global = int((tgt_all != IGNORE_INDEX).sum())
    ids, tgt = input_ids[rows], tgt_all[rows]
    segs = segs_all[rows]
    Bl = ids.shape[0]
    comm = None
    if parallel.cp > 1:
        # context parallel: the replica's rows are packed into one sequence (B = 1), split over cp ranks
        flat_ids = ids.reshape(1, Bl * T)
        flat_tgt = tgt.reshape(1, Bl * T)
        cu = [0] + [r * T + e for r in range(Bl) for _, e in segs[r]]
        block = _block_size(model)
        ctx = ContextParallel(parallel.cp_group, Bl * T, block, cu_seqlens=cu)
        # stays set through the backward (activation checkpointing re-runs the layers there);
        # the caller clears it with set_attention_context(model, None) after backward
        set_attention_context(model, ctx)
        out = model(ctx.shard(flat_ids), labels=None, positions=ctx.positions(ids.device), compute_kl=compute_kl)
        tgt_l = ctx.shard(flat_tgt, pad_value=IGNORE_INDEX)
        comm = ctx.stats.as_dict()
    else:
        if cu_seqlens is None:
            out = model(ids, labels=None, compute_kl=compute_kl)
        else:
            cu = torch.cat([cu_seqlens[rows.start]] + [cu_seqlens[r][1:] + (r - rows.start) * T
                                                         for r in range(rows.start + 1, rows.stop)]).to(torch.int32)
            out = model(ids.reshape(1, Bl * T), labels=None, cu_seqlens=cu.to(ids.device), compute_kl=compute_kl)
        tgt_l = tgt
    logits = out.logits
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt_l.reshape(-1).to(logits.device),
                         ignore_index=IGNORE_INDEX, reduction="sum")
    lm = ce / max(1, n_global)
    kl = out.kl if out.kl is not None else logits.new_zeros(())
    kl = torch.as_tensor(kl, device=logits.device).float() / parallel.dp
    return LossShares(lm=lm, kl=kl, expert_load=getattr(out, "expert_load", None), comm=comm)


def _block_size(model: torch.nn.Module) -> int:
    cfg = getattr(model, "config", None)
    bs = getattr(cfg, "index_block_size", None)
    if not isinstance(bs, int):
        raise ValueError("context parallelism needs model.config.index_block_size")
    return bs
