"""The generation-2 sparse-attention forward for Hopper (sm_90a): union-tile query-outer, written
in CUTLASS's CuTe DSL (`kernel.py`), an optional dependency (`pip install nvidia-cutlass-dsl`,
imported lazily: msakit imports and runs without it).

Same meaning and layouts as `sparse_attention_reference` (q [B, T, Hq, D], k/v [B, T, G, D],
block_idx int32 [B, G, T, topk] -> o [B, T, Hq, D], lse fp32 [B, Hq, T]).  The kernel takes bf16,
Hq / G = 16, D = 128, block_size = 128 and no cu_seqlens (`unsupported_reason` says why not
otherwise).  Per tile of 8 consecutive queries of one group the kernel loads the union of their
blocks (`worklist`) and masks per row, so its MMA work is the union size per tile times 128 rows:
about 1x the useful work on selections whose neighbouring queries agree, several times it on
uniform random ones (docs/kernels.md).

Dispatch (`sparse_attention`'s forward): where the union plan's mean union ratio is at most
`union.UNION_MAX_RATIO_SM90` (2.1, this kernel's measured break-even against the KV-outer one),
tensors this kernel takes on an sm_90 GPU with the DSL installed run it, with the work list
converted from that plan (`worklist_from_union_plan`); without the DSL the Triton union kernel
runs up to its own `union.UNION_MAX_RATIO` and a warning says so once.

The backward (`sparse_attention_bwd_sm90`, `kernel_bwd.py`): key-block-outer over the same unions
cut into m-blocks of 4 queries (`worklist_bwd`), FlashAttention-3's backward per (key block, run
of m-blocks); not dispatched yet (the public op's backward stays the Triton KV-outer kernel).
"""

from __future__ import annotations

import functools

import torch

from .consts import BLOCK, HEAD_DIM, HPG
from .worklist import tile_count, union_worklist, union_worklist_reference, worklist_from_union_plan

__all__ = ["dsl_available", "unsupported_reason", "sparse_attention_fwd_sm90", "sparse_attention_bwd_sm90",
           "union_worklist",
           "union_worklist_reference", "worklist_from_union_plan", "tile_count", "queries_per_tile", "CONFIG"]

# consumer warpgroups (tiles of 4 * consumers queries) and pipeline stages of `kernel.SparseFwdSm90`
CONFIG = {"consumers": 2, "stages": 2}


def queries_per_tile() -> int:
    """Queries per tile of the kernel (4 per consumer warpgroup: 64 MMA rows of 16 heads)."""
    return 4 * CONFIG["consumers"]


@functools.lru_cache(maxsize=1)
def dsl_available() -> bool:
    """True when CUTLASS's CuTe DSL (and the CUDA Python bindings it launches with) import."""
    try:
        import cuda.bindings.driver  # noqa: F401
        import cutlass.cute  # noqa: F401
    except Exception:
        return False
    return True


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, block_size: int, cu_seqlens: torch.Tensor | None,
                       *, need_device: bool = True) -> str | None:
    """Why the sm_90 kernel cannot run these arguments (None when it can); with need_device=False
    only the shapes, dtypes and layouts are judged (the CPU tests)."""
    if q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16:
        return f"dtype {q.dtype} (the sm_90 kernel takes bfloat16)"
    if q.shape[-1] != HEAD_DIM:
        return f"head dim {q.shape[-1]} (the sm_90 kernel takes {HEAD_DIM})"
    if q.shape[2] != HPG * k.shape[2]:
        return f"{q.shape[2] // max(1, k.shape[2])} query heads per kv head (the sm_90 kernel takes {HPG})"
    if block_size != BLOCK:
        return f"block_size {block_size} (the sm_90 kernel takes {BLOCK})"
    if cu_seqlens is not None:
        return "cu_seqlens (the sm_90 kernel takes fixed-length batches)"
    if need_device:
        if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device) != (9, 0):
            return f"device {q.device} (the sm_90 kernel runs on sm_90 GPUs)"
        if not dsl_available():
            return "no nvidia-cutlass-dsl"
    return None


def _to_cute(t: torch.Tensor, align: int):
    from cutlass.cute.runtime import from_dlpack

    return from_dlpack(t.detach(), assumed_align=align).mark_layout_dynamic(leading_dim=t.dim() - 1)


_compiled: dict = {}


def _launch(q, k, v, o, lse, work, count, scale: float) -> None:
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute

    from .kernel import SparseFwdSm90

    args = [_to_cute(t, 16) for t in (q, k, v, o)] + [_to_cute(t, 4) for t in (lse, work, count)]
    stream = cuda.CUstream(torch.cuda.current_stream(q.device).cuda_stream)
    key = (CONFIG["consumers"], CONFIG["stages"], q.device.index)
    fn = _compiled.get(key)
    if fn is None:
        fn = _compiled[key] = cute.compile(SparseFwdSm90(CONFIG["consumers"], CONFIG["stages"]), *args,
                                           cutlass.Float32(scale), stream)
    fn(*args, cutlass.Float32(scale), stream)


