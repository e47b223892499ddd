"""`sparse_attention`: attention restricted to the selected key blocks of each (group, query).

Backends (see `msakit.ops.dispatch`): the Triton kernels, registered as the custom ops
``msakit::sparse_attention_fwd`` / ``msakit::sparse_attention_bwd`` with fake implementations and
autograd, so they work under torch.compile: the forward runs a union-tile kernel where consecutive
queries share their blocks (the plan's mean union ratio decides per call: `union.py`), on sm_90
with the optional CuTe DSL the warp-specialized one of `sm90/`, else the Triton one of `union.py`,
and the KV-outer kernel of `triton.py` elsewhere; the backward is the KV-outer one.  Or the PyTorch reference of
`reference.py` (the meaning).
"""

from __future__ import annotations

import torch

from ..checks import check_block_attention, check_finite_inputs
from ..dispatch import use_triton, warn_once
from .chunked import sparse_attention_chunked
from .reference import sparse_attention_reference

__all__ = ["sparse_attention", "sparse_attention_reference", "SparseAttentionFunction"]


def _kernels():
    from . import triton as kernels  # imported lazily: triton may be missing on CPU-only hosts

    return kernels


# ------------------------------------------------------------------------------ custom ops
_FWD_SCHEMA = "(Tensor q, Tensor k, Tensor v, Tensor block_idx, Tensor? cu_seqlens, int block_size, float scale) -> (Tensor, Tensor)"
_BWD_SCHEMA = (
    "(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor? dlse, Tensor block_idx, "
    "Tensor? cu_seqlens, int block_size, float scale) -> (Tensor, Tensor, Tensor)"
)


def _fwd_impl(q, k, v, block_idx, cu_seqlens, block_size, scale):
    kernels = _kernels()
    if cu_seqlens is not None or (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        # documents packed in one row, or a graph capture (the plan syncs the host): KV-outer alone
        return kernels.sparse_attention_fwd_triton(q, k, v, block_idx, cu_seqlens, block_size, scale)
    from .union import (UNION_MAX_RATIO, UNION_MAX_RATIO_SM90, sparse_attention_fwd_union, union_plan, union_q_tile,
                        union_supports)

    hpg, D = q.shape[2] // k.shape[2], q.shape[3]
    qt = union_q_tile(hpg, block_idx.shape[3])
    if union_supports(hpg, qt, D, block_size) and block_idx.shape[2] >= qt:
        plan = union_plan(block_idx, qt)
        ratio = float(plan[3].mean())  # the mean union ratio (one host sync)
        if ratio <= UNION_MAX_RATIO_SM90 and _sm90_runs(q, k, block_size, qt):
            from . import sm90

            work = sm90.worklist_from_union_plan(plan, qt)
            return sm90.sparse_attention_fwd_sm90(q, k, v, block_idx, block_size, scale, worklist=work)
        if ratio <= UNION_MAX_RATIO:
            return sparse_attention_fwd_union(q, k, v, block_idx, block_size, scale, q_tile=qt, plan=plan)
    return kernels.sparse_attention_fwd_triton(q, k, v, block_idx, cu_seqlens, block_size, scale)


def _sm90_runs(q, k, block_size, q_tile) -> bool:
    """Whether the union tiles go to the CuTe DSL kernel of `sm90/` (sm_90, bf16, its shapes, the
    DSL installed); warns once where only the DSL is missing."""
    if not q.is_cuda:
        return False
    from . import sm90

    why = sm90.unsupported_reason(q, k, block_size, None)
    if why == "no nvidia-cutlass-dsl":
        warn_once("sparse_attention_sm90", "sparse_attention: the warp-specialized sm_90 forward needs "
                  "nvidia-cutlass-dsl (pip install 'msakit[hopper]'); running the Triton union kernel")
    return why is None and q_tile == sm90.queries_per_tile()


def _fwd_fake(q, k, v, block_idx, cu_seqlens, block_size, scale):
    B, T, Hq, _ = q.shape
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty((B, Hq, T), dtype=torch.float32)


def _bwd_impl(do, q, k, v, o, lse, dlse, block_idx, cu_seqlens, block_size, scale):
    return _kernels().sparse_attention_bwd_triton(do, q, k, v, o, lse, dlse, block_idx, cu_seqlens, block_size, scale)


def _bwd_fake(do, q, k, v, o, lse, dlse, block_idx, cu_seqlens, block_size, scale):
    f = torch.contiguous_format
    return torch.empty_like(q, memory_format=f), torch.empty_like(k, memory_format=f), torch.empty_like(v, memory_format=f)


def _setup_context(ctx, inputs, output):
    q, k, v, block_idx, cu_seqlens, block_size, scale = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, block_idx, cu_seqlens)
    ctx.block_size, ctx.scale = block_size, scale
    ctx.set_materialize_grads(False)  # an unused lse (or o) gives None, not a tensor of zeros


