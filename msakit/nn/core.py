"""The attention core: one layer's attention after its projections, for every path.

`attend(q, q_idx, keys, sel, mode=...)` takes the projected queries (q [B, T, Hq, D], index queries
q_idx [B, T, G, Di] or None for a layer without an index branch), a view of the keys
(`msakit.cache.HeldKeys`, `PagedKeys` or `DeferredPagedKeys`) and the selection settings
(`msakit.ops.index_topk.Selection`), and returns (o [B, T, Hq, D], KL term or None, block_idx
[B, G, T, K] or None).  Which code runs depends on where the queries sit:

| keys                                   | sparse mode (with q_idx)                  | dense mode            |
|----------------------------------------|-------------------------------------------|-----------------------|
| HeldKeys, positions None, T == Lk      | `ops.index_topk` + `ops.sparse_attention` | `ops.dense_attention` |
|   (training, prefill; packed documents)| (`ops.sparse_attention_with_kl` with the KL)|                     |
| HeldKeys, positions None, T < Lk       | `select_blocks` + `sparse_attention_reference` (+ KL reference) | causal SDPA at the offset |
| HeldKeys, positions [B, T]             | `select_blocks` at the positions + masked SDPA | masked SDPA      |
| PagedKeys                              | `ops.msa_decode`                          | gathered pages, masked SDPA |
| DeferredPagedKeys                      | the cache write + the above, one custom op (`msakit::paged_step_attend`) |  |

The selection rule everywhere is `msakit.ops.index_topk.reference`'s.  The KL term (the index
branch's training signal) is taken over the selected tokens (or all causal tokens with
`kl_tokens="all"`), in dense mode too: the full-attention warm-up trains the indexer on its own
selection while the output ignores it.

Layer modules (`msakit.nn.MSAAttention`), converted HF models, context parallelism, decoding and
speculative verification all call `attend`.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from msakit import ops
from msakit.cache.base import DeferredPagedKeys, HeldKeys, PagedKeys
from msakit.cache.paged import PagedKVCache, gather_pages
from msakit.ops.decode import msa_decode
from msakit.ops.index_kl import index_kl_loss_reference, selected_lse
from msakit.ops.index_topk import Selection, select_blocks, selected_token_mask
from msakit.ops.sparse_attention import sparse_attention_reference

__all__ = ["attend", "select", "KL_TOKENS", "MODES", "masked_attention", "paged_step_context", "paged_step_attend",
           "selection_info"]

MODES = ("dense", "sparse")
KL_TOKENS = ("selected", "all")
# elements of one chunk's attention mask in the masked paths (rows are chunked to stay under it)
MASK_ELEMENTS = 1 << 26


def attend(
    q: torch.Tensor,
    q_idx: torch.Tensor | None,
    keys: HeldKeys | PagedKeys | DeferredPagedKeys,
    sel: Selection,
    *,
    mode: str,
    compute_kl: bool = False,
    kl_tokens: str = "selected",
    need_block_idx: bool = False,
    segments: Sequence[tuple[int, int]] | None = None,
    softmax_scale: float | None = None,
    block_idx: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One layer's attention (module docstring) -> (o [B, T, Hq, D], KL term or None, block_idx or None).

    compute_kl / need_block_idx / segments (packed documents [(start, end)], B == 1) apply to
    full sequences, the KL and block ids also to queries at the end of held keys (context
    parallelism).  block_idx int32 [B, G, T, K]: a selection made beforehand (an evaluation
    policy's, or the indexer's made early) used instead of the indexer's; the layer is then
    sparse in sparse mode even without q_idx.  softmax_scale: default 1/sqrt(D)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if kl_tokens not in KL_TOKENS:
        raise ValueError(f"kl_tokens must be one of {KL_TOKENS}, got {kl_tokens!r}")
    if not isinstance(sel, Selection):
        raise ValueError(f"sel must be a msakit.ops.index_topk.Selection, got {type(sel).__name__}")
    sparse = mode == "sparse" and (q_idx is not None or block_idx is not None)
    if block_idx is not None and not (isinstance(keys, HeldKeys) and keys.positions is None):
        raise ValueError("a given block_idx applies to queries at the end of held keys (HeldKeys without positions)")
    if isinstance(keys, DeferredPagedKeys):
        return paged_step_attend(q, q_idx, keys.k, keys.v, keys.k_idx, keys.slots, keys.page_table, keys.seq_lens,
                                 keys.layer, mode, sel.block_size, sel.topk, sel.local_blocks, sel.init_blocks), None, None
    if isinstance(keys, PagedKeys):
        return _paged(q, q_idx if sparse else None, keys, sel, softmax_scale), None, None
    if not isinstance(keys, HeldKeys):
        raise ValueError(f"keys must be a HeldKeys, PagedKeys or DeferredPagedKeys, got {type(keys).__name__}")
    T, Lk = q.shape[1], keys.k.shape[1]
    if keys.positions is None and T == Lk:
        return _sequence(q, q_idx, keys, sel, mode=mode, compute_kl=compute_kl, kl_tokens=kl_tokens,
                         need_block_idx=need_block_idx, segments=segments, softmax_scale=softmax_scale,
                         block_idx=block_idx)
    if segments is not None and len(segments) > 1:
        raise ValueError("packed documents take whole sequences (queries == keys)")
    if keys.positions is None:
        if T > Lk:
            raise ValueError(f"{T} queries over {Lk} held keys: the queries must be the last positions")
        return _offset(q, q_idx, keys, sel, sparse=sparse, compute_kl=compute_kl, kl_tokens=kl_tokens,
                       need_block_idx=need_block_idx, softmax_scale=softmax_scale, block_idx=block_idx)
    if compute_kl or need_block_idx:
        raise ValueError("the KL and block ids are computed for queries at the end of their keys, not at positions")
    return _positioned(q, q_idx if sparse else None, keys, sel, softmax_scale), None, None


def selection_info(sel: Selection, segments: Sequence[tuple[int, int]] | None) -> dict[str, Any]:
    """The selection settings stored beside a layer's attention inputs (block ids are relative to
    each document's start when the batch was packed: `cu_seqlens` is then given too)."""
    info: dict[str, Any] = dict(block_size=sel.block_size, topk=sel.topk, local_blocks=sel.local_blocks,
                                init_blocks=sel.init_blocks)
    if segments is not None and len(segments) > 1:
        info["cu_seqlens"] = torch.tensor([0] + [e for _, e in segments], dtype=torch.int32)
    return info


