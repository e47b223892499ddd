"""What the HF conversion (`msakit.models.hf`) asks of a model family, and the registry of families.

A `FamilyAdapter` serves one or more HF model_types and says:

- where the decoder layers and each layer's attention module live (`decoder_layers`,
  `attention`);
- the attention's shape (`attention_shape`: hidden size, query heads, KV heads, head dim) and
  RoPE (`rope_theta`, `rotary_dim`: the dims the main RoPE rotates) from the HF config;
- how q and k are projected (`qk_weights`: the q and k projection weights [Hq * D, H] and
  [G * D, H], split out of a fused QKV projection where the family has one; `qk_norms`: the
  per-head q / k norms, if any);
- which variants it cannot convert (`check`: sliding windows, ...);
- where the index branch's modules go (`INDEX_MODULES` under each converted attention module)
  and so its weights in and out (`index_weight_names`, `index_state_dict`,
  `load_index_state_dict`).

The defaults describe the Llama shape (``model.model.layers[i].self_attn`` with q_proj / k_proj
/ v_proj / o_proj, no q / k norms, RoPE over every head dim).  `register_family(adapter)` adds a
family; saved MSA models of it say model_type ``"msakit_<name>"`` (`MSA_PREFIX`), and
`on_family_registered` lets the HF machinery register their transformers classes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from msakit.nn.attention import INDEX_MODULES

__all__ = [
    "MSA_PREFIX",
    "AttentionShape",
    "FamilyAdapter",
    "adapter_for",
    "base_model_type",
    "family_adapter",
    "find_family",
    "on_family_registered",
    "register_family",
    "supported_model_types",
]

MSA_PREFIX = "msakit_"  # model_type of a saved MSA folder: "msakit_<family name>"


@dataclass(frozen=True)
class AttentionShape:
    """An attention layer's shape: hidden size H, query heads Hq, KV heads G, head dim D."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


