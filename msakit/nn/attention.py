"""`MSAAttention`: GQA attention with MiniMax Sparse Attention's index branch.

Data flow of one layer (training):

    hidden ──q/k/v_proj──> q [B,T,Hq,D], k, v [B,T,G,D] ──q/k_norm, partial RoPE──┐
    hidden.detach() ──index_q/k_proj──> q_idx [B,T,G,Di], k_idx [B,T,Di] ──norm, RoPE──┤
                                                                                     v
    msakit.nn.core.attend: index_topk -> block_idx [B,G,T,K] -> sparse_attention (mode "sparse")
                           or dense causal attention (mode "dense": the warm-up / conversion mode);
                           index_kl_loss on the same selection (P detached: grads reach the index
                           branch only)

In dense mode the indexer still learns: it selects blocks with its own top-k and the KL is taken
over those selected tokens (or over every causal token with `kl_tokens="all"`); only the main
branch's output ignores the selection.  This is the seed's full-attention warm-up.  The index
branch reads `hidden.detach()` (the seed's stop-gradient on the indexer's input), and P is
detached inside `index_kl_loss`, so the KL term never reaches the backbone.

Decoding uses the same module with a cache (`msakit.cache.KVCacheProtocol`): the new positions'
k, v and index keys are written into it and the core attends its view (dense, or MSA: the
indexer's top-k blocks over every held index key) -- contiguous, paged and speculative caches alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from msakit.cache.base import HeldKeys, KVCacheProtocol
from msakit.nn.core import KL_TOKENS, MODES, attend, selection_info
from msakit.nn.norm import GemmaRMSNorm
from msakit.nn.rope import apply_partial_rope, rope_cos_sin
from msakit.ops.index_topk import Selection

__all__ = ["MSAConfig", "MSAAttention", "GQAProjections", "MODES", "KL_TOKENS", "INDEX_MODULES", "index_projections"]

# the index branch's modules under an attention module (HF MiniMax-M3 names)
INDEX_MODULES = ("index_q_proj", "index_k_proj", "index_q_norm", "index_k_norm")


@dataclass
class MSAConfig:
    """Shape and selection settings of one MSA layer (HF MiniMax-M3 names in comments).  The
    selection (`sparse_block_size`, `sparse_topk_blocks`, `sparse_local_block`,
    `sparse_init_block`) is one `Selection`."""

    hidden_size: int
    num_heads: int  # num_attention_heads
    num_kv_heads: int  # num_key_value_heads (= groups G = index heads)
    head_dim: int = 128
    index_dim: int = 128  # sparse_index_dim
    rotary_dim: int = 64
    rope_theta: float = 1e7
    rms_norm_eps: float = 1e-6
    selection: Selection = field(default_factory=Selection)
    kl_tokens: str = "selected"  # the KL over the selected tokens or over "all" causal tokens

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "index_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if not (0 <= self.rotary_dim <= min(self.head_dim, self.index_dim)) or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim={self.rotary_dim} must be even and <= head_dim and index_dim")
        if not isinstance(self.selection, Selection):
            raise ValueError(f"selection must be a Selection, got {type(self.selection).__name__}")
        if self.kl_tokens not in KL_TOKENS:
            raise ValueError(f"kl_tokens must be one of {KL_TOKENS}, got {self.kl_tokens!r}")


def index_projections(module: nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      cfg: MSAConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The index branch of `module` (its `index_q_proj`, `index_k_proj`, `index_q_norm`,
    `index_k_norm`) on the layer input hidden [B, T, H] -> q_idx [B, T, G, Di], k_idx [B, T, Di],
    normed and rotated by the partial RoPE (cos, sin of `rope_cos_sin`).  The input is detached,
    the seed's stop-gradient: the KL never reaches the backbone through the indexer.  It reads the
    2-D view [B*T, H] as the main projections do (inductor can merge same-input linears)."""
    B, T, H = hidden.shape
    h = hidden.reshape(B * T, H).detach()
    q_idx = module.index_q_norm(module.index_q_proj(h).view(B, T, cfg.num_kv_heads, cfg.index_dim))
    k_idx = module.index_k_norm(module.index_k_proj(h).view(B, T, 1, cfg.index_dim))
    return apply_partial_rope(q_idx, cos, sin), apply_partial_rope(k_idx, cos, sin).squeeze(2)


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
        # full-sequence attention hook: None (`msakit.nn.core.attend`) or an object whose `attend`
        # takes the core's arguments (context parallelism: msakit.distributed.ContextParallel)
        self.context = None
        # selection override for evaluation: None (the indexer) or
        # fn(layer_idx, q, k, q_idx, k_idx, sel) -> block_idx int32 [B, G, T, K] (`set_selection_policy`; sparse mode)
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
        return (q, k, v) + index_projections(self, hidden, cos, sin, c)

    def _policy_selection(self, q: torch.Tensor, k: torch.Tensor, q_idx: torch.Tensor | None,
                          k_idx: torch.Tensor | None, segments: Sequence[tuple[int, int]] | None) -> torch.Tensor | None:
        """The selection policy's block ids (per document of a packed batch, ids relative to each
        document's start), or None without a policy or in dense mode."""
        policy = self.selection_policy
        if policy is None or self.mode != "sparse":
            return None
        if self.context is not None:
            raise ValueError("a selection policy does not run under context parallelism")
        sl = lambda t, s, e: None if t is None else t[:, s:e]  # noqa: E731
        with torch.no_grad():
            parts = [policy(self.layer_idx, q[:, s:e], k[:, s:e], sl(q_idx, s, e), sl(k_idx, s, e), self.cfg.selection)
                     for s, e in (segments or [(0, q.shape[1])])]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor | None = None,
        *,
        cache: KVCacheProtocol | None = None,
        segments: Sequence[tuple[int, int]] | None = None,
        compute_kl: bool = True,
        want_inputs: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, Any] | None]:
        """hidden [B,T,H] -> (out [B,T,H], KL term (scalar) or None, attention inputs or None).

        Without a cache (training, full sequences): the core (`msakit.nn.core.attend`, or
        `self.context.attend` when a context is set) over the T positions (per document with
        `segments`), the KL term when `compute_kl` and the layer has an index branch, the detached
        q, k, q_idx, k_idx, block_idx and selection settings with `want_inputs`.  With a cache
        (`msakit.cache.KVCacheProtocol`): the new positions' k, v and index keys are written into
        it and the core attends its view of layer `layer_idx` (dense or MSA by `mode`); no KL, no
        inputs."""
        c = self.cfg
        B, T = hidden.shape[:2]
        # dense attention without the KL or the inputs reads no index keys: not computed (a cache
        # keeps them for later sparse steps, so a cached forward always computes them)
        with_index = cache is not None or self.mode == "sparse" or compute_kl or want_inputs
        q, k, v, q_idx, k_idx = self.project(hidden, positions, with_index=with_index)
        kl = inputs = None
        if cache is None:
            core = attend if self.context is None else self.context.attend
            o, kl, bidx = core(q, q_idx, HeldKeys(k, v, k_idx), c.selection, mode=self.mode, compute_kl=compute_kl,
                               kl_tokens=c.kl_tokens, need_block_idx=want_inputs, segments=segments,
                               block_idx=self._policy_selection(q, k, q_idx, k_idx, segments))
            if want_inputs:
                det = lambda t: None if t is None else t.detach()  # noqa: E731
                inputs = dict(q=det(q), k=det(k), q_idx=det(q_idx), k_idx=det(k_idx), block_idx=bidx,
                              **selection_info(c.selection, segments))
        else:
            cache.write(self.layer_idx, k, v, k_idx)
            o = attend(q, q_idx, cache.view(self.layer_idx), c.selection, mode=self.mode)[0]
        return self.o_proj(o.reshape(B, T, c.num_heads * c.head_dim)), kl, inputs

    def reset_parameters(self, std: float = 0.02) -> None:
        lins = (self.q_proj, self.k_proj, self.v_proj)
        if self.index_branch:
            lins = lins + (self.index_q_proj, self.index_k_proj)
        for lin in lins:
            nn.init.normal_(lin.weight, std=std)
        nn.init.normal_(self.o_proj.weight, std=std / math.sqrt(2))
