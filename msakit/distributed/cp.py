"""Context parallelism for MSA: the sequence is split over the ranks of a `cp` process group.

Layout (causal load balancing).  The sequence of T tokens is padded to Tp, a multiple of
``block_size * 2 * cp``, and cut into ``2 * cp`` chunks of ``c = Tp / (2 cp)`` tokens; rank r
holds chunks r and 2 cp - 1 - r (its "local" tokens, 2c of them, in that order).  A chunk
late in the sequence scores more keys than an early one (index scoring is causal-quadratic),
so pairing chunk r with chunk 2 cp - 1 - r gives every rank the same amount of scoring work.
Padding tokens sit after every real token: causally no real query sees them, and they are
left out of the outputs' meaning (zero rows, -1 selections) and of the KL.

Per layer (`ContextParallel.attend`, with the signature of the attention core, `msakit.nn.core.attend`):

1. the key side (k, v and the index keys k_idx) of every rank is all-gathered into the whole
   padded sequence; k_idx first, k and v asynchronously, so that their transfer overlaps the
   index scoring, which needs only k_idx;
2. the rank's queries select at their GLOBAL positions: a local chunk [s, e) (cut at document
   boundaries for packed batches) is a query range whose keys are [doc start, e), and the
   attention core (`msakit.nn.core.attend`) runs it as queries at the end of held keys: the
   kernels when the queries start where the keys start, the references otherwise;
3. backward (`CPAttentionFunction`) re-gathers the key side instead of keeping the gathered
   buffers (the gather is checkpointed), recomputes the local attention with autograd, and
   reduce-scatters dk, dv and dk_idx back to the ranks that own those tokens.

Selections and outputs equal the single-process ones row by row; the KL returned by each rank
is its share of the global mean (the shares sum to the single-process KL).

The LM loss under CP: `msakit.distributed.step.next_token_targets` shifts the labels over the whole
sequence before sharding (the target of a chunk's last token is the next chunk's first token).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist

from msakit.cache.base import HeldKeys
from msakit.models.interface import document_segments
from msakit.nn.core import attend as core_attend
from msakit.nn.core import select as core_select
from msakit.ops.index_topk import Selection

__all__ = [
    "ChunkLayout",
    "chunk_layout",
    "CommStats",
    "ContextParallel",
    "CPAttentionFunction",
    "GatherSequence",
    "cp_msa_attention",
    "comm_bytes_per_layer",
    "IGNORE_INDEX",
]

IGNORE_INDEX = -100


# ---------------------------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChunkLayout:
    """Where the tokens of a sequence of `seq_len` live on `cp` ranks (see the module docstring)."""

    seq_len: int  # real tokens T
    cp: int  # ranks in the context-parallel group
    rank: int  # this rank in that group
    chunk: int  # tokens per chunk c (a multiple of the block size)

    @property
    def padded_len(self) -> int:
        return 2 * self.cp * self.chunk

    @property
    def local_len(self) -> int:
        return 2 * self.chunk

    def chunk_ids(self, rank: int | None = None) -> tuple[int, int]:
        r = self.rank if rank is None else rank
        return r, 2 * self.cp - 1 - r

    def spans(self, rank: int | None = None) -> list[tuple[int, int, int]]:
        """[(local offset, global start, global end)] of the rank's tokens, contiguous spans merged."""
        out: list[tuple[int, int, int]] = []
        for j, cid in enumerate(self.chunk_ids(rank)):
            s, e = cid * self.chunk, (cid + 1) * self.chunk
            if out and out[-1][2] == s:
                off, s0, _ = out[-1]
                out[-1] = (off, s0, e)
            else:
                out.append((j * self.chunk, s, e))
        return out

    def positions(self, rank: int | None = None, device: torch.device | str | None = None) -> torch.Tensor:
        """Global positions (int64 [2c]) of the rank's tokens, in local order."""
        return torch.cat([torch.arange(s, e, device=device) for _, s, e in self.spans(rank)])

    def rank_order(self, device: torch.device | str | None = None) -> torch.Tensor:
        """int64 [Tp]: global positions in rank-major order (what an all-gather of local tokens holds)."""
        return torch.cat([self.positions(r, device) for r in range(self.cp)])


