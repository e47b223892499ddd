"""`MSAAttention`: GQA attention with MiniMax Sparse Attention's index branch.

Data flow of one layer (training):

    hidden ──q/k/v_proj──> q [B,T,Hq,D], k, v [B,T,G,D] ──q/k_norm, partial RoPE──┐
    hidden.detach() ──index_q/k_proj──> q_idx [B,T,G,Di], k_idx [B,T,Di] ──norm, RoPE──> index_topk
                                                                             │ block_idx [B,G,T,K]
    mode "sparse": o = sparse_attention(q, k, v, block_idx)        <────────┘
    mode "dense":  o = dense causal attention (the warm-up / conversion mode)
    kl = index_kl_loss(q, k, q_idx, k_idx, block_idx)  (P detached; grads reach the index branch only)

In dense mode the indexer still learns: it selects blocks with its own top-k and the KL is taken
over those selected tokens, exactly as in sparse mode (or over every causal token with the
config's `kl_tokens="all"`); only the main branch's output ignores the selection.  This is the seed's full-attention warm-up.  The index branch reads `hidden.detach()`
(the seed's stop-gradient on the indexer's input), and P is detached inside `index_kl_loss`, so
the KL term never reaches the backbone.

Decoding uses the same module with a cache (`msakit.cache.KVCacheProtocol`): the new positions'
k, v and index keys are written into it, and the cache attends (dense, or MSA: the indexer's top-k
blocks over every held index key) -- contiguous, paged (`msa_decode`) and speculative caches alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from msakit import ops
from msakit.ops.index_topk.reference import index_topk_reference
from msakit.ops.sparse_attention.reference import sparse_attention_reference
from msakit.nn.norm import GemmaRMSNorm
from msakit.nn.rope import apply_partial_rope, rope_cos_sin

if TYPE_CHECKING:
    from msakit.cache.base import KVCacheProtocol

MODES = ("dense", "sparse")
KL_TOKENS = ("selected", "all")
# the index branch's modules under an attention module (HF MiniMax-M3 names)
INDEX_MODULES = ("index_q_proj", "index_k_proj", "index_q_norm", "index_k_norm")


@dataclass
class MSAConfig:
    """Shape and selection settings of one MSA layer (HF MiniMax-M3 names in comments)."""

    hidden_size: int
    num_heads: int  # num_attention_heads
    num_kv_heads: int  # num_key_value_heads (= groups G = index heads)
    head_dim: int = 128
    index_dim: int = 128  # sparse_index_dim
    rotary_dim: int = 64
    rope_theta: float = 1e7
    rms_norm_eps: float = 1e-6
    block_size: int = 128  # sparse_block_size
    topk: int = 16  # sparse_topk_blocks
    local_blocks: int = 1  # sparse_local_block
    init_blocks: int = 0  # sparse_init_block
    kl_tokens: str = "selected"  # the KL over the selected tokens or over "all" causal tokens

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "index_dim", "block_size", "topk"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if not (0 <= self.rotary_dim <= min(self.head_dim, self.index_dim)) or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim={self.rotary_dim} must be even and <= head_dim and index_dim")
        from msakit.ops.index_topk import check_selection

        check_selection(self.block_size, self.topk, self.local_blocks, self.init_blocks)
        if self.kl_tokens not in KL_TOKENS:
            raise ValueError(f"kl_tokens must be one of {KL_TOKENS}, got {self.kl_tokens!r}")



def msa_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_idx: torch.Tensor | None,
    k_idx: torch.Tensor | None,
    sel: MSAConfig,
    *,
    mode: str,
    compute_kl: bool,
    need_block_idx: bool = False,
    segments: Sequence[tuple[int, int]] | None = None,
    softmax_scale: float | None = None,
    select: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One layer's attention core on projected tensors (full sequences: training, prefill; or the
    last T of Tk held positions: a cache's later steps).

    q [B,T,Hq,D], k/v [B,Tk,G,D], q_idx [B,T,G,Di] / k_idx [B,Tk,Di] (None: a dense layer without an
    index branch).  With Tk > T (no KL, no block ids, no packing): sparse mode with an index branch
    selects with the indexer's reference over every held index key and attends those blocks (the
    reference ops take T < Tk); otherwise every key with a bottom-right causal mask (SDPA).

    Returns (o [B,T,Hq,D], KL term or None, block_idx [B,G,T,K] or None).  The selection
    (`select(q_idx, k_idx)`, default `ops.index_topk` with sel's settings) is made when the mode
    is "sparse", the KL is wanted (over the selected tokens) or `need_block_idx`; per document
    when `segments` has several entries (KL averaged over all query rows).
    """
    T, Tk = q.shape[1], k.shape[1]
    if T != Tk:  # the queries of the last T of Tk held positions (a cache's later steps)
        if T > Tk or compute_kl or need_block_idx or (segments is not None and len(segments) > 1):
            raise ValueError(f"{T} queries over {Tk} keys: the queries must be the last positions, without "
                             "KL, block ids or packed documents")
        scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
        if mode == "sparse" and q_idx is not None:
            bi = index_topk_reference(q_idx, k_idx, block_size=sel.block_size, topk=sel.topk,
                                      local_blocks=sel.local_blocks, init_blocks=sel.init_blocks)
            return sparse_attention_reference(q, k, v, bi, block_size=sel.block_size, softmax_scale=scale), None, None
        rep = q.shape[2] // k.shape[2]
        qh = q.transpose(1, 2)
        kh = k.transpose(1, 2).repeat_interleave(rep, dim=1)
        vh = v.transpose(1, 2).repeat_interleave(rep, dim=1)
        rows = torch.arange(Tk - T, Tk, device=q.device).view(-1, 1)
        mask = torch.arange(Tk, device=q.device).view(1, -1) <= rows  # bottom-right causal
        o = F.scaled_dot_product_attention(qh, kh.to(qh.dtype), vh.to(qh.dtype), attn_mask=mask, scale=scale)
        return o.transpose(1, 2), None, None
    segments = segments or [(0, T)]
    has_index = q_idx is not None
    kl_all = sel.kl_tokens == "all"
    do_select = has_index and (mode == "sparse" or (compute_kl and not kl_all) or need_block_idx)
    if select is None:
        def select(qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return ops.index_topk(qi, ki, block_size=sel.block_size, topk=sel.topk,
                                      local_blocks=sel.local_blocks, init_blocks=sel.init_blocks)
    outs, bidxs = [], []
    kl = None
    for s, e in segments:
        whole = (s, e) == (0, T)
        qs, ks, vs = (q, k, v) if whole else (q[:, s:e], k[:, s:e], v[:, s:e])
        bi = None
        if do_select:
            qis, kis = (q_idx, k_idx) if whole else (q_idx[:, s:e], k_idx[:, s:e])
            bi = select(qis, kis)
            bidxs.append(bi)
        if mode == "sparse" and bi is not None:
            o = ops.sparse_attention(qs, ks, vs, bi, block_size=sel.block_size, softmax_scale=softmax_scale)
        else:
            o = ops.dense_attention(qs, ks, vs, softmax_scale=softmax_scale)
        outs.append(o)
        if compute_kl and has_index:
            if not do_select:
                qis, kis = (q_idx, k_idx) if whole else (q_idx[:, s:e], k_idx[:, s:e])
            term = ops.index_kl_loss(qs, ks, qis, kis, bi, block_size=sel.block_size, softmax_scale=softmax_scale,
                                     over=sel.kl_tokens)
            term = term if whole else term * ((e - s) / T)
            kl = term if kl is None else kl + term
    o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    block_idx = None
    if bidxs:
        block_idx = bidxs[0] if len(bidxs) == 1 else torch.cat(bidxs, dim=2)
    return o, kl, block_idx


def selection_info(sel: MSAConfig, segments: Sequence[tuple[int, int]] | None) -> dict[str, Any]:
    """The selection settings stored beside each layer's attn_inputs (block ids are relative to
    each document's start when the batch was packed: `cu_seqlens` is then given too)."""
    info: dict[str, Any] = dict(block_size=sel.block_size, topk=sel.topk, local_blocks=sel.local_blocks,
                                init_blocks=sel.init_blocks)
    if segments is not None and len(segments) > 1:
        info["cu_seqlens"] = torch.tensor([0] + [e for _, e in segments], dtype=torch.int32)
    return info


class GQAProjections(nn.Module):
    """The projections of a GQA attention layer (HF names): q_proj [H -> Hq * D], k_proj and
    v_proj [H -> G * D], o_proj [Hq * D -> H], and the per-head q_norm / k_norm (RMSNorm over D).
    Attention layers that keep these names subclass it."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        H, Hq, G, D = hidden_size, num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(H, Hq * D, bias=False)
        self.k_proj = nn.Linear(H, G * D, bias=False)
        self.v_proj = nn.Linear(H, G * D, bias=False)
        self.o_proj = nn.Linear(Hq * D, H, bias=False)
        self.q_norm = GemmaRMSNorm(D, eps)
        self.k_norm = GemmaRMSNorm(D, eps)


class MSAAttention(GQAProjections):
    """MSA attention layer: project, attend (no cache: the whole sequence; with a cache: the new
    positions over what the cache holds), o_proj.  `forward(hidden [B,T,H], positions, cache=None)
    -> (out [B,T,H], kl scalar or None, attention inputs or None)`.

    Parameter names follow the HF MiniMax-M3 checkpoint (under `self_attn.`): q_proj, k_proj,
    v_proj, o_proj, q_norm, k_norm, index_q_proj, index_k_proj, index_q_norm, index_k_norm.

    With `index_branch=False` the layer is a plain dense GQA layer (M3's layers 0-2): the index
    projections are not created, `project` returns None for q_idx and k_idx, the mode stays
    "dense" and `forward` returns kl None.  `layer_idx` names the layer in a cache shared by all
    layers of a model.
    """

    def __init__(self, cfg: MSAConfig, mode: str = "sparse", *, index_branch: bool = True, layer_idx: int = 0) -> None:
        super().__init__(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps)
        self.cfg = cfg
        self.layer_idx = int(layer_idx)  # this layer's slot in a cache shared by all layers
        # full-sequence attention hook: None (`msa_attend`) or an object whose `attend` takes
        # msa_attend's arguments (context parallelism: msakit.distributed.ContextParallel)
        self.context = None
        # selection override for evaluation: None (the indexer) or
        # fn(layer_idx, q, k, q_idx, k_idx, cfg) -> block_idx int32 [B, G, T, K] (`set_selection_policy`)
        self.selection_policy: Callable[..., torch.Tensor] | None = None
        self.index_branch = bool(index_branch)
        self.mode = mode if self.index_branch else "dense"
        if not self.index_branch:
            return
        H, G, Di = cfg.hidden_size, cfg.num_kv_heads, cfg.index_dim
        self.index_q_proj = nn.Linear(H, G * Di, bias=False)
        self.index_k_proj = nn.Linear(H, Di, bias=False)
        self.index_q_norm = GemmaRMSNorm(Di, cfg.rms_norm_eps)
        self.index_k_norm = GemmaRMSNorm(Di, cfg.rms_norm_eps)

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        if value not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {value!r}")
        if value == "sparse" and not getattr(self, "index_branch", True):
            raise ValueError("mode 'sparse' needs the index branch; this layer was built with index_branch=False")
        self._mode = value

    def project(self, hidden: torch.Tensor, positions: torch.Tensor | None = None, *, with_index: bool = True):
        """hidden [B,T,H] -> q [B,T,Hq,D], k, v [B,T,G,D], q_idx [B,T,G,Di], k_idx [B,T,Di] (normed, RoPE'd);
        q_idx and k_idx are None without an index branch or with with_index=False."""
        if hidden.dim() != 3 or hidden.shape[-1] != self.cfg.hidden_size:
            raise ValueError(f"hidden must have shape [B, T, {self.cfg.hidden_size}], got {tuple(hidden.shape)}")
        c = self.cfg
        B, T, _ = hidden.shape
        if positions is None:
            positions = torch.arange(T, device=hidden.device).unsqueeze(0)
        elif positions.shape[-1] != T:
            raise ValueError(f"positions must have T={T} entries in its last dim, got {tuple(positions.shape)}")
        cos, sin = rope_cos_sin(positions, c.rotary_dim, c.rope_theta)
        # the projections read one 2-D input [B*T, H] (a view): inductor can then merge them into
        # one GEMM (its same-input linear fusion matches 2-D linears only)
        h2 = hidden.reshape(B * T, c.hidden_size)
        q = self.q_norm(self.q_proj(h2).view(B, T, c.num_heads, c.head_dim))
        k = self.k_norm(self.k_proj(h2).view(B, T, c.num_kv_heads, c.head_dim))
        v = self.v_proj(h2).view(B, T, c.num_kv_heads, c.head_dim)
        q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
        if not (self.index_branch and with_index):
            return q, k, v, None, None
        # stop-gradient: the KL never reaches the backbone through the indexer input (without
        # autograd there is nothing to stop, and the index projections share q/k/v's input)
        h_idx = h2.detach() if torch.is_grad_enabled() else h2
        q_idx = self.index_q_norm(self.index_q_proj(h_idx).view(B, T, c.num_kv_heads, c.index_dim))
        k_idx = self.index_k_norm(self.index_k_proj(h_idx).view(B, T, 1, c.index_dim))
        q_idx, k_idx = apply_partial_rope(q_idx, cos, sin), apply_partial_rope(k_idx, cos, sin).squeeze(2)
        return q, k, v, q_idx, k_idx

    def select(self, q_idx: torch.Tensor, k_idx: torch.Tensor) -> torch.Tensor:
        """The indexer's top-k blocks: q_idx [B,T,G,Di], k_idx [B,T,Di] -> block_idx int32 [B,G,T,K]."""
        c = self.cfg
        with torch.no_grad():
            return ops.index_topk(
                q_idx, k_idx, block_size=c.block_size, topk=c.topk, local_blocks=c.local_blocks, init_blocks=c.init_blocks
            )

    def _selector(self, q: torch.Tensor, k: torch.Tensor, segments: Sequence[tuple[int, int]] | None):
        """The selection msa_attend uses: the indexer, or the selection policy (whole sequences only)."""
        policy = self.selection_policy
        if policy is None:
            return self.select
        if self.context is not None or (segments is not None and len(segments) > 1):
            raise ValueError("a selection policy takes one unpacked sequence per row, without context parallelism")
        return lambda qi, ki: policy(self.layer_idx, q, k, qi, ki, self.cfg)

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor | None = None,
        *,
        cache: "KVCacheProtocol | None" = None,
        segments: Sequence[tuple[int, int]] | None = None,
        compute_kl: bool = True,
        want_inputs: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, Any] | None]:
        """hidden [B,T,H] -> (out [B,T,H], KL term (scalar) or None, attention inputs or None).

        Without a cache (training, full sequences): `msa_attend` (or `self.context.attend` when a
        context is set) over the T positions (per document with `segments`), the KL term when `compute_kl` and the layer has an index
        branch, the detached q, k, q_idx, k_idx, block_idx and selection settings with
        `want_inputs`.  With a cache (`msakit.cache.KVCacheProtocol`): the new positions' k, v and
        index keys are written into it and q attends everything it holds for layer `layer_idx`
        (dense or MSA by `mode`); no KL, no inputs."""
        c = self.cfg
        B, T = hidden.shape[:2]
        # dense attention without the KL or the inputs reads no index keys: not computed (a cache
        # keeps them for later sparse steps, so a cached forward always computes them)
        with_index = cache is not None or self.mode == "sparse" or compute_kl or want_inputs
        q, k, v, q_idx, k_idx = self.project(hidden, positions, with_index=with_index)
        kl = inputs = None
        if cache is None:
            attend = msa_attend if self.context is None else self.context.attend
            o, kl, bidx = attend(q, k, v, q_idx, k_idx, c, mode=self.mode, compute_kl=compute_kl,
                                 need_block_idx=want_inputs, segments=segments,
                                 select=self._selector(q, k, segments))
            if want_inputs:
                det = lambda t: None if t is None else t.detach()  # noqa: E731
                inputs = dict(q=det(q), k=det(k), q_idx=det(q_idx), k_idx=det(k_idx), block_idx=bidx,
                              **selection_info(c, segments))
        else:
            cache.write(self.layer_idx, k, v, k_idx)
            o = cache.attend(self.layer_idx, q, q_idx, c, self.mode)
        return self.o_proj(o.reshape(B, T, c.num_heads * c.head_dim)), kl, inputs

    def reset_parameters(self, std: float = 0.02) -> None:
        lins = (self.q_proj, self.k_proj, self.v_proj)
        if self.index_branch:
            lins = lins + (self.index_q_proj, self.index_k_proj)
        for lin in lins:
            nn.init.normal_(lin.weight, std=std)
        nn.init.normal_(self.o_proj.weight, std=std / math.sqrt(2))
