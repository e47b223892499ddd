"""Selection policies: which key blocks each (batch, group, query) of a sparse layer attends.

A policy is a function ``fn(layer_idx, q, k, q_idx, k_idx, sel) -> block_idx`` over one layer's
projected tensors (after RoPE), the layouts of docs/msa.md:

    q [B, T, Hq, D]   k [B, Tk, G, D]   q_idx [B, T, G, Di] or None   k_idx [B, Tk, Di] or None
    block_idx int32 [B, G, T, K]   (-1 padded; the queries are the last T of the Tk keys)

``sel`` is the layer's selection settings (any object with ``block_size``, ``topk``,
``local_blocks`` and ``init_blocks`` attributes, e.g. ``msakit.nn.attention.MSAConfig``).  The
returned ids count blocks of ``sel.block_size`` tokens (the size the layer's sparse attention
uses); the key budget ``K`` is the policy's own (`Budget`), so one model can be evaluated at
several budgets of its block size.

Policies (all pure functions of their inputs):

- ``msa``: the model's indexer, ``ops.index_topk(q_idx, k_idx)`` with the layer's forcing;
- ``window``: the query's own block and the ``K - 1`` blocks before it (a sliding window of
  ``K * block_size`` keys);
- ``window0``: block 0, the own block and the ``K - 2`` blocks before it (same budget);
- ``oracle``: the ``K`` blocks of largest true attention mass, i.e. the block sums of
  ``softmax(scale * q_h(i) . k(j))`` over ``j <= i``, averaged over the group's query heads,
  with the layer's forced blocks kept (ties to the lower block id).  Chunked over queries so a
  32K context fits in memory.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch

from msakit import ops

__all__ = [
    "Budget",
    "Policy",
    "POLICY_NAMES",
    "make_policy",
    "msa_block_idx",
    "oracle_block_idx",
    "oracle_block_mass",
    "window_block_idx",
]

Policy = Callable[[int, torch.Tensor, torch.Tensor, "torch.Tensor | None", "torch.Tensor | None", Any], torch.Tensor]
POLICY_NAMES = ("msa", "window", "window0", "oracle")
_BUDGET_RE = re.compile(r"^block(\d+)-top(\d+)$")


@dataclass(frozen=True)
class Budget:
    """Blocks of `block_size` tokens, `topk` of them per query: `topk * block_size` keys."""

    block_size: int
    topk: int

    def __post_init__(self) -> None:
        for name in ("block_size", "topk"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"budget {name} must be a positive integer, got {v!r}")

    @classmethod
    def parse(cls, text: str) -> "Budget":
        """'block64-top8' -> Budget(64, 8)."""
        m = _BUDGET_RE.match(str(text).strip())
        if not m:
            raise ValueError(f"budget must look like 'block64-top8', got {text!r}")
        return cls(int(m.group(1)), int(m.group(2)))

    @property
    def keys(self) -> int:
        return self.block_size * self.topk

    def __str__(self) -> str:
        return f"block{self.block_size}-top{self.topk}"


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


def _check_block(block_size: int, topk: int, local_blocks: int = 1, init_blocks: int = 0) -> None:
    for name, v, lo in (("block_size", block_size, 1), ("topk", topk, 1), ("local_blocks", local_blocks, 0),
                        ("init_blocks", init_blocks, 0)):
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
    if local_blocks + init_blocks > topk:
        raise ValueError(f"topk={topk} must be >= local_blocks + init_blocks = {local_blocks} + {init_blocks}")


def _rank(score: torch.Tensor, rows: torch.Tensor, nb: int, block_size: int, topk: int,
          local_blocks: int, init_blocks: int) -> torch.Tensor:
    """score [B, G, C, nb] of the query positions `rows` [C] -> ids int32 [B, G, C, topk].

    Forced blocks first, then the other visible blocks by descending score (ties to the lower
    id), -1 padded; the index_topk ordering convention."""
    own = (rows // block_size).view(-1, 1)
    blocks = torch.arange(nb, device=score.device).view(1, -1)
    forced = ((blocks <= own) & (blocks > own - local_blocks)) | ((blocks < init_blocks) & (blocks <= own))
    score = score.masked_fill(forced, float("inf")).masked_fill(blocks > own, float("-inf"))
    order = torch.sort(score, dim=-1, descending=True, stable=True)
    kk = min(topk, nb)
    ids = order.indices[..., :kk].to(torch.int32).masked_fill(order.values[..., :kk] == float("-inf"), -1)
    if kk < topk:
        ids = torch.nn.functional.pad(ids, (0, topk - kk), value=-1)
    return ids


def window_block_idx(
    B: int, G: int, T: int, *, block_size: int, topk: int, first_block: bool = False,
    Tk: int | None = None, device: Any = None,
) -> torch.Tensor:
    """Sliding window of `topk` blocks -> int32 [B, G, T, topk].

    Query i (position ``Tk - T + i``) with own block o gets o, o - 1, ..., o - topk + 1 (those
    >= 0); with `first_block`, block 0 takes the last slot instead (o, ..., o - topk + 2 and 0).
    Rows are ascending valid ids, then -1."""
    _check_block(block_size, topk, 1, int(first_block))
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


def oracle_block_mass(
    q: torch.Tensor, k: torch.Tensor, *, block_size: int, softmax_scale: float | None = None,
    q_start: int = 0, q_end: int | None = None,
) -> torch.Tensor:
    """True attention mass per key block -> float32 [B, G, q_end - q_start, nb].

    mass(r, i, b) = mean over the heads h of group r of sum_{j in block b, j <= i}
    softmax_j(scale * q_h(i) . k_r(j)), for the query rows q_start .. q_end - 1 of q (positions
    Tk - T + i), over the causal prefix only; nb = number of blocks of Tk keys."""
    B, T, Tk, Hq, G = _check_qk(q, k)
    q_end = T if q_end is None else q_end
    if not (0 <= q_start < q_end <= T):
        raise ValueError(f"query rows [{q_start}, {q_end}) must lie in [0, {T})")
    D = q.shape[-1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    off = Tk - T
    hpg = Hq // G
    nb = (Tk + block_size - 1) // block_size
    jmax = off + q_end  # keys any of these rows can see
    C = q_end - q_start
    qc = q[:, q_start:q_end].to(cdt).view(B, C, G, hpg, D)
    kc = k[:, :jmax].to(cdt)
    s = torch.einsum("bcghd,bjgd->bghcj", qc, kc) * scale
    rows = torch.arange(off + q_start, off + q_end, device=q.device).view(-1, 1)
    cols = torch.arange(jmax, device=q.device).view(1, -1)
    p = torch.softmax(s.masked_fill(cols > rows, float("-inf")), dim=-1).mean(dim=2)  # [B, G, C, jmax]
    pad = nb * block_size - jmax
    if pad:
        p = torch.nn.functional.pad(p, (0, pad))
    return p.view(B, G, C, nb, block_size).sum(-1).float()


def oracle_block_idx(
    q: torch.Tensor, k: torch.Tensor, *, block_size: int, topk: int, local_blocks: int = 1, init_blocks: int = 0,
    softmax_scale: float | None = None, max_elements: int = 1 << 26,
) -> torch.Tensor:
    """Oracle selection: forced blocks, then the blocks of largest `oracle_block_mass` ->
    int32 [B, G, T, topk].  Queries are chunked so one chunk's scores hold at most
    `max_elements` values (the memory bound: about 4 bytes times that, a few times over)."""
    B, T, Tk, Hq, G = _check_qk(q, k)
    _check_block(block_size, topk, local_blocks, init_blocks)
    if max_elements < 1:
        raise ValueError(f"max_elements must be >= 1, got {max_elements}")
    off = Tk - T
    out = torch.full((B, G, T, topk), -1, dtype=torch.int32, device=q.device)
    C = max(1, min(T, max_elements // max(1, B * Hq * Tk)))
    for i0 in range(0, T, C):
        i1 = min(T, i0 + C)
        mass = oracle_block_mass(q, k, block_size=block_size, softmax_scale=softmax_scale, q_start=i0, q_end=i1)
        rows = torch.arange(off + i0, off + i1, device=q.device)
        nbc = int((off + i1 - 1) // block_size) + 1
        out[:, :, i0:i1] = _rank(mass[..., :nbc], rows, nbc, block_size, topk, local_blocks, init_blocks)
    return out


def msa_block_idx(q_idx: torch.Tensor, k_idx: torch.Tensor, *, block_size: int, topk: int,
                  local_blocks: int = 1, init_blocks: int = 0) -> torch.Tensor:
    """The MSA indexer's selection: `ops.index_topk` (no gradient) -> int32 [B, G, T, topk]."""
    if q_idx is None or k_idx is None:
        raise ValueError("the msa policy needs the layer's index tensors q_idx and k_idx (a layer with an index branch)")
    with torch.no_grad():
        return ops.index_topk(q_idx, k_idx, block_size=block_size, topk=topk, local_blocks=local_blocks,
                              init_blocks=init_blocks)