def chunk_layout(seq_len: int, cp: int, rank: int, block_size: int) -> ChunkLayout:
    """The layout of `seq_len` tokens on `cp` ranks: chunks of a multiple of `block_size` tokens,
    the sequence padded to a multiple of ``block_size * 2 * cp``."""
    for name, v in (("seq_len", seq_len), ("cp", cp), ("block_size", block_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if not isinstance(rank, int) or not 0 <= rank < cp:
        raise ValueError(f"rank must be in [0, cp={cp}), got {rank!r}")
    unit = block_size * 2 * cp
    padded = -(-seq_len // unit) * unit
    return ChunkLayout(seq_len=seq_len, cp=cp, rank=rank, chunk=padded // (2 * cp))


def comm_bytes_per_layer(tokens: int, cp: int, *, groups: int, head_dim: int, index_dim: int | None,
                         kv_bytes: int = 2, index_bytes: int = 2) -> dict[str, float]:
    """Bytes each rank receives per layer for `tokens` padded tokens: forward all-gather of
    k, v (and k_idx), the backward re-gather, and the reduce-scatter of their gradients (float32).

    Per token of the key side: 2 * groups * head_dim * kv_bytes + index_dim * index_bytes
    (M3 in bf16: 2 * 4 * 128 * 2 + 128 * 2 = 2304 bytes = 2.25 KiB)."""
    per_token = 2 * groups * head_dim * kv_bytes + (index_dim or 0) * index_bytes
    grad_per_token = 4 * (2 * groups * head_dim + (index_dim or 0))
    remote = tokens * (cp - 1) / cp  # tokens held by the other ranks
    fwd = remote * per_token
    rs = remote * grad_per_token
    return {"bytes_per_token": float(per_token), "forward_all_gather": fwd, "backward_all_gather": fwd,
            "backward_reduce_scatter": rs, "total": 2 * fwd + rs}


@dataclass
class CommStats:
    """Bytes moved by this rank's context-parallel collectives (received per rank), by kind."""

    all_gather: int = 0
    reduce_scatter: int = 0
    calls: int = 0
    per_layer: list[int] = field(default_factory=list)  # forward all-gather bytes of each attend call

    def reset(self) -> None:
        self.all_gather = self.reduce_scatter = self.calls = 0
        self.per_layer.clear()

    def as_dict(self) -> dict[str, Any]:
        return {"all_gather_bytes": self.all_gather, "reduce_scatter_bytes": self.reduce_scatter, "calls": self.calls}


# ---------------------------------------------------------------------------------------------
# Collectives along the sequence
# ---------------------------------------------------------------------------------------------


def _all_gather_into(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def _reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, op=dist.ReduceOp.SUM, group=group)


class _Pending:
    """An all-gather in flight: `wait()` returns the whole sequence [B, Tp, ...] in global order."""

    def __init__(self, x: torch.Tensor, cp: "ContextParallel") -> None:
        self.cp = cp
        if cp.size == 1:
            self.buf, self.work = x, None
            return
        xt = x.movedim(1, 0).contiguous()  # [L, B, ...]
        self.buf = xt.new_empty((cp.size * xt.shape[0],) + tuple(xt.shape[1:]))
        self.work = _all_gather_into(self.buf, xt, cp.group, async_op=True)
        cp.stats.all_gather += (cp.size - 1) * xt.numel() * xt.element_size()

    def wait(self) -> torch.Tensor:
        if self.work is None:
            return self.buf
        self.work.wait()
        buf, self.buf = self.buf, None  # the rank-major buffer is freed once reordered
        return buf.index_select(0, self.cp.inverse_order(buf.device)).movedim(0, 1)


def _scatter_grad(g: torch.Tensor, cp: "ContextParallel") -> torch.Tensor:
    """g [B, Tp, ...] (this rank's gradient for every token) -> [B, L, ...] summed over the ranks
    (in float32, as FSDP reduces: bf16 sums of cp partial gradients would lose bits)."""
    if cp.size == 1:
        return g
    gt = g.movedim(1, 0).index_select(0, cp.rank_order(g.device)).float().contiguous()  # rank-major
    out = gt.new_empty((cp.layout.local_len,) + tuple(gt.shape[1:]))
    _reduce_scatter_into(out, gt, cp.group)
    cp.stats.reduce_scatter += (cp.size - 1) * out.numel() * out.element_size()
    return out.movedim(0, 1).to(g.dtype)


class GatherSequence(torch.autograd.Function):
    """x [B, L, ...] (local tokens) -> [B, Tp, ...] (all tokens, global order); the backward
    reduce-scatters the gradient.  A building block for layers outside MSA."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cp: "ContextParallel") -> torch.Tensor:  # type: ignore[override]
        ctx.cp = cp
        return _Pending(x, cp).wait()

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        return _scatter_grad(g.contiguous(), ctx.cp), None


# ---------------------------------------------------------------------------------------------
# The local attention of a rank
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Piece:
    lo: int  # offset of the queries in the local buffer
    qs: int  # global query range [qs, qe)
    qe: int
    ks: int  # keys [ks, qe): ks is the start of the queries' document

    @property
    def n(self) -> int:
        return self.qe - self.qs


@dataclass(frozen=True)
class _Settings:
    sel: Selection
    mode: str
    compute_kl: bool
    select: bool
    scale: float | None


def _select(qi: torch.Tensor, ki: torch.Tensor, st: _Settings) -> torch.Tensor:
    return core_select(qi, ki, st.sel)


def _attend(q, kf, vf, qi, kif, p: _Piece, bi, st: _Settings):
    """(o [B, n, Hq, D], KL mean over the piece's rows or None) of one query piece: the core over
    the piece's keys [ks, qe), the queries at their end, on the selection made beforehand."""
    qs = slice(p.lo, p.lo + p.n)
    keys = HeldKeys(kf[:, p.ks:p.qe], vf[:, p.ks:p.qe], None if kif is None else kif[:, p.ks:p.qe])
    o, kl, _ = core_attend(q[:, qs], None if qi is None else qi[:, qs], keys, st.sel,
                           mode=st.mode if bi is not None else "dense", compute_kl=st.compute_kl and bi is not None,
                           softmax_scale=st.scale, block_idx=bi)
    return o, kl


def _local_outputs(q, kf, vf, qi, kif, pieces: Sequence[_Piece], bis, st: _Settings, total: int):
    """Assemble the rank's o [B, L, Hq, D] (zero rows for padding) and its KL share."""
    B, L = q.shape[:2]
    parts: list[torch.Tensor] = []
    kl = None
    at = 0
    for p, bi in zip(pieces, bis):
        if p.lo > at:
            parts.append(q.new_zeros((B, p.lo - at) + tuple(q.shape[2:])))
        o, term = _attend(q, kf, vf, qi, kif, p, bi, st)
        parts.append(o.to(q.dtype))
        at = p.lo + p.n
        if term is not None:
            term = term.float() * (p.n / total)
            kl = term if kl is None else kl + term
    if at < L:
        parts.append(q.new_zeros((B, L - at) + tuple(q.shape[2:])))
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)), kl


class CPAttentionFunction(torch.autograd.Function):
    """The rank's attention with the key side gathered in forward and re-gathered in backward."""

    @staticmethod
    def forward(ctx, q, k, v, q_idx, k_idx, cp: "ContextParallel", st: _Settings):  # type: ignore[override]
        pieces = cp.pieces()
        B, L = q.shape[:2]
        G = k.shape[2]
        # every rank issues the same collectives in the same order, whatever its share of real tokens
        pend_ki = _Pending(k_idx, cp) if st.select else None
        pend_k, pend_v = _Pending(k, cp), _Pending(v, cp)  # in flight during the index scoring
        bis: list[torch.Tensor | None] = [None] * len(pieces)
        block_idx = kif = None
        if pend_ki is not None:
            kif = pend_ki.wait()
            with torch.no_grad():
                bis = [_select(q_idx[:, p.lo:p.lo + p.n], kif[:, p.ks:p.qe], st) for p in pieces]
            block_idx = _assemble_selection(pieces, bis, B, G, L, st.sel.topk, q.device)
        kf, vf = pend_k.wait(), pend_v.wait()
        with torch.no_grad():
            o, kl = _local_outputs(q, kf, vf, q_idx, kif, pieces, bis, st, cp.layout.seq_len)
        cp.stats.calls += 1
        ctx.cp, ctx.st, ctx.pieces, ctx.bis = cp, st, pieces, bis
        ctx.save_for_backward(q, k, v, q_idx, k_idx)
        if kl is None:
            kl = q.new_zeros((), dtype=torch.float32)
        return o, kl, block_idx

    @staticmethod
    def backward(ctx, do, dkl, _dbi):  # type: ignore[override]
        q, k, v, q_idx, k_idx = ctx.saved_tensors
        cp, st = ctx.cp, ctx.st
        pend_ki = _Pending(k_idx.detach(), cp) if st.compute_kl else None
        pend_k, pend_v = _Pending(k.detach(), cp), _Pending(v.detach(), cp)
        with torch.enable_grad():
            qd = q.detach().requires_grad_(ctx.needs_input_grad[0])
            kf = pend_k.wait().detach().requires_grad_(ctx.needs_input_grad[1])
            vf = pend_v.wait().detach().requires_grad_(ctx.needs_input_grad[2])
            qid = kif = None
            if pend_ki is not None:
                qid = q_idx.detach().requires_grad_(ctx.needs_input_grad[3])
                kif = pend_ki.wait().detach().requires_grad_(ctx.needs_input_grad[4])
            o, kl = _local_outputs(qd, kf, vf, qid, kif, ctx.pieces, ctx.bis, st, cp.layout.seq_len)
            outs, grads = [], []
            if do is not None and o.requires_grad:
                outs.append(o)
                grads.append(do)
            if kl is not None and dkl is not None and kl.requires_grad:
                outs.append(kl)
                grads.append(dkl)
            inputs = [t for t in (qd, kf, vf, qid, kif) if t is not None and t.requires_grad]
            got = torch.autograd.grad(outs, inputs, grads, allow_unused=True) if outs and inputs else []
        gmap = {id(t): g for t, g in zip(inputs, got)}

        def grad_of(t, full: bool, like: torch.Tensor | None):
            if t is None or like is None:
                return None
            g = gmap.get(id(t))
            if g is None:
                g = torch.zeros_like(t)
            return _scatter_grad(g.contiguous(), cp) if full else g

        dq = grad_of(qd, False, q) if ctx.needs_input_grad[0] else None
        dk = grad_of(kf, True, k) if ctx.needs_input_grad[1] else None
        dv = grad_of(vf, True, v) if ctx.needs_input_grad[2] else None
        dqi = grad_of(qid, False, q_idx) if ctx.needs_input_grad[3] else None
        dki = None
        if ctx.needs_input_grad[4]:
            dki = grad_of(kif, True, k_idx) if kif is not None else torch.zeros_like(k_idx)
        return dq, dk, dv, dqi, dki, None, None


# ---------------------------------------------------------------------------------------------
# The context object a model forward takes
# ---------------------------------------------------------------------------------------------


class ContextParallel:
    """Context-parallel state of one forward over a sequence of `seq_len` tokens.

    group: the cp process group (None: the default group; a world size of 1 runs without
    collectives); block_size: the MSA block size (chunks are multiples of it); cu_seqlens:
    int32 [ndocs + 1] over the GLOBAL sequence for a packed batch (B = 1), documents may cross
    chunk boundaries.  `attend` has the signature of the attention core (`msakit.nn.core.attend`)
    and is what the model's layer calls instead of it (see docs/distributed.md for the hook).
    """

    def __init__(self, group: Any, seq_len: int, block_size: int, *,
                 cu_seqlens: torch.Tensor | Sequence[int] | None = None, batch_size: int = 1) -> None:
        if group is None and not dist.is_initialized():
            self.size, self.rank = 1, 0
        else:
            self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.group = group
        self.layout = chunk_layout(seq_len, self.size, self.rank, block_size)
        self.segments = document_segments(cu_seqlens, batch_size, seq_len)
        self.stats = CommStats()
        self._orders: dict[tuple[str, Any], tuple[torch.Tensor, torch.Tensor]] = {}
        self._pieces = self._make_pieces()

    # -- layout helpers -------------------------------------------------------------------------
    def _order(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (device.type, device.index)
        if key not in self._orders:
            order = self.layout.rank_order(device)
            self._orders[key] = (order, torch.argsort(order))
        return self._orders[key]

    def rank_order(self, device: torch.device) -> torch.Tensor:
        return self._order(device)[0]

    def inverse_order(self, device: torch.device) -> torch.Tensor:
        return self._order(device)[1]

    def _make_pieces(self) -> list[_Piece]:
        T = self.layout.seq_len
        out = []
        for off, s, e in self.layout.spans():
            e = min(e, T)
            for ds, de in self.segments:
                qs, qe = max(s, ds), min(e, de)
                if qe > qs:
                    out.append(_Piece(lo=off + qs - s, qs=qs, qe=qe, ks=ds))
        return out

    def pieces(self) -> list[_Piece]:
        return self._pieces

    @property
    def local_len(self) -> int:
        return self.layout.local_len

    def shard(self, x: torch.Tensor, dim: int = 1, pad_value: float | int = 0) -> torch.Tensor:
        """The rank's tokens of a whole-sequence tensor x (T along `dim`), padded as the layout says."""
        T, Tp = self.layout.seq_len, self.layout.padded_len
        if x.shape[dim] != T:
            raise ValueError(f"x must have seq_len={T} entries along dim {dim}, got {tuple(x.shape)}")
        if Tp > T:
            shape = list(x.shape)
            shape[dim] = Tp - T
            x = torch.cat([x, x.new_full(shape, pad_value)], dim=dim)
        return x.index_select(dim, self.layout.positions(device=x.device))

    def unshard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """All ranks' local tensors (no gradient) -> the whole sequence along `dim`, padding cut off."""
        xm = x.detach().movedim(dim, 1)
        full = _Pending(xm, self).wait()[:, :self.layout.seq_len]
        return full.movedim(1, dim)

    def positions(self, device: torch.device | str | None = None) -> torch.Tensor:
        """RoPE positions [1, L] of the local tokens: global, restarting at each document start."""
        pos = torch.arange(self.layout.padded_len, device=device)
        for s, e in self.segments:
            pos[s:e] -= s
        return pos.index_select(0, self.layout.positions(device=device)).unsqueeze(0)

    # -- the layer hook -------------------------------------------------------------------------
    def attend(self, q, q_idx, keys: HeldKeys, sel: Selection, *, mode: str, compute_kl: bool = False,
               kl_tokens: str = "selected", need_block_idx: bool = False, segments: Any = None,
               softmax_scale: float | None = None, block_idx: Any = None):
        """Drop-in for the attention core on the rank's local tokens: q [B, L, Hq, D], q_idx
        [B, L, G, Di] or None, keys the local HeldKeys (k/v [B, L, G, D], k_idx [B, L, Di] or None)
        -> (o [B, L, Hq, D], KL share or None, block_idx [B, G, L, K] or None).  `segments` is
        ignored (the context holds the documents); selections are the indexer's at global
        positions (`block_idx` overrides are refused); the KL is over the selected tokens
        (kl_tokens "all" is refused)."""
        if compute_kl and kl_tokens != "selected":
            raise ValueError("context parallelism computes the KL over the selected tokens: kl_tokens='all' "
                             "is not supported with --cp")
        if block_idx is not None:
            raise ValueError("context parallelism selects with the indexer: selection policies are not supported")
        return cp_msa_attention(q, keys.k, keys.v, q_idx, keys.k_idx, self, sel=sel, mode=mode,
                                compute_kl=compute_kl, need_block_idx=need_block_idx, softmax_scale=softmax_scale)


def cp_msa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_idx: torch.Tensor | None,
    k_idx: torch.Tensor | None,
    cp: ContextParallel,
    *,
    sel: Selection = Selection(),
    mode: str = "sparse",
    compute_kl: bool = True,
    need_block_idx: bool = False,
    softmax_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """MSA of the rank's local queries over the whole (gathered) key side.

    q [B, L, Hq, D], k, v [B, L, G, D], q_idx [B, L, G, Di], k_idx [B, L, Di] (L = cp.local_len,
    the rank's tokens in `cp.layout` order; q_idx / k_idx None for a dense layer).  mode
    "sparse" attends the indexer's top-k blocks, "dense" all causal keys (the indexer still
    selects when the KL is wanted).  Returns (o [B, L, Hq, D] with zero padding rows, this
    rank's share of the KL (None when not computed), block_idx int32 [B, G, L, topk] with -1
    padding rows (None when no selection was made)).  Differentiable in q, k, v, q_idx, k_idx.
    """
    if not isinstance(cp, ContextParallel):
        raise ValueError(f"cp must be a ContextParallel, got {type(cp).__name__}")
    if mode not in ("sparse", "dense"):
        raise ValueError(f"mode must be 'sparse' or 'dense', got {mode!r}")
    L = cp.local_len
    for name, t, nd in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("q_idx", q_idx, 4), ("k_idx", k_idx, 3)):
        if t is None and name in ("q_idx", "k_idx"):
            continue
        if not isinstance(t, torch.Tensor) or t.dim() != nd or t.shape[1] != L:
            raise ValueError(f"{name} must be a {nd}-D tensor with the rank's {L} local tokens in dim 1, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if (q_idx is None) != (k_idx is None):
        raise ValueError("q_idx and k_idx must both be given or both be None")
    if not isinstance(sel, Selection):
        raise ValueError(f"sel must be a Selection, got {type(sel).__name__}")
    if cp.layout.chunk % sel.block_size:
        raise ValueError(f"the layout's chunk of {cp.layout.chunk} tokens is not a multiple of "
                         f"block_size={sel.block_size}")
    has_index = q_idx is not None
    select = has_index and (mode == "sparse" or compute_kl or need_block_idx)
    st = _Settings(sel=sel, mode=mode if has_index else "dense", compute_kl=compute_kl and has_index, select=select,
                   scale=softmax_scale)
    if cp.size == 1:  # nothing to gather: the plain ops under autograd, no recomputation
        o, kl, block_idx = _single_rank(q, k, v, q_idx, k_idx, cp, st)
        cp.stats.per_layer.append(0)
        return o, kl, block_idx
    before = cp.stats.all_gather
    o, kl, block_idx = CPAttentionFunction.apply(q, k, v, q_idx, k_idx, cp, st)
    cp.stats.per_layer.append(cp.stats.all_gather - before)
    return o, (kl if st.compute_kl else None), block_idx


def _single_rank(q, k, v, q_idx, k_idx, cp: ContextParallel, st: _Settings):
    pieces = cp.pieces()
    bis: list[torch.Tensor | None] = [None] * len(pieces)
    block_idx = None
    if st.select:
        with torch.no_grad():
            bis = [_select(q_idx[:, p.lo:p.lo + p.n], k_idx[:, p.ks:p.qe], st) for p in pieces]
        block_idx = _assemble_selection(pieces, bis, q.shape[0], k.shape[2], q.shape[1], st.sel.topk, q.device)
    o, kl = _local_outputs(q, k, v, q_idx, k_idx, pieces, bis, st, cp.layout.seq_len)
    return o, kl, block_idx


def _assemble_selection(pieces, bis, B: int, G: int, L: int, topk: int, device) -> torch.Tensor:
    block_idx = torch.full((B, G, L, topk), -1, dtype=torch.int32, device=device)
    for p, bi in zip(pieces, bis):
        block_idx[:, :, p.lo:p.lo + p.n] = bi
    return block_idx
