"""Argument checks shared by the public ops.

Every public op validates its inputs here and raises `ValueError` naming the offending
argument, before any kernel runs.  Layouts (see docs/msa.md):

    q        [B, T, Hq, D]      query heads; head h belongs to group r = h // (Hq // G)
    k, v     [B, T, G, D]       one key/value head per group
    q_idx    [B, T, G, Di]      one index-query head per group
    k_idx    [B, T, Di]         one index key per token, shared by all groups
    block_idx int32 [B, G, T, topk]   selected block ids, -1 padded
"""

from __future__ import annotations

import math

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_tensor(name: str, x: object, ndim: int, *, float_only: bool = True) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    if float_only and x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be a floating tensor (fp16/bf16/fp32/fp64), got {x.dtype}")
    return x


def check_same(names: tuple[str, ...], tensors: tuple[torch.Tensor, ...], *, dtype: bool = True) -> None:
    first_name, first = names[0], tensors[0]
    for n, t in zip(names[1:], tensors[1:]):
        if t.device != first.device:
            raise ValueError(f"{n} is on {t.device} but {first_name} is on {first.device}")
        if dtype and t.dtype != first.dtype:
            raise ValueError(f"{n} has dtype {t.dtype} but {first_name} has {first.dtype}")


def check_positive_int(name: str, value: object, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> tuple[int, int, int, int, int]:
    """Checks q [B,T,Hq,D], k/v [B,T,G,D]; returns (B, T, Hq, G, D)."""
    check_tensor("q", q, 4)
    check_tensor("k", k, 4)
    names, ts = ("q", "k"), (q, k)
    if v is not None:
        check_tensor("v", v, 4)
        names, ts = ("q", "k", "v"), (q, k, v)
    check_same(names, ts)
    B, T, Hq, D = q.shape
    if k.shape[0] != B or k.shape[1] != T or k.shape[3] != D:
        raise ValueError(f"k must have shape [B={B}, T={T}, G, D={D}], got {tuple(k.shape)}")
    if v is not None and v.shape != k.shape:
        raise ValueError(f"v must have the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    G = k.shape[2]
    if G < 1 or Hq % G != 0:
        raise ValueError(f"q's head count Hq={Hq} must be a multiple of k's group count G={G}")
    if T < 1:
        raise ValueError("q must hold at least one token (T >= 1)")
    if D < 1:
        raise ValueError(f"q's head dim (last dimension) must be >= 1, got shape {tuple(q.shape)}")
    return B, T, Hq, G, D


def check_index_qk(q_idx: torch.Tensor, k_idx: torch.Tensor) -> tuple[int, int, int, int]:
    """Checks q_idx [B,T,G,Di], k_idx [B,T,Di]; returns (B, T, G, Di)."""
    check_tensor("q_idx", q_idx, 4)
    check_tensor("k_idx", k_idx, 3)
    check_same(("q_idx", "k_idx"), (q_idx, k_idx))
    B, T, G, Di = q_idx.shape
    if tuple(k_idx.shape) != (B, T, Di):
        raise ValueError(f"k_idx must have shape [B={B}, T={T}, Di={Di}], got {tuple(k_idx.shape)}")
    if T < 1:
        raise ValueError("q_idx must hold at least one token (T >= 1)")
    if Di < 1:
        raise ValueError(f"q_idx's index dim (last dimension) must be >= 1, got shape {tuple(q_idx.shape)}")
    return B, T, G, Di


def check_finite_inputs(**tensors: torch.Tensor | None) -> None:
    """ValueError naming the first of `tensors` (keyword = argument name; None skipped) that holds
    NaN or inf: the ops' opt-in `check_finite`.  One host sync on CUDA for all of them."""
    named = [(n, t) for n, t in tensors.items() if t is not None and t.numel()]
    if not named:
        return
    ok = torch.stack([torch.isfinite(t).all().to(named[0][1].device) for _, t in named]).tolist()
    for (n, _), good in zip(named, ok):
        if not good:
            raise ValueError(f"{n} holds NaN or inf")


def own_blocks(T: int, block_size: int, device: torch.device, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """long [T]: the block of each query, position // block_size, the position counted from the
    start of the query's document when cu_seqlens (int [ndocs + 1], checked) packs documents along T."""
    pos = torch.arange(T, device=device)
    if cu_seqlens is not None:
        cu = cu_seqlens.to(device=device, dtype=torch.long)
        doc = torch.searchsorted(cu, pos, right=True) - 1  # the last document starting at or before i
        pos = pos - cu[doc.clamp(0, cu.numel() - 1)]
    return pos // block_size


def check_block_idx(
    block_idx: torch.Tensor, B: int, G: int, T: int, block_size: int, device: torch.device, *, check_values: bool = True,
    cu_seqlens: torch.Tensor | None = None,
) -> int:
    """Checks block_idx int32/int64 [B, G, T, topk]; returns topk.

    With check_values (reads block_idx: one host sync on CUDA) also its values: ids in [-1,
    ceil(T / block_size)) and causal, no id after the query's own block (query i's block is
    i // block_size, counted from its document's start with cu_seqlens, which must be checked
    before).  -1 (padding) is always valid, a row or a whole selection of -1 included."""
    check_tensor("block_idx", block_idx, 4, float_only=False)
    if block_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_idx must be int32 (or int64), got {block_idx.dtype}")
    if block_idx.device != device:
        raise ValueError(f"block_idx is on {block_idx.device} but q is on {device}")
    if tuple(block_idx.shape[:3]) != (B, G, T):
        raise ValueError(f"block_idx must have shape [B={B}, G={G}, T={T}, topk], got {tuple(block_idx.shape)}")
    topk = block_idx.shape[3]
    if topk < 1:
        raise ValueError("block_idx must have topk >= 1 entries per row")
    # The value checks read block_idx (a host sync on CUDA); under torch.compile they are skipped
    # so the op stays in one graph.  The kernels ignore ids outside [0, own block] in any case.
    if check_values and block_idx.numel() and not torch.compiler.is_compiling():
        nblocks = (T + block_size - 1) // block_size
        own = own_blocks(T, block_size, device, cu_seqlens).view(1, 1, T, 1)
        late = block_idx > own  # one comparison over the selection
        lo, hi, nlate = torch.stack([block_idx.min().long(), block_idx.max().long(), late.sum()]).tolist()
        if lo < -1 or hi >= nblocks:
            raise ValueError(
                f"block_idx holds ids in [{lo}, {hi}] but valid ids are -1 (padding) and 0..{nblocks - 1} "
                f"(T={T}, block_size={block_size})"
            )
        if nlate:
            b, g, i, s = (int(x) for x in late.nonzero()[0].tolist())
            where = "its position in its document" if cu_seqlens is not None else "its position"
            raise ValueError(
                f"block_idx selects {nlate} block(s) after the query's own block, e.g. block_idx[{b}, {g}, {i}, {s}] = "
                f"{int(block_idx[b, g, i, s])} > {int(own[0, 0, i, 0])}, query {i}'s block ({where} // "
                f"block_size={block_size}): a query attends only keys j <= i (pass validate=False to skip the check)"
            )
    return topk


def check_block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    block_idx: torch.Tensor,
    block_size: int,
    softmax_scale: float | None,
    cu_seqlens: torch.Tensor | None,
    *,
    check_values: bool = True,
) -> tuple[int, int, int, int, int, float]:
    """The checks of an attention over a block selection: q [B, T, Hq, D], k (and v) [B, T, G, D],
    block_idx [B, G, T, topk] (its values with check_values: see `check_block_idx`), a positive
    block_size, softmax_scale (default 1/sqrt(D)) and the optional cu_seqlens.  Returns (B, T,
    Hq, G, D, scale)."""
    B, T, Hq, G, D = check_qkv(q, k, v)
    check_positive_int("block_size", block_size)
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, B, T, q.device)
    check_block_idx(block_idx, B, G, T, block_size, q.device, check_values=check_values, cu_seqlens=cu_seqlens)
    scale = check_scale("softmax_scale", softmax_scale, 1.0 / math.sqrt(D))
    return B, T, Hq, G, D, scale


def check_scale(name: str, value: float | None, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value != value:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return float(value)


def check_cu_seqlens(cu_seqlens: object, B: int, T: int, device: torch.device, *, name: str = "q",
                     check_values: bool = True) -> None:
    """cu_seqlens int32/int64 [ndocs + 1]: on `device`, with the tensors packed as B = 1 along T;
    with check_values also 0 first, non-decreasing and T last (reads it: a host sync on CUDA)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with ndocs + 1 >= 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be int32 (or int64), got {cu_seqlens.dtype}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but {name} is on {device}")
    if B != 1:
        raise ValueError(f"with cu_seqlens, {name} must be packed as [1, total, ...] (documents along T), got batch {B}")
    if check_values:
        c = cu_seqlens.long()
        if int(c[0]) != 0 or int(c[-1]) != T or bool((c[1:] < c[:-1]).any()):
            raise ValueError(f"cu_seqlens must start at 0, be non-decreasing and end at total={T}, got "
                             f"{cu_seqlens.tolist()[:16]}")
