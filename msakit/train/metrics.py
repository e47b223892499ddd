"""Training metrics: indexer recall (against the oracle), per-layer KL, expert load balance, eval loss.

Indexer recall of one MSA layer on a batch (the seed's question: does the indexer find the blocks
the full attention uses?).  For query i of group r:

    P(i, j)  = mean over the group's heads h of softmax_{j <= i}(q_h(i) . k_r(j) / sqrt(D))
    m(i, b)  = sum of P(i, j) over the tokens j of block b                (dense mass per block)
    recall   = sum of m(i, b) over the blocks the indexer selected        (block_idx row)
    oracle   = the same sum over the blocks the one selection rule picks by mass
               (`msakit.ops.index_topk.rank_blocks` over `attention_block_mass`: the forced
               blocks, then the most mass)

averaged over (batch, group, query).  ``recall_far`` / ``oracle_far`` average only the queries
that see more than k blocks, where selection actually drops something.  Computed in query chunks
so memory stays O(chunk x T).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Sequence

import torch

from msakit import ops
from msakit.models.hf import MSAWrappedModel
from msakit.nn.attention import MSAAttention
from msakit.ops.index_topk import attention_block_mass, rank_blocks

_CHUNK_ELEMS = 1 << 24


@torch.no_grad()
def indexer_recall(
    q: torch.Tensor,
    k: torch.Tensor,
    block_idx: torch.Tensor,
    *,
    block_size: int,
    topk: int | None = None,
    local_blocks: int = 1,
    init_blocks: int = 0,
    softmax_scale: float | None = None,
) -> dict[str, float]:
    """q [B,T,Hq,D], k [B,T,G,D], block_idx [B,G,T,K] (-1 padded) -> recall / oracle means.

    Returns dict(recall, oracle, recall_far, oracle_far, far_queries); the *_far entries are NaN
    when no query sees more than k blocks.
    """
    B, T, Hq, _ = q.shape
    G = k.shape[2]
    if Hq % G:
        raise ValueError(f"Hq={Hq} must be a multiple of G={G}")
    if block_idx.shape[:3] != (B, G, T):
        raise ValueError(f"block_idx must have shape [B, G, T, K] = [{B}, {G}, {T}, K], got {tuple(block_idx.shape)}")
    K = topk if topk is not None else block_idx.shape[-1]
    dev = q.device
    C = max(1, min(T, _CHUNK_ELEMS // max(1, B * Hq * T)))
    tot = torch.zeros((), dtype=torch.float64, device=dev)
    tot_o = torch.zeros((), dtype=torch.float64, device=dev)
    far = torch.zeros((), dtype=torch.float64, device=dev)
    far_o = torch.zeros((), dtype=torch.float64, device=dev)
    n_far = 0
    for i0 in range(0, T, C):
        i1 = min(T, i0 + C)
        nb = (i1 - 1) // block_size + 1
        pos = torch.arange(i0, i1, device=dev).view(1, -1)
        m = attention_block_mass(q[:, i0:i1], k[:, : min(T, nb * block_size)], pos, block_size=block_size,
                                 softmax_scale=softmax_scale)  # [B,G,c,nb]
        sel = block_idx[:, :, i0:i1].long()
        ok = (sel >= 0) & (sel < nb)
        # invalid (-1) entries go to a spare column nb, so they never clear a real selection
        mask = torch.zeros(*m.shape[:-1], nb + 1, dtype=torch.bool, device=dev)
        mask.scatter_(-1, torch.where(ok, sel, torch.full_like(sel, nb)), True)
        rec = (m * mask[..., :nb]).sum(-1)  # [B,G,c]
        ids = rank_blocks(m, pos, block_size=block_size, topk=K, local_blocks=local_blocks,
                          init_blocks=init_blocks).long()
        oracle = (torch.gather(m, -1, ids.clamp_min(0)) * (ids >= 0)).sum(-1)
        own = pos.view(-1, 1) // block_size  # [c, 1]
        tot += rec.double().sum()
        tot_o += oracle.double().sum()
        is_far = (own.view(-1) + 1) > K  # [c]
        if bool(is_far.any()):
            far += rec[:, :, is_far].double().sum()
            far_o += oracle[:, :, is_far].double().sum()
            n_far += int(is_far.sum()) * B * G
    n = B * G * T
    nan = float("nan")
    return {
        "recall": float(tot / n),
        "oracle": float(tot_o / n),
        "recall_far": float(far / n_far) if n_far else nan,
        "oracle_far": float(far_o / n_far) if n_far else nan,
        "far_queries": n_far,
    }


def load_balance(expert_load: torch.Tensor | None) -> list[float]:
    """Per MoE layer: max / mean of the tokens routed to each expert (1.0 = perfectly even)."""
    if expert_load is None or expert_load.numel() == 0:
        return []
    el = expert_load.detach().float().reshape(expert_load.shape[0], -1)
    mean = el.mean(dim=-1).clamp_min(1e-12)
    return [float(x) for x in (el.amax(dim=-1) / mean).cpu()]


def msa_selections(model) -> list:
    """The selection settings (`Selection`) of each MSA layer, in layer order."""
    if isinstance(model, MSAWrappedModel):  # a converted HF model: one setting for all layers
        return [model.msa_config.selection] * max(len(model.settings.layers or []), 1)
    return [m.cfg.selection for m in model.modules() if isinstance(m, MSAAttention) and m.index_branch]


def layer_metrics(model, attn_inputs: Sequence[dict | None] | None) -> list[dict[str, Any]]:
    """Per MSA layer: KL(P || P_idx) over the indexer's selection and recall vs the oracle."""
    if not attn_inputs:
        return []
    cfgs = msa_selections(model)
    out = []
    j = 0
    for li, d in enumerate(attn_inputs):
        if d is None or d.get("q_idx") is None:
            continue
        cfg = cfgs[j] if j < len(cfgs) else (cfgs[-1] if cfgs else None)
        j += 1
        bs = int(d.get("block_size", getattr(cfg, "block_size", 0)) or 0)
        topk = int(d.get("topk", getattr(cfg, "topk", 0)) or 0)
        local = int(d.get("local_blocks", getattr(cfg, "local_blocks", 1)))
        init = int(d.get("init_blocks", getattr(cfg, "init_blocks", 0)))
        if not bs or not topk:
            raise ValueError(f"layer {li}: cannot tell the MSA block size / top-k for the recall metric")
        q, k, q_idx, k_idx = d["q"], d["k"], d["q_idx"], d["k_idx"]
        bidx = d.get("block_idx")
        if bidx is None:
            bidx = ops.index_topk(q_idx, k_idx, block_size=bs, topk=topk, local_blocks=local, init_blocks=init)
        rec = indexer_recall(q, k, bidx, block_size=bs, topk=topk, local_blocks=local, init_blocks=init)
        with torch.no_grad():
            kl = float(ops.index_kl_loss(q.float(), k.float(), q_idx.float(), k_idx.float(), bidx, block_size=bs))
        out.append({"layer": li, "kl": kl, **rec})
    return out


