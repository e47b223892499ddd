"""A model family added by one file: transformers' Phi-3 (`Phi3ForCausalLM`), whose attention
projects q, k and v with one fused `qkv_proj` and may rotate only part of each head
(`partial_rotary_factor`).  Importing this module registers the family with msakit."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from msakit.models.adapters import FamilyAdapter, register_family


class Phi3Adapter(FamilyAdapter):
    model_types = ("phi3",)

    def check(self, config: Any) -> None:
        super().check(config)
        if getattr(config, "sliding_window", None):
            raise ValueError(f"phi3: sliding-window attention is not supported (sliding_window={config.sliding_window})")

    def qk_weights(self, attn: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        shape = self.attention_shape(attn.config)
        q_rows = shape.num_heads * shape.head_dim
        w = attn.qkv_proj.weight  # rows: q [Hq * D], k [G * D], v [G * D]
        return w[:q_rows], w[q_rows:q_rows + shape.num_kv_heads * shape.head_dim]


register_family(Phi3Adapter())
