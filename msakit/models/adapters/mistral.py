"""Mistral (`MistralForCausalLM`): the Llama shape; its config's `sliding_window` alone turns the
window on, so a config with one is refused."""

from __future__ import annotations

from typing import Any

from msakit.models.adapters.base import FamilyAdapter, register_family

__all__ = ["MistralAdapter"]


class MistralAdapter(FamilyAdapter):
    model_types = ("mistral",)

    def check(self, config: Any) -> None:
        super().check(config)
        if getattr(config, "sliding_window", None):
            raise ValueError("mistral: sliding-window attention is not supported by the MSA wrapper "
                             f"(sliding_window={config.sliding_window}; set it to None)")


register_family(MistralAdapter())