def sparse_attention_fwd_sm90(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_idx: torch.Tensor,
                              block_size: int, scale: float, *, out: torch.Tensor | None = None,
                              lse_out: torch.Tensor | None = None,
                              worklist: tuple[torch.Tensor, torch.Tensor] | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [B, T, Hq, D] bf16, lse fp32 [B, Hq, T]) by the sm_90 kernel; the arguments as the
    public op checked them (block ids in range).  out / lse_out: contiguous outputs to write
    (every valid row is written); worklist: a prebuilt `union_worklist(block_idx, queries, nblocks)`."""
    why = unsupported_reason(q, k, block_size, None)
    if why is not None:
        raise ValueError(f"sparse_attention_fwd_sm90 does not take {why}")
    B, T, Hq, D = q.shape
    q, k, v = (t.contiguous() for t in (q, k, v))
    o = torch.empty_like(q) if out is None else out
    lse = torch.empty((B, Hq, T), dtype=torch.float32, device=q.device) if lse_out is None else lse_out
    if not (o.is_contiguous() and lse.is_contiguous() and o.shape == q.shape and lse.shape == (B, Hq, T)):
        raise ValueError(f"out / lse_out must be contiguous {tuple(q.shape)} / {(B, Hq, T)}")
    if worklist is None:
        worklist = union_worklist(block_idx, queries_per_tile(), tile_count(T, block_size))
    work, count = worklist
    if T:
        _launch(q, k, v, o, lse, work, count, float(scale))
    return o, lse


def union_ratio(count: torch.Tensor, block_idx: torch.Tensor) -> float:
    """MMA work of the union tiles over the useful work: sum of union sizes x tile queries / valid
    slots (reads it back: a host sync)."""
    queries = queries_per_tile()
    valid = (block_idx >= 0).sum()
    return float(count.sum() * queries) / max(1.0, float(valid))


# pipeline stages of `kernel_bwd.SparseBwdSm90`
CONFIG_BWD = {"stages": 2}
_compiled_bwd: dict = {}


def _launch_bwd(q, k, v, do, lse2, delta, dq_acc, dk_acc, dv_acc, items, ent, scale: float) -> None:
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute

    from .kernel_bwd import SparseBwdSm90

    args = ([_to_cute(t, 16) for t in (q, k, v, do)]
            + [_to_cute(t, 16) for t in (lse2, delta, dq_acc, dk_acc, dv_acc)] + [_to_cute(t, 4) for t in (items, ent)])
    stream = cuda.CUstream(torch.cuda.current_stream(q.device).cuda_stream)
    key = (CONFIG_BWD["stages"], q.device.index)
    fn = _compiled_bwd.get(key)
    sl2 = cutlass.Float32(scale * 1.4426950408889634)
    if fn is None:
        fn = _compiled_bwd[key] = cute.compile(SparseBwdSm90(CONFIG_BWD["stages"]), *args, sl2, stream)
    fn(*args, sl2, stream)


def sparse_attention_bwd_sm90(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                              lse: torch.Tensor, block_idx: torch.Tensor, block_size: int, scale: float, *,
                              dlse: torch.Tensor | None = None,
                              worklist: tuple[torch.Tensor, torch.Tensor] | None = None,
                              need_device: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of `sparse_attention_fwd_sm90`'s (o, lse) given do [B, T, Hq, D] (and dlse
    [B, Hq, T], or None) by the sm_90 backward kernel (`kernel_bwd`); the arguments as the public
    op checked them (block ids in range).  worklist: a prebuilt `worklist_bwd.bwd_worklist(
    block_idx, nblocks)` (items, ent); built here otherwise (one host sync: it sizes the grid).
    Preprocessing in torch: delta = rowsum(dO * O) - dlse and lse * log2(e), token-major fp32;
    fp32 accumulators for dq (4 B x B*T*Hq*D), dk and dv, zeroed, converted after the kernel.
    need_device=False judges the shapes only and stops before the kernel (the CPU tests)."""
    why = unsupported_reason(q, k, block_size, None, need_device=need_device)
    if why is not None:
        raise ValueError(f"sparse_attention_bwd_sm90 does not take {why}")
    B, T, Hq, D = q.shape
    G = k.shape[2]
    for name, t, shape in (("do", do, q.shape), ("o", o, q.shape), ("v", v, k.shape), ("lse", lse, (B, Hq, T)),
                           ("block_idx", block_idx, (B, G, T, block_idx.shape[-1]))):
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"sparse_attention_bwd_sm90: {name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if do.dtype != q.dtype or o.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError("sparse_attention_bwd_sm90: do, o, v must have q's dtype")
    if not need_device:
        return None
    from .worklist_bwd import bwd_worklist, mblock_count

    q, k, v, do = (t.contiguous() for t in (q, k, v, do))
    delta = (do.float() * o.float()).sum(-1)  # [B, T, Hq]
    if dlse is not None:
        delta = delta - dlse.float().transpose(1, 2)
    delta = delta.contiguous()
    lse2 = (lse.float().transpose(1, 2) * 1.4426950408889634).contiguous()
    if worklist is None:
        worklist = bwd_worklist(block_idx, tile_count(T, block_size))
    items, ent = worklist
    nmb = mblock_count(T)
    dq_acc = torch.zeros(B * G * nmb * HPG * 4 * D, dtype=torch.float32, device=q.device)
    dk_acc = torch.zeros(B, T, G, D, dtype=torch.float32, device=q.device)
    dv_acc = torch.zeros(B, T, G, D, dtype=torch.float32, device=q.device)
    if items.shape[0]:
        _launch_bwd(q, k, v, do, lse2, delta, dq_acc, dk_acc, dv_acc, items, ent,
                    float(scale))
    from .worklist_bwd import dq_from_accum

    dq = (dq_from_accum(dq_acc.view(B, G, nmb, 2, 64, 64), B, G, T, HPG, D) * scale).to(q.dtype)
    return dq, (dk_acc * scale).to(k.dtype), dv_acc.to(v.dtype)