# ---------------------------------------------------------------------------------------------
# Whole sequences: the kernels
# ---------------------------------------------------------------------------------------------


def select(q_idx: torch.Tensor, k_idx: torch.Tensor, sel: Selection) -> torch.Tensor:
    """The indexer's selection (no gradient) of queries at the end of their keys: q_idx
    [B, T, G, Di], k_idx [B, Lk, Di] -> int32 [B, G, T, topk].  The `index_topk` op (its kernel)
    when the queries are the keys (T == Lk), the reference `select_blocks` otherwise."""
    with torch.no_grad():
        if q_idx.shape[1] == k_idx.shape[1]:
            return ops.index_topk(q_idx, k_idx, block_size=sel.block_size, topk=sel.topk, local_blocks=sel.local_blocks,
                                  init_blocks=sel.init_blocks, score_dtype=sel.score_dtype)
        with _no_autocast(q_idx):
            return select_blocks(q_idx, k_idx, block_size=sel.block_size, topk=sel.topk,
                                 local_blocks=sel.local_blocks, init_blocks=sel.init_blocks)


def _sequence(q, q_idx, keys: HeldKeys, sel: Selection, *, mode, compute_kl, kl_tokens, need_block_idx, segments,
              softmax_scale, block_idx):
    k, v, k_idx = keys.k, keys.v, keys.k_idx
    T = q.shape[1]
    segments = segments or [(0, T)]
    has_index = q_idx is not None
    compute_kl = compute_kl and has_index
    do_select = block_idx is not None or (
        has_index and (mode == "sparse" or (compute_kl and kl_tokens == "selected") or need_block_idx))
    outs, bidxs = [], []
    kl = None
    for s, e in segments:
        whole = (s, e) == (0, T)
        qs, ks, vs = (q, k, v) if whole else (q[:, s:e], k[:, s:e], v[:, s:e])
        qis = kis = bi = None
        if has_index:
            qis, kis = (q_idx, k_idx) if whole else (q_idx[:, s:e], k_idx[:, s:e])
        if do_select:
            if block_idx is not None:
                bi = block_idx if whole else block_idx[:, :, s:e]
            else:
                bi = select(qis, kis, sel)
            bidxs.append(bi)
        term = None
        if mode == "sparse" and bi is not None:
            if compute_kl and kl_tokens == "selected":  # one call: the KL reuses the forward's LSE
                o, term = ops.sparse_attention_with_kl(qs, ks, vs, qis, kis, bi, block_size=sel.block_size,
                                                       softmax_scale=softmax_scale)
            else:
                o = ops.sparse_attention(qs, ks, vs, bi, block_size=sel.block_size, softmax_scale=softmax_scale)
        else:
            o = ops.dense_attention(qs, ks, vs, softmax_scale=softmax_scale)
        outs.append(o)
        if compute_kl and term is None:
            # dense mode (the warm-up): no sparse forward to share, the KL kernel takes the LSE of its
            # own pass over the selected tokens (`selected_lse`); the references need none
            lse = None
            if kl_tokens == "selected" and qs.is_cuda:
                lse = selected_lse(qs, ks, bi, block_size=sel.block_size, softmax_scale=softmax_scale, validate=False)
            term = ops.index_kl_loss(qs, ks, qis, kis, bi, block_size=sel.block_size, softmax_scale=softmax_scale,
                                     over=kl_tokens, lse=lse)
        if term is not None:
            term = term if whole else term * ((e - s) / T)
            kl = term if kl is None else kl + term
    o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    block_idx = None
    if bidxs:
        block_idx = bidxs[0] if len(bidxs) == 1 else torch.cat(bidxs, dim=2)
    return o, kl, block_idx