def _sel(sel: Any, name: str, default: int | None = None) -> int:
    v = sel.get(name, default) if isinstance(sel, dict) else getattr(sel, name, default)
    if v is None:
        raise ValueError(f"sel must give {name} (an MSAConfig or a dict with block_size, topk, local_blocks, init_blocks)")
    return int(v)


def make_policy(name: str, budget: Budget, *, softmax_scale: float | None = None,
                max_elements: int = 1 << 26) -> Policy:
    """The policy `name` (one of POLICY_NAMES) at `budget`, as ``fn(layer_idx, q, k, q_idx, k_idx, sel)``.

    The layer's ``sel.block_size`` must equal ``budget.block_size`` (block ids are counted in the
    layer's blocks); ``msa`` and ``oracle`` keep the layer's ``local_blocks`` / ``init_blocks``."""
    if name not in POLICY_NAMES:
        raise ValueError(f"policy must be one of {POLICY_NAMES}, got {name!r}")
    if not isinstance(budget, Budget):
        raise ValueError(f"budget must be a Budget, got {type(budget).__name__}")

    def policy(layer_idx: int, q, k, q_idx, k_idx, sel) -> torch.Tensor:
        bs = _sel(sel, "block_size")
        if bs != budget.block_size:
            raise ValueError(f"layer {layer_idx} uses block_size {bs} but the budget is {budget}: convert the model "
                             f"with block size {budget.block_size} or pick a budget of block {bs}")
        local, init = _sel(sel, "local_blocks", 1), _sel(sel, "init_blocks", 0)
        if name == "msa":
            return msa_block_idx(q_idx, k_idx, block_size=bs, topk=budget.topk, local_blocks=local, init_blocks=init)
        if name == "oracle":
            with torch.no_grad():
                return oracle_block_idx(q, k, block_size=bs, topk=budget.topk, local_blocks=local, init_blocks=init,
                                        softmax_scale=softmax_scale, max_elements=max_elements)
        B, T, Tk, _, G = _check_qk(q, k)
        return window_block_idx(B, G, T, block_size=bs, topk=budget.topk, first_block=name == "window0", Tk=Tk,
                                device=q.device)

    policy.__name__ = f"{name}_policy"
    policy.__qualname__ = policy.__name__
    return policy