def _backward(ctx, do, dlse):
    q, k, v, o, lse, block_idx, cu_seqlens = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(o)
    dq, dk, dv = _bwd_op(do, q, k, v, o, lse, dlse, block_idx, cu_seqlens, ctx.block_size, ctx.scale)
    return dq, dk, dv, None, None, None, None


class SparseAttentionFunction(torch.autograd.Function):
    """The same autograd as the custom op, for torch builds without `torch.library.custom_op`."""

    @staticmethod
    def forward(ctx, q, k, v, block_idx, cu_seqlens, block_size, scale):
        o, lse = _fwd_impl(q, k, v, block_idx, cu_seqlens, block_size, scale)
        _setup_context(ctx, (q, k, v, block_idx, cu_seqlens, block_size, scale), (o, lse))
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        return _backward(ctx, do, dlse)


def _register():
    lib = getattr(torch, "library", None)
    if lib is None or not hasattr(lib, "custom_op"):
        return None, None
    try:
        fwd = lib.custom_op("msakit::sparse_attention_fwd", _fwd_impl, mutates_args=(), schema=_FWD_SCHEMA)
        bwd = lib.custom_op("msakit::sparse_attention_bwd", _bwd_impl, mutates_args=(), schema=_BWD_SCHEMA)
        fwd.register_fake(_fwd_fake)
        bwd.register_fake(_bwd_fake)
        fwd.register_autograd(_backward, setup_context=_setup_context)
    except RuntimeError:  # already registered (module re-imported): use the registered ops
        ns = torch.ops.msakit
        return ns.sparse_attention_fwd, ns.sparse_attention_bwd
    return fwd, bwd


_fwd_op, _bwd_custom = _register()


def _bwd_op(*args):
    if _bwd_custom is not None:
        return _bwd_custom(*args)
    return _bwd_impl(*args)


# ------------------------------------------------------------------------------ public op
def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_idx: torch.Tensor,
    *,
    block_size: int = 128,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
    validate: bool = True,
    check_finite: bool = False,
):
    """Block-sparse causal GQA attention.

    q [B, T, Hq, D]; k, v [B, T, G, D]; block_idx int32 [B, G, T, topk] (ids of key blocks of
    `block_size` tokens, -1 = none).  Head h of group r = h // (Hq // G) at query i attends the
    tokens j <= i of the blocks block_idx[b, r, i].  Returns o [B, T, Hq, D] in q's dtype and,
    with return_lse, lse [B, Hq, T] float32 (natural log).  A row that selects no token (all -1,
    down to a selection that is -1 everywhere) gives o = 0 and lse = -inf, and passes no gradient
    (zeros, no NaN) to q, k, v, on every backend.

    cu_seqlens: int32 [ndocs + 1] for a packed variable-length batch (B = 1, T = total): the
    documents [cu_seqlens[d], cu_seqlens[d+1]) attend only inside themselves and their block
    ids count from each document's start.  backend: "auto" | "triton" | "reference"
    (`msakit.ops.dispatch`); off the kernel, "auto" runs the chunked matmul path of `chunked.py`
    and "reference" the reference itself.  Differentiable in q, k, v (and through lse).
    validate=True checks block_idx's values (one host sync on CUDA): ids in [-1, number of
    blocks) and causal, no id after the query's own block (i // block_size, counted from the
    document's start with cu_seqlens); ValueError naming block_idx otherwise.  validate=False
    skips it for a selection known to be valid, such as index_topk's output; the kernels then
    ignore ids outside [0, own block].  check_finite=True raises ValueError when q, k or v holds
    NaN or inf (it reads them: a host sync on CUDA); without it NaN reaches o's rows that attend it.
    """
    B, T, Hq, G, D, scale = check_block_attention(
        q, k, v, block_idx, block_size, softmax_scale, cu_seqlens, check_values=validate
    )
    if check_finite:
        check_finite_inputs(q=q, k=k, v=v)
    if use_triton("sparse_attention", backend, q.device):
        why = _kernels().kernel_supports(q.dtype, D, block_size, q.device)
        if why is None:
            args = (q, k, v, block_idx, cu_seqlens, int(block_size), float(scale))
            o, lse = _fwd_op(*args) if _fwd_op is not None else SparseAttentionFunction.apply(*args)
            return (o, lse) if return_lse else o
        if backend == "triton":
            raise ValueError(f"backend='triton' for sparse_attention does not take {why}")
        warn_once(f"sparse_attention:{why}", f"msakit: sparse_attention falls back to the chunked PyTorch path for {why}")
    if backend == "reference":
        return sparse_attention_reference(
            q, k, v, block_idx, block_size=block_size, softmax_scale=scale, return_lse=return_lse, cu_seqlens=cu_seqlens
        )
    # CPU (or no usable kernel): chunked matmuls, equal to the reference
    o, lse = sparse_attention_chunked(q, k, v, block_idx, int(block_size), float(scale), cu_seqlens=cu_seqlens)
    return (o, lse) if return_lse else o
