"""FSDP2 (`torch.distributed.fsdp.fully_shard`) for `M3ForCausalLM`, and plain data parallelism.

`shard_model` shards every decoder layer, the embeddings and the LM head as their own FSDP
units (one all-gather per unit in forward, one reduce-scatter in backward), then the root
(final norm).  Every weight is sharded along dim 0 over all ranks, the stacked MoE experts
(`experts.w1` [E, I, H] ...) like any other; the MoE routing bias (`e_score_correction_bias`,
not trained by gradients) stays replicated so that the balancing update stays a plain in-place
add (`sync_expert_load` makes the load it reads identical on every rank).  On CUDA the layers
compute in bf16 and reduce gradients in fp32 (`MixedPrecisionPolicy(bf16, fp32)`); on CPU in
fp32.  QAT (`msakit.quant.prepare_qat`) composes: the master weights are sharded, each layer's
fake-quantised weights are computed from the gathered weights in its forward.

Without FSDP, `allreduce_gradients` averages the gradients of a replicated model over the ranks.
Either way the gradients are the MEAN over ranks: a rank back-propagates `world_size` times its
share of the global loss (see `msakit.train.trainer`).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["shard_model", "allreduce_gradients", "sync_expert_load", "is_sharded", "full_norm"]


def _routing_biases(model: nn.Module) -> set[nn.Parameter]:
    out = set()
    for name, p in model.named_parameters():
        if name.endswith("e_score_correction_bias"):
            out.add(p)
    return out


def shard_model(
    model: nn.Module,
    mesh: Any,
    *,
    mixed_precision: bool | None = None,
    activation_checkpointing: bool = False,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Apply FSDP2 in place to an `M3ForCausalLM` (its class stays an M3ForCausalLM) and return it.

    mesh: a 1-D DeviceMesh over the ranks that share the weights (`Parallel.fsdp_mesh`);
    mixed_precision: bf16 parameters / fp32 gradient reduction (default: on CUDA only);
    activation_checkpointing: recompute each decoder layer in backward."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if mesh is None:
        raise ValueError("mesh must be a DeviceMesh (FSDP needs a process group)")
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"shard_model expects an M3ForCausalLM-like model with model.layers, "
                         f"got {type(model).__name__}")
    if mixed_precision is None:
        mixed_precision = mesh.device_type == "cuda"
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision \
        else MixedPrecisionPolicy()
    kw: dict[str, Any] = dict(mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    ignored = _routing_biases(model)
    if ignored:
        if "ignored_params" not in inspect.signature(fully_shard).parameters:
            raise ValueError("this torch's fully_shard has no ignored_params (needed to keep the MoE routing bias "
                             "replicated); use torch >= 2.7")
        kw["ignored_params"] = ignored
    if activation_checkpointing:
        if not hasattr(model, "gradient_checkpointing_enable"):
            raise ValueError("activation_checkpointing needs a model with gradient_checkpointing_enable()")
        model.gradient_checkpointing_enable(True)
    fully_shard(model.model.embed_tokens, **kw)
    for layer in layers:
        fully_shard(layer, **kw)
    fully_shard(model.lm_head, **kw)
    fully_shard(model, **kw)
    return model


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def allreduce_gradients(params: list[torch.Tensor], group: Any = None) -> None:
    """Average the gradients of replicated parameters over `group`; a parameter without a gradient
    on this rank counts as zeros (every rank issues the same collectives)."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    # one flat buffer per dtype: few collectives
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for gs in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in gs])
        dist.all_reduce(flat, group=group)
        flat.div_(world)
        at = 0
        for g in gs:
            n = g.numel()
            g.copy_(flat[at:at + n].view_as(g))
            at += n


def sync_expert_load(expert_load: torch.Tensor, group: Any = None) -> torch.Tensor:
    """The expert load summed over the ranks (so that every replica's routing bias moves alike)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return expert_load
    x = expert_load.detach().float().clone()
    dist.all_reduce(x, group=group)
    return x


def full_norm(x: torch.Tensor) -> torch.Tensor:
    """A norm returned by clip_grad_norm_ as a plain tensor (a DTensor under FSDP2 is made whole)."""
    full = getattr(x, "full_tensor", None)
    return full() if callable(full) else x
