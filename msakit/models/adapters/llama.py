"""Llama (`LlamaForCausalLM`): the shape `FamilyAdapter` describes by default (separate q/k/v
projections, no q/k norms, RoPE over every head dim)."""

from __future__ import annotations

from msakit.models.adapters.base import FamilyAdapter, register_family

__all__ = ["LlamaAdapter"]


class LlamaAdapter(FamilyAdapter):
    model_types = ("llama",)


register_family(LlamaAdapter())
