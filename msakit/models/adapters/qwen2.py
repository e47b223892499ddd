"""Qwen2 (`Qwen2ForCausalLM`): the Llama shape with q/k/v biases (the index branch has none);
sliding-window layers (`use_sliding_window`) are refused by the default check."""

from __future__ import annotations

from msakit.models.adapters.base import FamilyAdapter, register_family

__all__ = ["Qwen2Adapter"]


class Qwen2Adapter(FamilyAdapter):
    model_types = ("qwen2",)


register_family(Qwen2Adapter())
