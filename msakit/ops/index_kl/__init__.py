"""`index_kl_loss`: the indexer's training signal, KL(main attention || index attention)."""

from __future__ import annotations

import math

import torch

from ..checks import (check_block_attention, check_block_idx, check_cu_seqlens, check_finite_inputs, check_index_qk,
                      check_positive_int, check_qkv, check_same, check_scale)
from ..dispatch import use_triton, warn_once
from .chunked import index_kl_loss_chunked
from .reference import index_kl_loss_reference, selected_lse_reference

__all__ = [
    "block_attention_mass",
    "causal_blocks",
    "index_kl_loss",
    "index_kl_loss_reference",
    "selected_lse",
    "selected_lse_reference",
]


# --------------------------------------------------------------------------------------------
# Custom ops: the forward computes the loss and both gradients in one pass (the gradients are
# [B,T,G,Di] and [B,T,Di], the size of q_idx and k_idx); the backward scales them.
# --------------------------------------------------------------------------------------------


def _grad_save_dtype(dtype: torch.dtype) -> torch.dtype:
    # float16 cannot hold the 1 / (B*G*T)-scaled gradients: keep them in float32 until backward
    return torch.float32 if dtype == torch.float16 else dtype


@torch.library.custom_op("msakit::index_kl_fwd", mutates_args=())
def _index_kl_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    block_idx: torch.Tensor,
    lse: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    block_size: int,
    softmax_scale: float,
    index_softmax_scale: float,
    compute_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from .triton import index_kl_fwd_triton

    return index_kl_fwd_triton(
        q, k, q_idx, k_idx, block_idx, lse, cu_seqlens, block_size, softmax_scale, index_softmax_scale, compute_grad
    )


@_index_kl_fwd.register_fake
def _index_kl_fwd_fake(q, k, q_idx, k_idx, block_idx, lse, cu_seqlens, block_size, softmax_scale,
                       index_softmax_scale, compute_grad):
    loss = q_idx.new_empty((), dtype=torch.float32)
    if compute_grad:
        return (loss, torch.empty_like(q_idx, dtype=_grad_save_dtype(q_idx.dtype)),
                torch.empty_like(k_idx, dtype=_grad_save_dtype(k_idx.dtype)))
    return loss, q_idx.new_empty(0), k_idx.new_empty(0)