def autocast_for(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


def model_forward(model, batch, *, doc_attention: bool, compute_kl: bool, return_attn_inputs: bool = False,
                  lm: bool = True):
    """The model on a Batch (packed through cu_seqlens with `doc_attention`).  ``lm=False``: no
    labels and the logits of the last position only (``logits_to_keep=1``), for a step whose
    only loss is the index KL (out.loss is then None)."""
    kw: dict = {"return_attn_inputs": True} if return_attn_inputs else {}
    if not lm:
        kw["logits_to_keep"] = 1
    if doc_attention:
        ids, labels, cu = batch.flat()
        return model(ids, labels=labels if lm else None, cu_seqlens=cu, compute_kl=compute_kl, **kw)
    return model(batch.input_ids, labels=batch.labels if lm else None, compute_kl=compute_kl, **kw)


@torch.no_grad()
def evaluate(
    model,
    batches: Sequence,
    device: torch.device,
    *,
    mode: str | None = None,
    doc_attention: bool = False,
    recall_rows: int = 2,
    compute_kl: bool = True,
) -> dict[str, Any]:
    """Validation loss (token-weighted), KL, and on the first batch's first rows the per-layer
    recall / KL; ``mode`` ("dense"/"sparse") temporarily switches the attention mode."""
    was_training = model.training
    model.eval()
    prev = _current_mode(model)
    if mode is not None:
        model.set_attention_mode(mode)
    try:
        tot, n, kl_tot, nb = 0.0, 0, 0.0, 0
        loads = None
        for batch in batches:
            batch = batch.to(device)
            with autocast_for(device):
                out = model_forward(model, batch, doc_attention=doc_attention, compute_kl=compute_kl)
            nt = batch.num_targets
            if nt == 0 or out.loss is None:
                continue
            tot += float(out.loss.float()) * nt
            n += nt
            if compute_kl and out.kl is not None:
                kl_tot += float(torch.as_tensor(out.kl).float())
            nb += 1
            el = getattr(out, "expert_load", None)
            if el is not None and el.numel():
                loads = el.float() if loads is None else loads + el.float()
        res: dict[str, Any] = {"loss": tot / n if n else float("nan"),
                               "kl": kl_tot / nb if nb and compute_kl else float("nan"),
                               "tokens": n}
        res["load_balance"] = load_balance(loads)
        if recall_rows and batches:
            b0 = batches[0]
            sub = type(b0)(b0.input_ids[:recall_rows], b0.labels[:recall_rows], b0.cu_seqlens[:recall_rows]).to(device)
            with autocast_for(device):
                out = model(sub.input_ids, labels=None, compute_kl=False, return_attn_inputs=True)
            res["layers"] = layer_metrics(model, getattr(out, "attn_inputs", None))
        return res
    finally:
        if prev is not None:
            model.set_attention_mode(prev)
        model.train(was_training)


def _current_mode(model) -> str | None:
    mode = getattr(model, "attention_mode", None)
    if isinstance(mode, str):
        return mode
    for m in model.modules():
        if isinstance(m, MSAAttention) and getattr(m, "index_branch", True):
            return m.mode
    return None
