"""Modules built on `msakit.ops`: MSA attention, norms, RoPE."""

from msakit.nn.attention import MODES, MSAAttention, MSAConfig
from msakit.nn.norm import GemmaRMSNorm
from msakit.nn.rope import apply_partial_rope, rope_cos_sin

__all__ = ["MSAAttention", "MSAConfig", "MODES", "GemmaRMSNorm", "apply_partial_rope", "rope_cos_sin"]
