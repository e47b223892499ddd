"""Selection policies on a plain HF causal LM, without an index branch.

`HFPolicyModel` wraps a transformers Llama / Qwen2-style model and swaps its attention core
through transformers' attention interface (name ``msakit_eval_policy``): in "dense" mode it is
HF's own SDPA attention (logits equal the unwrapped model's); in "sparse" mode each layer calls
the selection policy on its q [B, T, Hq, D] and k [B, T, G, D] (after HF's RoPE) and the
attention core (`msakit.nn.core.attend`) attends the selected blocks.  There is no index branch, so q_idx and k_idx
are None: the ``window``, ``window0`` and ``oracle`` policies run, ``msa`` needs a converted
model.  The model is called without a KV cache.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from msakit.cache.base import HeldKeys
from msakit.models.convert import register_hf_attention
from msakit.nn.core import attend
from msakit.ops.index_topk import Selection

__all__ = ["ATTN_IMPL", "HFPolicyModel"]

ATTN_IMPL = "msakit_eval_policy"


class _State:
    def __init__(self, sel: Selection) -> None:
        self.sel = sel
        self.mode = "dense"
        self.policy = None


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention interface: query [B, Hq, T, D], key / value [B, G, T, D] (after RoPE)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    st: _State | None = module.__dict__.get("_msakit_eval_state")
    if st is None or st.mode == "dense" or st.policy is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[2] != key.shape[2]:
        raise ValueError("HFPolicyModel runs without an HF KV cache (the model is called with use_cache=False)")
    q = query.transpose(1, 2).contiguous()
    k = key.transpose(1, 2).contiguous()
    v = value.transpose(1, 2).contiguous()
    layer = int(getattr(module, "layer_idx", 0) or 0)
    with torch.no_grad():
        bidx = st.policy(layer, q, k, None, None, st.sel)
    return attend(q, None, HeldKeys(k, v), st.sel, mode="sparse", softmax_scale=scaling, block_idx=bidx)[0], None


class HFPolicyModel(nn.Module):
    """`forward(input_ids) -> HF output (.logits [B, T, V])` with `set_attention_mode` and
    `set_selection_policy(fn)`, ``fn(layer_idx, q, k, None, None, sel) -> block_idx``."""

    has_indexer = False  # no index branch: the msa policy cannot run

    def __init__(self, hf_model: nn.Module, *, block_size: int, topk: int, local_blocks: int = 1,
                 init_blocks: int = 0) -> None:
        super().__init__()
        layers = getattr(getattr(hf_model, "model", None), "layers", None)
        if layers is None or not hasattr(hf_model, "set_attn_implementation"):
            raise ValueError(f"hf_model must be a transformers causal LM with model.layers, got {type(hf_model).__name__}")
        register_hf_attention(ATTN_IMPL, _attention)
        self.hf = hf_model
        self._state = _State(Selection(block_size, topk, local_blocks, init_blocks))
        for layer in layers:
            layer.self_attn.__dict__["_msakit_eval_state"] = self._state
        hf_model.set_attn_implementation(ATTN_IMPL)

    @property
    def config(self) -> Any:
        return self.hf.config

    def set_attention_mode(self, mode: str) -> None:
        if mode not in ("dense", "sparse"):
            raise ValueError(f"mode must be 'dense' or 'sparse', got {mode!r}")
        self._state.mode = mode

    def set_selection_policy(self, fn: Any) -> None:
        if fn is not None and not callable(fn):
            raise ValueError(f"the selection policy must be callable or None, got {type(fn).__name__}")
        self._state.policy = fn

    def forward(self, input_ids: torch.Tensor) -> Any:
        if self._state.mode == "sparse" and self._state.policy is None:
            raise ValueError("sparse mode needs a selection policy (set_selection_policy): this model has no indexer")
        return self.hf(input_ids=input_ids, use_cache=False)
