"""Greedy generation under the evaluation's policies (RULER's tasks are scored on generated text).

`greedy_generate(model, prompt_ids, max_new_tokens, stop=...)` runs one forward over the prompt and
one single-token forward per new token, in whatever attention mode and selection policy the model
was put (`msakit.eval.runner.configure_model`):

- HF-backed models (`msakit.models.hf.HFModelWrapper`: converted `MSAWrappedModel`, the policy
  wrapper `HFPolicyModel`) decode with transformers' own `DynamicCache`: their attention handlers
  receive the held keys and call the policy on the new query against them (the core's
  queries-at-the-end path), so dense, window, window0, oracle and msa all apply at every step;
- any other model (msakit's `M3ForCausalLM`, test models) is called on the whole sequence at every
  step (no cache; exact for every policy, quadratic in the answer's length): a warning says so once.

Layouts: prompt ids are a list of ints (batch 1); the logits of the last position pick the next
token (argmax, ties to the lower id as `torch.argmax`).
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Callable, Sequence

import torch

from msakit.eval.scoring import model_logits
from msakit.models.hf import HFModelWrapper

__all__ = ["greedy_generate"]

_WARNED: set[str] = set()


def _device(model: Any) -> torch.device:
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration, TypeError):
        return torch.device("cpu")


def greedy_generate(model: Any, prompt_ids: Sequence[int], max_new_tokens: int, *,
                    eos_ids: Sequence[int] = (), stop: Callable[[list[int]], bool] | None = None) -> list[int]:
    """Greedy continuation of `prompt_ids` (at most `max_new_tokens` tokens; ends after an `eos_ids`
    token, which is kept, or once ``stop(new_ids)`` is true)."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if len(prompt_ids) < 1:
        raise ValueError("prompt_ids must hold at least one token")
    eos = {int(t) for t in eos_ids}
    dev = _device(model)
    x = torch.tensor([list(prompt_ids)], dtype=torch.long, device=dev)
    new: list[int] = []
    with torch.no_grad():
        if isinstance(model, HFModelWrapper):
            from transformers import DynamicCache  # optional dependency: HF-backed models only

            # transformers renamed past_key_values to cache (5.2x); either reaches the attention handlers
            name = "cache" if "cache" in inspect.signature(model.hf.forward).parameters else "past_key_values"
            kw = {name: DynamicCache()}
            inp = x
            for _ in range(max_new_tokens):
                out = model.hf(input_ids=inp, use_cache=True, logits_to_keep=1, **kw)
                nxt = int(out.logits[0, -1].argmax())
                new.append(nxt)
                if nxt in eos or (stop is not None and stop(new)):
                    break
                inp = torch.tensor([[nxt]], dtype=torch.long, device=dev)
            return new
        name = type(model).__name__
        if name not in _WARNED:
            _WARNED.add(name)
            warnings.warn(f"greedy_generate: {name} has no cached path here; every new token reruns the whole "
                          "sequence", stacklevel=2)
        for _ in range(max_new_tokens):
            nxt = int(model_logits(model, x)[0, -1].argmax())
            new.append(nxt)
            if nxt in eos or (stop is not None and stop(new)):
                break
            x = torch.cat([x, torch.tensor([[nxt]], dtype=torch.long, device=dev)], dim=1)
    return new