class FamilyAdapter:
    """One HF causal-LM family (see the module docstring).  Subclasses set `model_types` and
    override what differs from the Llama shape."""

    model_types: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """The family's name (its first model_type): saved MSA folders say "msakit_<name>"."""
        return self.model_types[0]

    # -- the HF config ---------------------------------------------------------------------
    def check(self, config: Any) -> None:
        """ValueError when `config` has a variant msakit cannot convert: sliding-window layers."""
        kinds = set(getattr(config, "layer_types", None) or ())
        if getattr(config, "use_sliding_window", False) or kinds - {"full_attention"}:
            raise ValueError(f"{config.model_type}: sliding-window attention is not supported by the MSA wrapper")

    def attention_shape(self, config: Any) -> AttentionShape:
        heads = int(config.num_attention_heads)
        kv = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        return AttentionShape(int(config.hidden_size), heads, kv, head_dim)

    def rope_theta(self, config: Any) -> float:
        params = getattr(config, "rope_parameters", None) or {}
        if isinstance(params, dict) and "rope_theta" in params:
            return float(params["rope_theta"])
        return float(getattr(config, "rope_theta", 10000.0))

    def rotary_dim(self, config: Any) -> int:
        """The head dims the main RoPE rotates (head_dim x partial_rotary_factor, even)."""
        params = getattr(config, "rope_parameters", None) or {}
        factor = params.get("partial_rotary_factor") if isinstance(params, dict) else None
        if factor is None:
            factor = getattr(config, "partial_rotary_factor", 1.0)
        return int(self.attention_shape(config).head_dim * float(factor)) // 2 * 2

    # -- where things live -----------------------------------------------------------------
    def decoder_layers(self, model: nn.Module) -> Sequence[nn.Module]:
        """The decoder layers of an HF causal LM of the family, in order."""
        return model.model.layers

    def attention(self, layer: nn.Module) -> nn.Module:
        """The attention module of one decoder layer (where the index branch goes)."""
        return layer.self_attn

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        return [self.attention(layer) for layer in self.decoder_layers(model)]

    # -- q / k projections -----------------------------------------------------------------
    def qk_weights(self, attn: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """The q and k projection weights of an attention module: [Hq * D, H], [G * D, H]."""
        return attn.q_proj.weight, attn.k_proj.weight

    def qk_norms(self, attn: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
        """The per-head q and k norms (HF RMSNorm: x * weight) applied before RoPE, if any."""
        return None, None

    # -- the index branch's weights ----------------------------------------------------------
    def index_weight_names(self, model: nn.Module, layers: Sequence[int]) -> list[str]:
        """The state-dict names of the index branches of `layers` (`INDEX_MODULES` under each
        layer's attention module)."""
        where = {id(m): n for n, m in model.named_modules()}
        attns = self.attention_modules(model)
        return [f"{where[id(attns[i])]}.{m}.weight" for i in layers for m in INDEX_MODULES]

    def index_state_dict(self, model: nn.Module, layers: Sequence[int]) -> dict[str, torch.Tensor]:
        """The index branches' weights of `layers`, by state-dict name."""
        own = model.state_dict()
        return {n: own[n] for n in self.index_weight_names(model, layers)}

    @torch.no_grad()
    def load_index_state_dict(self, model: nn.Module, layers: Sequence[int], tensors: dict[str, torch.Tensor]) -> None:
        """Copy the index-branch weights of `layers` from `tensors` (exactly those names; cast to
        each weight's dtype)."""
        names = self.index_weight_names(model, layers)
        missing, unexpected = sorted(set(names) - set(tensors)), sorted(set(tensors) - set(names))
        if missing or unexpected:
            raise ValueError(f"index weights do not match: missing {missing[:4]}, unexpected {unexpected[:4]}")
        own = model.state_dict()
        for n in names:
            own[n].copy_(tensors[n].to(own[n].dtype))


# ---------------------------------------------------------------------------------------------
# The registry
# ---------------------------------------------------------------------------------------------

_FAMILIES: dict[str, FamilyAdapter] = {}  # by HF model_type
_LISTENERS: list[Callable[[FamilyAdapter], None]] = []


def register_family(adapter: FamilyAdapter) -> FamilyAdapter:
    """Add a family (every model_type of `adapter`); returns the adapter.  A model_type served by
    an adapter of another class is refused; registering the same class again replaces it."""
    if not isinstance(adapter, FamilyAdapter) or not adapter.model_types:
        raise ValueError(f"expected a FamilyAdapter with model_types, got {adapter!r}")
    for mt in adapter.model_types:
        old = _FAMILIES.get(mt)
        if old is not None and type(old) is not type(adapter):
            raise ValueError(f"model_type {mt!r} is already served by {type(old).__name__}")
    for mt in adapter.model_types:
        _FAMILIES[mt] = adapter
    for fn in _LISTENERS:
        fn(adapter)
    return adapter


def on_family_registered(fn: Callable[[FamilyAdapter], None]) -> None:
    """Call `fn(adapter)` for every family registered now and later (once per listener)."""
    if fn in _LISTENERS:
        return
    _LISTENERS.append(fn)
    for adapter in {id(a): a for a in _FAMILIES.values()}.values():
        fn(adapter)


def base_model_type(model_type: str) -> str:
    """"msakit_qwen2" -> "qwen2"; other names unchanged."""
    return model_type[len(MSA_PREFIX):] if model_type.startswith(MSA_PREFIX) else model_type


def find_family(model_type: str) -> FamilyAdapter | None:
    """The adapter of an HF model_type (or of a saved MSA folder's "msakit_<family>"), or None."""
    return _FAMILIES.get(base_model_type(model_type))


def supported_model_types() -> tuple[str, ...]:
    """The HF model_types of the registered families, sorted."""
    return tuple(sorted(_FAMILIES))


def family_adapter(model_type: str) -> FamilyAdapter:
    """The adapter of `model_type`; ValueError naming the supported ones when there is none."""
    adapter = find_family(model_type)
    if adapter is None:
        raise ValueError(f"HF model_type {model_type!r} is not supported "
                         f"(supported: {', '.join(supported_model_types())})")
    return adapter


def adapter_for(model: nn.Module) -> FamilyAdapter:
    """The adapter of an HF model, by its config's model_type."""
    cfg = getattr(model, "config", None)
    if cfg is None or not isinstance(getattr(cfg, "model_type", None), str):
        raise ValueError(f"expected an HF causal LM with a config, got {type(model).__name__}")
    return family_adapter(cfg.model_type)
