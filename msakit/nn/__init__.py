"""Modules built on `msakit.ops`: MSA attention, norms, RoPE."""

from msakit.nn.attention import MODES, GQAProjections, MSAAttention, MSAConfig
from msakit.nn.norm import GemmaRMSNorm
from msakit.nn.rope import apply_partial_rope, rope_cos_sin

__all__ = ["GQAProjections", "MSAAttention", "MSAConfig", "MODES", "GemmaRMSNorm", "apply_partial_rope", "rope_cos_sin"]
from msakit.nn.mlp import SwiGLUMLP, swiglu_oai
from msakit.nn.moe import GroupedExperts, MoE, grouped_mm, route

__all__ += ["SwiGLUMLP", "swiglu_oai", "MoE", "GroupedExperts", "grouped_mm", "route"]
