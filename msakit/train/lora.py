"""LoRA on the backbone of an MSA model (stage 2 of the conversion recipe), by peft.

`apply_lora(model, rank, alpha)` puts peft LoRA adapters (`peft.inject_adapter_in_model`) on the
backbone's linear layers -- every `nn.Linear` inside the decoder layers except the index branch
(`msakit.nn.attention.INDEX_MODULES`) and an MoE router -- and leaves trainable exactly the LoRA
matrices and the index branch (which trains fully: the KL's only target).  The embeddings, the
LM head, the norms and the base weights are frozen.  It works the same on msakit's own
`M3ForCausalLM` (plain `nn.Linear` projections) and on an HF-backed `MSAWrappedModel`.

`merge_lora(model)` folds each adapter into its base weight (peft's `merge`) and puts the base
`nn.Linear` back in place, so the model has its original parameter names again and saves as a
plain model folder that `msakit generate` / `msakit eval` load as usual.
"""

from __future__ import annotations

from torch import nn

from msakit.models.interface import index_parameters
from msakit.nn.attention import INDEX_MODULES

__all__ = ["apply_lora", "lora_targets", "merge_lora", "has_lora"]

ROUTER_NAMES = ("gate", "router")  # an MoE router's linear: its scores pick experts, no LoRA on it


def lora_targets(model: nn.Module) -> list[str]:
    """Full names of the linear layers `apply_lora` adapts: every `nn.Linear` whose name has a
    `layers.N.` part (inside a decoder layer), except the index branch and MoE routers."""
    out = []
    for name, mod in model.named_modules():
        parts = name.split(".")
        if not isinstance(mod, nn.Linear) or "layers" not in parts:
            continue
        if any(m in parts for m in INDEX_MODULES) or parts[-1] in ROUTER_NAMES:
            continue
        out.append(name)
    return out


def apply_lora(model: nn.Module, rank: int, alpha: float | None = None, *, dropout: float = 0.0) -> list[str]:
    """Put LoRA adapters of `rank` (scale alpha / rank; `alpha` None: rank, a scale of 1) on the
    backbone's linear layers (`lora_targets`), in place; afterwards only the LoRA matrices and the
    index branch (`index_parameters`) require gradients.  Returns the adapted layers' names.
    ValueError for a rank below 1, a non-positive alpha, a model already adapted or one without
    linear layers to adapt."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be a positive integer, got {rank!r}")
    if alpha is not None and not alpha > 0:
        raise ValueError(f"alpha must be positive, got {alpha!r}")
    if has_lora(model):
        raise ValueError("the model already has LoRA adapters")
    targets = lora_targets(model)
    if not targets:
        raise ValueError(f"{type(model).__name__} has no linear layers inside decoder layers to put LoRA on")
    from peft import LoraConfig, inject_adapter_in_model

    index = {n for n, _ in index_parameters(model)}
    cfg = LoraConfig(r=rank, lora_alpha=float(rank if alpha is None else alpha), lora_dropout=dropout,
                     target_modules=targets, bias="none")
    inject_adapter_in_model(cfg, model)
    for n, p in model.named_parameters():
        p.requires_grad_(n in index or ".lora_" in n)
    return targets


def has_lora(model: nn.Module) -> bool:
    """Whether `model` holds peft LoRA layers."""
    from peft.tuners.lora import LoraLayer

    return any(isinstance(m, LoraLayer) for m in model.modules())


def merge_lora(model: nn.Module) -> int:
    """Fold every LoRA adapter of `model` into its base weight (W + scale x B A, peft's `merge`)
    and put the base layer back in place of the LoRA layer; returns how many were merged (0: the
    model had none).  The merged weights keep requires_grad False."""
    from peft.tuners.lora import LoraLayer

    found = [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]
    for name, mod in found:
        mod.merge()
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, mod.get_base_layer())
    if found and hasattr(model, "peft_config"):
        del model.peft_config
    return len(found)
