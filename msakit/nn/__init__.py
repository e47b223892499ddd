"""Modules on `msakit.ops`: the one attention core (`msakit.nn.core.attend`), the MSA attention
layer, the M3 mixture of experts, MLPs, norms, RoPE."""

from msakit.nn.attention import GQAProjections, MSAAttention, MSAConfig
from msakit.nn.core import KL_TOKENS, MODES, attend
from msakit.nn.mlp import SwiGLUMLP, swiglu_oai
from msakit.nn.moe import GroupedExperts, MoE, grouped_mm, route
from msakit.nn.norm import GemmaRMSNorm
from msakit.nn.rope import apply_partial_rope, rope_cos_sin

__all__ = ["attend", "GQAProjections", "MSAAttention", "MSAConfig", "MODES", "KL_TOKENS", "GemmaRMSNorm",
           "apply_partial_rope", "rope_cos_sin", "SwiGLUMLP", "swiglu_oai", "MoE", "GroupedExperts", "grouped_mm",
           "route"]
