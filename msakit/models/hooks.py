"""Attaching msakit to modules it did not build: one mechanism for converted HF models,
evaluation policies and QAT.

- **State**: `attach(module, key, value)` / `attached(module, key)` / `detach(module, key)` keep
  msakit's objects in one namespaced slot of the module (``module.__dict__["_msakit"]``, an
  `Attachments`): never a submodule, a parameter or a state-dict entry; copied with the module.
  Any object with a ``__dict__`` takes attachments too (an HF cache keeps the index keys so).
- **Classes**: `swap_class(module, cls)` changes a module's class (same parameters and state
  dict) and `restore_class(module)` gives the original back.
- **Hooks**: `add_hook(module, key, fn, pre=...)` registers a forward hook or pre-hook under a
  key; `remove_hooks(module, key)` removes exactly those (also in a deep copy of the module).
- **transformers attention**: ONE attention function, registered once with transformers under
  the name `ATTN_IMPL`, dispatches each call to the handler installed on the calling attention
  module (`set_attention_handler`), or to transformers' SDPA attention where there is none.
  `use_msakit_attention(hf_model)` switches an HF model to it.  A handler is called as
  ``handler(module, query, key, value, attention_mask, **kwargs) -> (out [B, T, Hq, D], None)``
  with transformers' layouts (query [B, Hq, T, D], key / value [B, G, Tk, D], after RoPE).

transformers is an optional dependency (msakit[hf]) and slow to import: it is imported inside
the functions that register with it or call into it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = [
    "ATTN_IMPL",
    "AttentionHandler",
    "Attachments",
    "add_hook",
    "attach",
    "attached",
    "attention_handler",
    "detach",
    "hf_sdpa_attention",
    "register_attention",
    "remove_hooks",
    "restore_class",
    "set_attention_handler",
    "swap_class",
    "use_msakit_attention",
]

SLOT = "_msakit"
ATTN_IMPL = "msakit"  # the transformers attention implementation (`attn_implementation`) of every handler
HANDLER_KEY = "attention_handler"

# handler(module, query, key, value, attention_mask, **kwargs) -> (out, weights)
AttentionHandler = Callable[..., tuple[torch.Tensor, Any]]


@dataclass
class Attachments:
    """What msakit attached to one module: values by key, the hooks it registered by key, and
    the (original, swapped-in) classes of a `swap_class`."""

    values: dict[str, Any] = field(default_factory=dict)
    hooks: dict[str, list[RemovableHandle]] = field(default_factory=dict)
    swapped: tuple[type, type] | None = None


def _slot(module: nn.Module, create: bool = True) -> Attachments | None:
    slot = module.__dict__.get(SLOT)
    if slot is None and create:
        slot = module.__dict__[SLOT] = Attachments()
    return slot


def _drop_if_empty(module: nn.Module) -> None:
    slot = module.__dict__.get(SLOT)
    if slot is not None and not slot.values and not slot.hooks and slot.swapped is None:
        del module.__dict__[SLOT]


def attach(module: nn.Module, key: str, value: Any) -> Any:
    """Keep `value` on `module` under `key` (replacing what was there); returns `value`."""
    _slot(module).values[key] = value
    return value


def attached(module: nn.Module, key: str, default: Any = None) -> Any:
    """What `attach` kept on `module` under `key` (`default` when nothing)."""
    slot = module.__dict__.get(SLOT)
    return default if slot is None else slot.values.get(key, default)


def detach(module: nn.Module, key: str) -> Any:
    """Remove and return what `module` holds under `key` (None when nothing)."""
    slot = _slot(module, create=False)
    if slot is None:
        return None
    value = slot.values.pop(key, None)
    _drop_if_empty(module)
    return value


def swap_class(module: nn.Module, cls: type) -> None:
    """Make `module` an instance of `cls` (a subclass of its class with the same parameters),
    remembering the original class for `restore_class`."""
    base = type(module)
    if not issubclass(cls, base):
        raise ValueError(f"cannot swap a {base.__name__} for {cls.__name__}, which is not a subclass of it")
    slot = _slot(module)
    if slot.swapped is not None:
        raise ValueError(f"the {base.__name__} is already swapped (from {slot.swapped[0].__name__})")
    slot.swapped = (base, cls)
    module.__class__ = cls


def restore_class(module: nn.Module) -> bool:
    """Undo `swap_class` on `module`; returns whether it had been swapped."""
    slot = _slot(module, create=False)
    if slot is None or slot.swapped is None:
        return False
    base, cls = slot.swapped
    if type(module) is not cls:
        raise ValueError(f"{type(module).__name__}: the class changed after it was swapped to {cls.__name__}")
    module.__class__ = base
    slot.swapped = None
    _drop_if_empty(module)
    return True


def add_hook(module: nn.Module, key: str, fn: Callable[..., Any], *, pre: bool = False,
             with_kwargs: bool = False) -> RemovableHandle:
    """Register `fn` as a forward hook (pre=True: a forward pre-hook) of `module` under `key`."""
    if pre:
        handle = module.register_forward_pre_hook(fn, with_kwargs=with_kwargs)
    else:
        handle = module.register_forward_hook(fn, with_kwargs=with_kwargs)
    _slot(module).hooks.setdefault(key, []).append(handle)
    return handle


def remove_hooks(module: nn.Module, key: str) -> int:
    """Remove the hooks `add_hook` registered on `module` under `key`; returns how many."""
    slot = _slot(module, create=False)
    handles = [] if slot is None else slot.hooks.pop(key, [])
    for h in handles:
        h.remove()
    _drop_if_empty(module)
    return len(handles)


# ---------------------------------------------------------------------------------------------
# transformers' attention interface
# ---------------------------------------------------------------------------------------------

_registered: list[str] = []


def hf_sdpa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """transformers' own SDPA attention (what an HF model computes without msakit)."""
    # transformers: optional dependency, imported when an HF model runs (see the module docstring)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def attention_handler(module: nn.Module) -> AttentionHandler | None:
    """The handler installed on an attention module (None: transformers' SDPA attention)."""
    return attached(module, HANDLER_KEY)


def _dispatch(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    handler = attached(module, HANDLER_KEY)
    if handler is None:
        return hf_sdpa_attention(module, query, key, value, attention_mask, **kwargs)
    return handler(module, query, key, value, attention_mask, **kwargs)


def register_attention() -> str:
    """Register the dispatching attention function with transformers (once); returns its name."""
    if not _registered:
        # transformers: optional dependency, imported at registration (see the module docstring)
        from transformers import AttentionInterface

        AttentionInterface.register(ATTN_IMPL, _dispatch)
        _registered.append(ATTN_IMPL)
    return ATTN_IMPL


def set_attention_handler(module: nn.Module, handler: AttentionHandler | None) -> None:
    """Install `handler` on an HF attention module (None: back to transformers' SDPA)."""
    if handler is None:
        detach(module, HANDLER_KEY)
    else:
        attach(module, HANDLER_KEY, handler)


def use_msakit_attention(hf_model: nn.Module) -> None:
    """Switch an HF model to the dispatching attention function (modules without a handler keep
    computing transformers' SDPA attention)."""
    hf_model.set_attn_implementation(register_attention())
