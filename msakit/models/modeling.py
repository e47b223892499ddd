"""`M3ForCausalLM`: the MiniMax-M3 text model with MSA attention and an M3 mixture of experts.

    embed_tokens -> L x [ input_layernorm -> self_attn (MSAAttention) -> +residual
                          -> post_attention_layernorm -> mlp (dense) | block_sparse_moe -> +residual ]
                 -> norm -> lm_head (untied)

Layers whose `sparse_attention_freq` is 0 are dense GQA layers without an index branch (M3's
layers 0-2); the others are MSA layers, run in the model's attention mode ("sparse": attend the
indexer's top-k blocks; "dense": full causal attention while the indexer still learns from its
KL term, the warm-up / conversion mode).  Module and parameter names are the HF MiniMax-M3 names,
so `state_dict()` keys are the checkpoint's, except the routed experts, which are stored stacked
(`block_sparse_moe.experts.w1` [E, I, H]) and saved per expert by `msakit.models.io`.

One layer forward (`M3DecoderLayer.forward`) serves training (no cache) and every decode path:
`model(new_ids, cache=cache)` with a `msakit.cache.KVCacheProtocol` (contiguous generation, the
paged decode step and its CUDA graph, speculative verification) writes the new positions' keys
and attends what the cache holds; `taps=` returns the residual stream after given layers (the
DSpark drafter's inputs).

Packed batches: `cu_seqlens` (int32 [ndocs + 1], B == 1) splits the sequence into documents;
positions restart per document, attention, selection, KL and the LM loss never cross a document
boundary (the target of a document's last token, the next document's first token, is ignored).
Block ids in `attn_inputs` are then relative to each document's start.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from msakit.cache.base import KVCacheProtocol
from msakit.models.config import M3Config
from msakit.models.interface import (M3Output, SelectionPolicy, begin_forward, check_kl_tokens, check_mode,
                                     check_policy, end_forward, index_parameters)
from msakit.models.io import load_pretrained, save_pretrained
from msakit.nn.attention import MSAAttention, MSAConfig
from msakit.nn.mlp import SwiGLUMLP
from msakit.nn.moe import MoE
from msakit.nn.norm import GemmaRMSNorm

__all__ = [
    "M3DecoderLayer",
    "M3Model",
    "M3ForCausalLM",
    "msa_config",
    "parameter_counts",
]


# ---------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------


def msa_config(cfg: M3Config) -> MSAConfig:
    return MSAConfig(
        hidden_size=cfg.hidden_size, num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, index_dim=cfg.index_head_dim, rotary_dim=cfg.rotary_dim, rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps, selection=cfg.selection,
    )


class M3DecoderLayer(nn.Module):
    """Pre-norm block: attention (MSA or dense GQA) and a dense MLP or an MoE."""

    def __init__(self, cfg: M3Config, layer_idx: int, mode: str = "sparse") -> None:
        super().__init__()
        self.layer_idx = layer_idx
        H = cfg.hidden_size
        self.input_layernorm = GemmaRMSNorm(H, cfg.rms_norm_eps)
        sparse = cfg.is_sparse(layer_idx)
        self.self_attn = MSAAttention(msa_config(cfg), mode=mode if sparse else "dense", index_branch=sparse,
                                      layer_idx=layer_idx)
        self.post_attention_layernorm = GemmaRMSNorm(H, cfg.rms_norm_eps)
        self.is_moe = cfg.is_moe(layer_idx)
        if self.is_moe:
            self.block_sparse_moe = MoE(
                H, cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size,
                shared_intermediate_size=cfg.n_shared_experts * cfg.shared_intermediate_size,
                routed_scaling_factor=cfg.routed_scaling_factor, norm_topk_prob=cfg.norm_topk_prob,
                use_routing_bias=cfg.use_routing_bias, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit,
            )
        else:
            self.mlp = SwiGLUMLP(H, cfg.dense_intermediate_size, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)

    def forward(
        self,
        h: torch.Tensor,
        positions: torch.Tensor | None,
        cache: KVCacheProtocol | None = None,
        segments: Sequence[tuple[int, int]] | None = None,
        compute_kl: bool = True,
        want_inputs: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, dict[str, Any] | None]:
        """h [B,T,H] -> (h, KL term or None, expert load [E] or None, attn inputs or None).

        The one layer forward: input_layernorm -> self_attn (over `cache` when given: the new
        positions written, attention over what it holds) -> +residual -> post_attention_layernorm
        -> MLP / MoE -> +residual."""
        a, kl, inputs = self.self_attn(self.input_layernorm(h), positions, cache=cache, segments=segments,
                                       compute_kl=compute_kl, want_inputs=want_inputs)
        h = h + a
        x = self.post_attention_layernorm(h)
        if self.is_moe:
            y, load = self.block_sparse_moe(x)
        else:
            y, load = self.mlp(x), None
        return h + y, kl, load, inputs


class M3Model(nn.Module):
    """Embeddings, decoder layers, final norm (HF `model.` prefix)."""

    def __init__(self, cfg: M3Config, mode: str = "sparse") -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(M3DecoderLayer(cfg, i, mode) for i in range(cfg.num_hidden_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class M3ForCausalLM(nn.Module):
    """The causal LM; an `msakit.models.interface.MSAModel` (see the package docstring
    `msakit.models` for the interface)."""

    def __init__(self, config: M3Config, *, mode: str = "sparse", init: bool = True) -> None:
        super().__init__()
        if not isinstance(config, M3Config):
            raise ValueError(f"config must be an M3Config, got {type(config).__name__}")
        check_mode(mode)
        self.config = config
        self.model = M3Model(config, mode)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.gradient_checkpointing = False
        self._mode = mode
        if init:
            self.reset_parameters()

    # -- structure ---------------------------------------------------------------------------
    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def msa_layers(self) -> list[MSAAttention]:
        """The attention modules that have an index branch."""
        return [l.self_attn for l in self.model.layers if l.self_attn.index_branch]

    def moe_layers(self) -> list[MoE]:
        return [l.block_sparse_moe for l in self.model.layers if l.is_moe]

    @property
    def has_indexer(self) -> bool:
        """Whether any layer has an index branch (selects its own blocks)."""
        return any(l.self_attn.index_branch for l in self.model.layers)

    @property
    def attention_mode(self) -> str:
        return self._mode

    def set_attention_mode(self, mode: str) -> None:
        """"dense" (warm-up: full attention, the indexer still learns) or "sparse", for all MSA layers."""
        check_mode(mode)
        for attn in self.msa_layers():
            attn.mode = mode
        self._mode = mode

    def set_kl_tokens(self, tokens: str) -> None:
        """The index KL over the "selected" tokens (default) or over "all" causal tokens, for all
        MSA layers (`MSAConfig.kl_tokens`)."""
        check_kl_tokens(tokens)
        for attn in self.msa_layers():
            attn.cfg = dataclasses.replace(attn.cfg, kl_tokens=tokens)

    def index_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The index branches' parameters (name as in named_parameters(), parameter): what the
        index-only warm-up trains."""
        return index_parameters(self)

    def set_selection_policy(self, policy: SelectionPolicy | None) -> None:
        """Replace the indexer's selection in every MSA layer's full-sequence forward (evaluation):
        policy(layer_idx, q [B,T,Hq,D], k [B,T,G,D], q_idx, k_idx, sel) -> block_idx int32
        [B, G, T, K] in blocks of sel.block_size (sel: the layer's `Selection`); None restores the indexer.  Decoding with a cache
        always uses the indexer."""
        check_policy(policy)
        for attn in self.msa_layers():
            attn.selection_policy = policy

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def gradient_checkpointing_enable(self, enabled: bool = True) -> None:
        """Recompute each decoder layer in backward (activation checkpointing) while training."""
        self.gradient_checkpointing = bool(enabled)

    # -- init --------------------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """normal(0, initializer_range) everywhere; residual-output projections (o_proj, down_proj,
        expert w2) scaled by 1/sqrt(2 * num_layers); Gemma norms 0 (= scale 1); routing bias 0."""
        std = self.config.initializer_range
        out_std = std / math.sqrt(2 * self.config.num_hidden_layers)
        nn.init.normal_(self.model.embed_tokens.weight, std=std)
        nn.init.normal_(self.lm_head.weight, std=std)
        for layer in self.model.layers:
            attn = layer.self_attn
            attn.reset_parameters(std)
            nn.init.normal_(attn.o_proj.weight, std=out_std)
            if layer.is_moe:
                layer.block_sparse_moe.reset_parameters(std, out_std)
            else:
                layer.mlp.reset_parameters(std, out_std)
        for m in self.modules():
            if isinstance(m, GemmaRMSNorm):
                nn.init.zeros_(m.weight)

    # -- forward -----------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        compute_kl: bool = True,
        return_attn_inputs: bool = False,
        output_hidden_states: bool = False,
        *,
        cache: KVCacheProtocol | None = None,
        taps: Sequence[int] | None = None,
        logits_to_keep: int = 0,
    ) -> M3Output:
        """input_ids [B, T] -> M3Output(logits [B,T,V], loss, kl, expert_load [n_moe, E], ...).

        labels follow HF (== input_ids, shifted inside; -100 ignored).  `output_hidden_states`
        gives the residual stream: [0] the embeddings, [i + 1] after layer i (before the final norm);
        `taps` (layer ids) gives `out.taps`, the residual stream after those layers concatenated
        [B, T, len(taps) * H].  `logits_to_keep` > 0: logits of the last that many positions only.

        With `cache` (a `msakit.cache.KVCacheProtocol`: generation, speculative verification) the
        T tokens are new positions (`cache.positions` unless `positions` is given): every layer
        writes their keys into the cache and attends what it holds; no KL, no expert load, no
        attention inputs, no packed batches."""
        call = begin_forward(input_ids, labels, positions, cu_seqlens, compute_kl, return_attn_inputs, cache,
                             logits_to_keep)
        want = {} if taps is None else {int(t): i for i, t in enumerate(taps)}
        if any(not 0 <= t < len(self.model.layers) for t in want):
            raise ValueError(f"taps must lie in [0, {len(self.model.layers)}), got {list(taps)}")
        h = self.model.embed_tokens(input_ids)
        kls: list[torch.Tensor] = []
        loads: list[torch.Tensor] = []
        inputs: list[dict[str, Any]] = []
        hidden = [h] if output_hidden_states else None
        tapped: list[torch.Tensor | None] = [None] * len(want)
        ckpt = self.gradient_checkpointing and self.training and torch.is_grad_enabled() and cache is None
        for i, layer in enumerate(self.model.layers):
            args = (h, call.positions, cache, call.segments, call.compute_kl, call.want_inputs)
            h, kl, load, inp = checkpoint(layer, *args, use_reentrant=False) if ckpt else layer(*args)
            if kl is not None:
                kls.append(kl)
            if load is not None and cache is None:
                loads.append(load)
            inputs.append(inp)
            if hidden is not None:
                hidden.append(h)
            if i in want:
                tapped[want[i]] = h
        T = call.T
        hk = h[:, -logits_to_keep:] if 0 < logits_to_keep < T else h
        logits = self.lm_head(self.model.norm(hk))
        expert_load = torch.stack(loads) if loads else torch.zeros(0, self.config.num_local_experts, device=h.device)
        return end_forward(call, logits, labels=labels, kls=kls, expert_load=expert_load, attn_inputs=inputs,
                           hidden_states=hidden, taps=torch.cat(tapped, dim=-1) if tapped else None)

    # -- routing balance ---------------------------------------------------------------------
    @torch.no_grad()
    def update_routing_bias(self, expert_load: torch.Tensor, rate: float = 1e-3) -> None:
        """Auxiliary-loss-free balancing: per MoE layer, bias += rate * sign(mean_load - load).

        expert_load: [num_moe_layers, E] (e.g. `out.expert_load`, summed over steps/ranks)."""
        moes = self.moe_layers()
        if expert_load.dim() != 2 or expert_load.shape[0] != len(moes):
            raise ValueError(f"expert_load must have shape [{len(moes)}, {self.config.num_local_experts}], "
                             f"got {tuple(expert_load.shape)}")
        for moe, load in zip(moes, expert_load):
            moe.update_bias(load, rate)

    # -- I/O ---------------------------------------------------------------------------------
    def save_pretrained(self, path: str | os.PathLike[str], *, max_shard_size: int | str = "5GB") -> None:
        """config.json + safetensors under the HF MiniMax-M3 names (sharded above max_shard_size)."""
        save_pretrained(self, path, max_shard_size=max_shard_size)

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike[str], device: torch.device | str | None = None, dtype: torch.dtype | None = None,
        *, mode: str = "sparse",
    ) -> "M3ForCausalLM":
        """Load config.json + safetensors (single file or sharded; optional `language_model.` prefix)."""
        return load_pretrained(cls, path, device=device, dtype=dtype, mode=mode)

    def parameter_counts(self) -> dict[str, int]:
        return parameter_counts(self)


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """Parameters by `msakit.cost` category: routed experts, MXFP8 group (attention + index
    branch + shared experts + dense MLPs), embeddings + head, router, norms, router bias, total."""
    c = dict(routed_experts=0, mxfp8_group=0, embeddings_and_head=0, router=0, norms=0, router_bias=0)
    for name, p in model.named_parameters():
        n = p.numel()
        if ".experts.w" in name:
            c["routed_experts"] += n
        elif name.endswith("e_score_correction_bias"):
            c["router_bias"] += n
        elif name.endswith("block_sparse_moe.gate.weight"):
            c["router"] += n
        elif "embed_tokens" in name or name.startswith("lm_head"):
            c["embeddings_and_head"] += n
        elif "norm" in name.rsplit(".", 2)[-2]:
            c["norms"] += n
        else:
            c["mxfp8_group"] += n
    c["total"] = sum(c.values())
    return c
