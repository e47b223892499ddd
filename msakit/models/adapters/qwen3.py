"""Qwen3 (`Qwen3ForCausalLM`): the Llama shape with per-head q and k RMSNorms before RoPE."""

from __future__ import annotations

from torch import nn

from msakit.models.adapters.base import FamilyAdapter, register_family

__all__ = ["Qwen3Adapter"]


class Qwen3Adapter(FamilyAdapter):
    model_types = ("qwen3",)

    def qk_norms(self, attn: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
        return attn.q_norm, attn.k_norm


register_family(Qwen3Adapter())