@torch.library.custom_op("msakit::index_kl_bwd", mutates_args=())
def _index_kl_bwd(
    grad_loss: torch.Tensor, dq_idx: torch.Tensor, dk_idx: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    g = grad_loss.to(torch.float32)
    return (g * dq_idx.float()).to(dq_idx.dtype), (g * dk_idx.float()).to(dk_idx.dtype)


@_index_kl_bwd.register_fake
def _index_kl_bwd_fake(grad_loss, dq_idx, dk_idx):
    return torch.empty_like(dq_idx), torch.empty_like(dk_idx)


def _setup_context(ctx, inputs, output):
    _, dq, dk = output
    ctx.compute_grad = inputs[-1]
    ctx.dtypes = (inputs[2].dtype, inputs[3].dtype)
    ctx.save_for_backward(dq, dk)


def _backward(ctx, grad_loss, _gdq, _gdk):
    if not ctx.compute_grad:
        return (None,) * 11
    dq, dk = ctx.saved_tensors
    gq, gk = torch.ops.msakit.index_kl_bwd(grad_loss, dq, dk)
    return None, None, gq.to(ctx.dtypes[0]), gk.to(ctx.dtypes[1]), None, None, None, None, None, None, None


torch.library.register_autograd("msakit::index_kl_fwd", _backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------
# Public op
# --------------------------------------------------------------------------------------------


# over="all" on the Triton kernel: the bound on its selection of every causal block (work list,
# per-slot statistics); larger inputs run the chunked path
ALL_KL_MAX_BYTES = 4 << 30


def _all_kl_bytes(B: int, T: int, Hq: int, G: int, block_size: int) -> int:
    nblk = -(-T // block_size)
    # block_idx + the key-to-query work list (~3 int32 per entry) + fp32 partial LSEs per head and group
    return B * T * nblk * 4 * (G * 4 + Hq + G)


def causal_blocks(B: int, G: int, T: int, block_size: int, device: torch.device) -> torch.Tensor:
    """int32 [B, G, T, nblk]: row i selects blocks 0 .. i // block_size, then -1 (every causal
    block: the selection that makes the selected-token KL the KL over all causal tokens)."""
    nblk = -(-T // block_size)
    ids = torch.arange(nblk, dtype=torch.int32, device=device)
    own = torch.arange(T, device=device) // block_size
    rows = torch.where(ids[None, :] <= own[:, None], ids[None, :], torch.full_like(ids[None, :], -1))
    return rows.expand(B, G, T, nblk).contiguous()


def index_kl_loss(
    q: torch.Tensor,
    k: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    block_idx: torch.Tensor | None,
    *,
    block_size: int = 128,
    softmax_scale: float | None = None,
    index_softmax_scale: float | None = None,
    lse: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    over: str = "selected",
    backend: str = "auto",
    validate: bool = True,
    check_finite: bool = False,
) -> torch.Tensor:
    """Mean over (b, r, i) of KL(P || P_idx) on the selected tokens; a scalar.

    q [B, T, Hq, D], k [B, T, G, D] (the main branch; treated as constants), q_idx [B, T, G, Di],
    k_idx [B, T, Di] (receive gradients), block_idx int32 [B, G, T, topk].  P is the group's
    head-averaged softmax(softmax_scale * q . k), P_idx = softmax(index_softmax_scale *
    q_idx . k_idx), both over the tokens j <= i of the selected blocks.  Default scales are
    1/sqrt(D) and 1/sqrt(Di).

    lse: optional [B, Hq, T] float32, the main branch's log-sum-exp over the selected tokens (as
    returned by `sparse_attention(..., return_lse=True)`); the kernel then recomputes P from q,
    k and lse without a statistics pass (so does the chunked path).  When None it is computed
    (`selected_lse`'s pass inside the kernel), and the first such call warns once: a training
    layer gets the output and the KL from one forward with `ops.sparse_attention_with_kl`.
    The reference backend ignores it (it normalises P exactly).
    cu_seqlens: optional int32 [ndocs + 1]; then B = 1, the documents are packed along T, block
    ids are relative to each document's start, and the loss is the mean over all (r, i) of all
    documents.
    over: "selected" (default) or "all": with "all", P and P_idx are taken over every token
    j <= i (the dense causal distributions, so blocks never selected get a signal too);
    block_idx is then ignored and may be None, and lse must be None.
    backend: "auto" | "triton" | "reference" (see msakit.ops.dispatch).  The Triton path
    computes the loss and the gradients in the forward (one pass; fp32 atomics, so gradients
    are not bitwise deterministic); float64 inputs always use the reference.  over="all" runs the
    kernel on `causal_blocks` (every causal block selected) up to `ALL_KL_MAX_BYTES` of work list
    and statistics, without packed documents; off the kernel (CPU, float64, larger or packed
    over="all", warned) "auto" runs the chunked matmul path of `chunked.py`.
    validate=True checks block_idx's values as `sparse_attention` does (ids in range and causal;
    one host sync on CUDA).  A row selecting nothing adds 0 to the sum (its P and P_idx are empty).
    check_finite=True raises ValueError when q, k, q_idx, k_idx or lse holds NaN (lse may be -inf
    on an empty row, not +inf) or q, k, q_idx, k_idx an inf (it reads them: a host sync on CUDA).
    """
    B, T, Hq, G, D = check_qkv(q, k, None)
    Bi, Ti, Gi, Di = check_index_qk(q_idx, k_idx)
    if (Bi, Ti, Gi) != (B, T, G):
        raise ValueError(f"q_idx must have shape [B={B}, T={T}, G={G}, Di], got {tuple(q_idx.shape)}")
    check_same(("q", "q_idx"), (q, q_idx), dtype=False)
    check_positive_int("block_size", block_size)
    if over not in ("selected", "all"):
        raise ValueError(f"over must be 'selected' or 'all', got {over!r}")
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, B, T, q.device)
    if over == "selected" or block_idx is not None:
        check_block_idx(block_idx, B, G, T, block_size, q.device, check_values=validate, cu_seqlens=cu_seqlens)
    if over == "all" and lse is not None:
        raise ValueError("lse is the log-sum-exp over the selected tokens: over='all' takes lse=None")
    scale = check_scale("softmax_scale", softmax_scale, 1.0 / math.sqrt(D))
    iscale = check_scale("index_softmax_scale", index_softmax_scale, 1.0 / math.sqrt(Di))
    if lse is not None:
        if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != (B, Hq, T) or not lse.is_floating_point():
            raise ValueError(f"lse must be a float tensor of shape [B={B}, Hq={Hq}, T={T}]")
        if lse.device != q.device:
            raise ValueError(f"lse is on {lse.device} but q is on {q.device}")
    if check_finite:  # lse is -inf on a row selecting nothing: only NaN and +inf are errors there
        check_finite_inputs(q=q, k=k, q_idx=q_idx, k_idx=k_idx,
                            lse=None if lse is None else lse.clamp_min(torch.finfo(lse.dtype).min))

    fp64 = torch.float64 in (q.dtype, q_idx.dtype)
    kernel = use_triton("index_kl_loss", backend, q.device) and not (fp64 and backend == "auto")
    if kernel and lse is None and over == "selected":
        warn_once(
            "index_kl_loss:lse",
            "msakit: index_kl_loss without lse computes the main branch's log-sum-exp over the selected tokens "
            "(a pass over q and k that a sparse forward on the same selection already made): "
            "ops.sparse_attention_with_kl shares the forward's, or pass lse=sparse_attention(..., return_lse=True)[1] "
            "(without a sparse forward, e.g. a dense warm-up, lse=None is the cheapest form)",
        )
    if kernel and over == "all":
        # the kernel on the selection of every causal block is the KL over all causal tokens; its
        # work list and statistics grow as T * nblocks, so past ALL_KL_MAX_BYTES (and for packed
        # documents) the chunked path runs instead
        need = _all_kl_bytes(B, T, Hq, G, block_size)
        if cu_seqlens is None and need <= ALL_KL_MAX_BYTES:
            block_idx = causal_blocks(B, G, T, block_size, q.device)
            over = "selected"
        else:
            why = "packed documents (cu_seqlens)" if cu_seqlens is not None else \
                f"{need / 2**30:.1f} GiB of work list and statistics > ALL_KL_MAX_BYTES"
            warn_once("index_kl_loss:all", f"msakit: index_kl_loss(over='all') runs the chunked PyTorch path ({why})")
    if kernel and over == "selected":
        if fp64:
            raise ValueError("backend='triton' for index_kl_loss supports fp16/bf16/fp32 inputs, not float64")
        compute_grad = torch.is_grad_enabled() and (q_idx.requires_grad or k_idx.requires_grad)
        loss, _, _ = torch.ops.msakit.index_kl_fwd(
            q.detach(), k.detach(), q_idx, k_idx, block_idx,
            None if lse is None else lse.detach(),
            None if cu_seqlens is None else cu_seqlens.to(torch.int32),
            block_size, scale, iscale, compute_grad,
        )
        return loss
    if backend != "reference":  # CPU (or no usable kernel): chunked matmuls, equal to the reference
        return index_kl_loss_chunked(
            q, k, q_idx, k_idx, block_idx, block_size, scale, iscale, lse=lse, cu_seqlens=cu_seqlens, over=over
        )
    return index_kl_loss_reference(
        q.detach(), k.detach(), q_idx, k_idx, block_idx,
        block_size=block_size, softmax_scale=scale, index_softmax_scale=iscale, over=over, cu_seqlens=cu_seqlens,
    )


def selected_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    block_idx: torch.Tensor,
    *,
    block_size: int = 128,
    softmax_scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """The main branch's per-head log-sum-exp over the selected tokens, [B, Hq, T] float32.

    lse[b, h, i] = log sum_{j in T_sel(r, i)} exp(softmax_scale * q_h(i) . k_r(j)), -inf for a
    row selecting nothing (what `index_kl_loss` takes as `lse`).
    """
    B, T, Hq, G, D, scale = check_block_attention(
        q, k, None, block_idx, block_size, softmax_scale, cu_seqlens, check_values=validate
    )
    if use_triton("selected_lse", backend, q.device) and q.dtype != torch.float64:
        from .triton import selected_lse_triton

        with torch.no_grad():
            return selected_lse_triton(q.detach(), k.detach(), block_idx, block_size, scale, cu_seqlens=cu_seqlens)
    return selected_lse_reference(q, k, block_idx, block_size=block_size, softmax_scale=scale, cu_seqlens=cu_seqlens)


def block_attention_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    block_size: int = 128,
    softmax_scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """The true attention mass of every key block (the oracle's score), causal self-attention:
    q [B, T, Hq, D], k [B, T, G, D] -> float32 [B, G, T, nblk], mass[b, r, i, c] = mean over the
    heads h of group r of sum_{j in block c, j <= i} softmax_j(scale * q_h(i) . k_r(j)); blocks
    after the query's own have mass 0.  `msakit.ops.index_topk.attention_block_mass` with
    positions 0 .. T-1 defines it.

    The Triton path runs `selected_lse`'s statistics pass on `causal_blocks` (per block and head
    the log-sum-exp of the block's logits; P is never stored) and needs B * T * nblk * Hq * 4
    bytes for them; off the kernel (CPU, float64, reference backend) the reference runs, which
    holds [B, G, Hq // G, T, T] scores: call it on bounded T there."""
    B, T, Hq, G, D = check_qkv(q, k, None)
    check_positive_int("block_size", block_size)
    scale = check_scale("softmax_scale", softmax_scale, 1.0 / math.sqrt(D))
    fp64 = q.dtype == torch.float64
    if use_triton("block_attention_mass", backend, q.device) and not fp64:
        from .triton import block_lse

        with torch.no_grad():
            part = block_lse(q.detach(), k.detach(), causal_blocks(B, G, T, block_size, q.device), block_size, scale)
            lse = torch.logsumexp(part, dim=3, keepdim=True)  # [B, G, T, 1, hpg]: every row sees token 0
            return torch.exp(part - lse).mean(dim=4)
    from ..index_topk.reference import attention_block_mass

    pos = torch.arange(T, device=q.device).view(1, T)
    return attention_block_mass(q, k, pos, block_size=block_size, softmax_scale=scale)
