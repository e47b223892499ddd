"""Selection policies on a plain HF causal LM, without an index branch.

`HFPolicyModel` wraps a transformers model of a registered family (`msakit.models.adapters`)
and installs a `PolicyHandler` on each attention module (`msakit.models.hooks`: the one
transformers attention function dispatches to it).  In "dense" mode the handler runs HF's own
SDPA attention (logits equal the unwrapped model's); in "sparse" mode each layer calls the
selection policy on its q [B, T, Hq, D] and k [B, T, G, D] (after HF's RoPE) and the attention
core (`msakit.nn.core.attend`) attends the selected blocks.  There is no index branch, so q_idx
and k_idx are None: the ``window``, ``window0`` and ``oracle`` policies run, ``msa`` needs a
converted model (``has_indexer`` is False).  `forward` calls the model without a KV cache; called
with HF's own cache (`msakit.eval.generation.greedy_generate`), each step's queries select among
every held key.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from msakit.cache.base import HeldKeys
from msakit.models.adapters import adapter_for
from msakit.models.hf import HFModelWrapper
from msakit.models.hooks import hf_sdpa_attention, set_attention_handler, use_msakit_attention
from msakit.models.interface import SelectionPolicy
from msakit.nn.core import attend
from msakit.ops.index_topk import Selection

__all__ = ["HFPolicyModel", "PolicyHandler"]


class PolicyHandler:
    """The attention handler of every layer of an `HFPolicyModel`: its mode, selection settings
    and policy, shared by the layers."""

    def __init__(self, sel: Selection) -> None:
        self.sel = sel
        self.mode = "dense"
        self.policy: SelectionPolicy | None = None

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        """query [B, Hq, T, D], key / value [B, G, Tk, D] (after RoPE; Tk > T when HF's cache holds
        earlier positions: the queries are the last T) -> (out [B, T, Hq, D], None)."""
        if self.mode == "dense" or self.policy is None:
            return hf_sdpa_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                     **kwargs)
        q = query.transpose(1, 2).contiguous()
        k = key.transpose(1, 2).contiguous()
        v = value.transpose(1, 2).contiguous()
        layer = int(getattr(module, "layer_idx", 0) or 0)
        with torch.no_grad():
            bidx = self.policy(layer, q, k, None, None, self.sel)
        return attend(q, None, HeldKeys(k, v), self.sel, mode="sparse", softmax_scale=scaling, block_idx=bidx)[0], None


class HFPolicyModel(HFModelWrapper):
    """`forward(input_ids) -> HF output (.logits [B, T, V])`; an
    `msakit.models.interface.SelectionModel` without an indexer:
    ``set_selection_policy(fn)`` with ``fn(layer_idx, q, k, None, None, sel) -> block_idx``."""

    has_indexer = False  # no index branch: the msa policy cannot run
    _state: PolicyHandler

    def __init__(self, hf_model: nn.Module, *, block_size: int, topk: int, local_blocks: int = 1,
                 init_blocks: int = 0) -> None:
        adapter = adapter_for(hf_model)
        adapter.check(hf_model.config)
        super().__init__(hf_model, PolicyHandler(Selection(block_size, topk, local_blocks, init_blocks)))
        for attn in adapter.attention_modules(hf_model):
            set_attention_handler(attn, self._state)
        use_msakit_attention(hf_model)

    def forward(self, input_ids: torch.Tensor) -> Any:
        if self._state.mode == "sparse" and self._state.policy is None:
            raise ValueError("sparse mode needs a selection policy (set_selection_policy): this model has no indexer")
        return self.hf(input_ids=input_ids, use_cache=False)