# ---------------------------------------------------------------------------------------------
# Queries at the end of held keys, and queries at given positions: the references
# ---------------------------------------------------------------------------------------------


def _scale(q: torch.Tensor, softmax_scale: float | None) -> float:
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Callable[[int, int], torch.Tensor],
                     scale: float) -> torch.Tensor:
    """GQA attention under a boolean mask: q [B, T, Hq, D], k, v [B, Lk, G, D] (any strides),
    mask(i0, i1) -> bool [B or 1, G or 1, i1 - i0, Lk] of query rows i0 .. i1 - 1 (True: the
    key is attended) -> o [B, T, Hq, D] in q's dtype.  Rows run in chunks whose mask has at
    most `MASK_ELEMENTS` entries per head.  A row with no attended key gives NaN (callers keep
    each query's own key visible)."""
    B, T, Hq, D = q.shape
    Lk, G = k.shape[1], k.shape[2]
    rep = Hq // G
    kh = k.transpose(1, 2).repeat_interleave(rep, dim=1).to(q.dtype)
    vh = v.transpose(1, 2).repeat_interleave(rep, dim=1).to(q.dtype)
    step = max(1, MASK_ELEMENTS // max(1, B * Lk))
    outs = []
    for i0 in range(0, T, step):
        i1 = min(T, i0 + step)
        m = mask(i0, i1)
        if m.shape[1] == G and G > 1 and rep > 1:
            m = m.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q[:, i0:i1].transpose(1, 2), kh, vh, attn_mask=m, scale=scale)
        outs.append(o.transpose(1, 2))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def _causal(positions: torch.Tensor, Lk: int) -> Callable[[int, int], torch.Tensor]:
    cols = torch.arange(Lk, device=positions.device).view(1, 1, 1, Lk)
    return lambda i0, i1: cols <= positions[:, i0:i1].view(positions.shape[0], 1, i1 - i0, 1)


def _no_autocast(x: torch.Tensor):
    """The references compute in float32 like the kernels: autocast must not cast their einsums down."""
    return torch.autocast(x.device.type, enabled=False)


def _offset(q, q_idx, keys: HeldKeys, sel: Selection, *, sparse, compute_kl, kl_tokens, need_block_idx, softmax_scale,
            block_idx):
    """The T queries at the last T of the Lk held positions (a cache's later steps, a
    context-parallel rank's query range over the gathered keys)."""
    k, v, k_idx = keys.k, keys.v, keys.k_idx
    T, Lk = q.shape[1], k.shape[1]
    scale = _scale(q, softmax_scale)
    has_index = q_idx is not None
    compute_kl = compute_kl and has_index
    bi, kl = block_idx, None
    with _no_autocast(q):
        if bi is None and has_index and (sparse or (compute_kl and kl_tokens == "selected") or need_block_idx):
            bi = select(q_idx, k_idx, sel)
        if sparse:
            o = sparse_attention_reference(q, k, v, bi, block_size=sel.block_size, softmax_scale=scale)
        else:
            positions = torch.arange(Lk - T, Lk, device=q.device).unsqueeze(0)
            o = masked_attention(q, k, v, _causal(positions, Lk), scale)
        if compute_kl:
            kl = index_kl_loss_reference(q.detach(), k.detach(), q_idx, k_idx, bi, block_size=sel.block_size,
                                         softmax_scale=scale, over=kl_tokens)
    return o.to(q.dtype), kl, bi


def _positioned(q, q_idx, keys: HeldKeys, sel: Selection, softmax_scale):
    """Queries at per-row positions over contiguous held keys (rows of different lengths)."""
    k, v, k_idx, pos = keys.k, keys.v, keys.k_idx, keys.positions
    Lk = k.shape[1]
    scale = _scale(q, softmax_scale)
    if q_idx is None:
        return masked_attention(q, k, v, _causal(pos, Lk), scale)
    with torch.no_grad():
        bi = select_blocks(q_idx, k_idx, block_size=sel.block_size, topk=sel.topk, local_blocks=sel.local_blocks,
                           init_blocks=sel.init_blocks, positions=pos)
    mask = selected_token_mask(bi, pos, Lk, block_size=sel.block_size)
    return masked_attention(q, k, v, lambda i0, i1: mask[:, :, i0:i1], scale)


# ---------------------------------------------------------------------------------------------
# Pages
# ---------------------------------------------------------------------------------------------


def _paged(q, q_idx, keys: PagedKeys, sel: Selection, softmax_scale):
    """q [B, nq, Hq, D] of the new tokens over a paged layer: msa_decode (sparse), else every page
    of the row gathered through the page table, keys past each query's position masked."""
    if q_idx is not None:
        return msa_decode(q, q_idx, keys.pools, keys.page_table, keys.seq_lens, plan=keys.plan, topk=sel.topk,
                          local_blocks=sel.local_blocks, init_blocks=sel.init_blocks, softmax_scale=softmax_scale,
                          validate=False, backend=keys.backend)
    pools = keys.pools
    table = keys.memo.get("table")
    if table is None:
        table = keys.memo["table"] = keys.page_table.long()
    k = gather_pages(pools.k, pools.k_scale, table).transpose(1, 2)  # [B, W * ps, G, D] (a view)
    v = gather_pages(pools.v, pools.v_scale, table).transpose(1, 2)
    mask = keys.memo.get("mask")
    if mask is None:  # the new tokens are the last nq positions of each row
        nq = q.shape[1]
        rows = keys.seq_lens.long().unsqueeze(1) - nq + torch.arange(nq, device=q.device)  # [B, nq]
        mask = keys.memo["mask"] = _causal(rows, k.shape[1])(0, nq)
    return masked_attention(q, k, v, lambda i0, i1: mask[:, :, i0:i1], _scale(q, softmax_scale))


# (cache, plan, backend) of the compiled decode step now running: `paged_step_attend` reads them
# here, so the cache's pools and msa_decode's plan are no inputs of the compiled graph (no input
# mutation for dynamo / inductor to track, no plan object to trace)
_STEP_CONTEXT: list[tuple[PagedKVCache, Any, str]] = []


@contextlib.contextmanager
def paged_step_context(cache: PagedKVCache, plan: Any, backend: str) -> Iterator[None]:
    """Run a forward over `DeferredPagedKeys` views: their writes go to `cache`, msa_decode takes `plan`."""
    _STEP_CONTEXT.append((cache, plan, backend))
    try:
        yield
    finally:
        _STEP_CONTEXT.pop()


@torch.library.custom_op("msakit::paged_step_attend", mutates_args=())
def paged_step_attend(q: torch.Tensor, q_idx: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor,
                      k_idx: torch.Tensor | None, slots: torch.Tensor, page_table: torch.Tensor,
                      seq_lens: torch.Tensor, layer: int, mode: str, block_size: int, topk: int,
                      local_blocks: int, init_blocks: int) -> torch.Tensor:
    """One layer's cache write + paged attention as one op opaque to torch.compile, over the cache
    and plan of `paged_step_context`.  q [B, nq, Hq, D], q_idx [B, nq, G, Di] or None, k / v
    [B, nq, G, D], k_idx [B, nq, Di] or None, slots int64 [B * nq], page_table int32 [B, W],
    seq_lens int32 [B] -> o [B, nq, Hq, D] (contiguous, q's dtype).  The write into the cache's
    pools is a side effect the op's schema does not declare: the pools are not inputs of any
    other op of the graph."""
    if not _STEP_CONTEXT:
        raise RuntimeError("msakit::paged_step_attend runs inside paged_step_context only")
    cache, plan, backend = _STEP_CONTEXT[-1]
    B, nq = q.shape[:2]
    G, D = k.shape[2], k.shape[3]
    cache.write(layer, slots, k.reshape(B * nq, G, D), v.reshape(B * nq, G, D),
                None if k_idx is None else k_idx.reshape(B * nq, -1))
    keys = PagedKeys(cache.layer(layer), page_table, seq_lens, cache.page_size, plan, backend)
    sel = Selection(block_size, topk, local_blocks, init_blocks)
    sparse = mode == "sparse" and q_idx is not None
    return _paged(q, q_idx if sparse else None, keys, sel, None).contiguous()


@paged_step_attend.register_fake
def _paged_step_attend_fake(q, q_idx, k, v, k_idx, slots, page_table, seq_lens, layer, mode, block_size, topk,
                            local_blocks, init_blocks):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)
