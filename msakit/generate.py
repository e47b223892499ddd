"""Sampling with a simple contiguous KV cache (msakit's reference generation loop).

`KVCache` keeps, per layer, K and V [B, max_len, G, D] and, for MSA layers, the index keys
[B, max_len, Di].  `generate` prefills the prompt in one forward, then feeds one token per step;
in sparse mode every decode step selects blocks with the indexer over all cached index keys and
attends the selected blocks only (see `msakit.models.modeling.attend_cached`).

Sampling: temperature 0 is greedy (argmax); otherwise logits / temperature, then top-k, then
top-p (nucleus) filtering, then one draw from `torch.multinomial` with the given
`torch.Generator` (same seed -> same tokens).  The streamer gets each step's new tokens: a
callable is called as `streamer(tokens [B])`; an object with `put` / `end` (the transformers
streamer protocol, e.g. TextStreamer for B == 1) gets `put(tokens on CPU)` per step and `end()`
once at the end (the prompt is not sent).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

__all__ = ["KVCache", "sample_next", "generate", "generate_uncached"]


class KVCache:
    """Contiguous per-layer cache; tensors are allocated at the first write (dtype/device of k)."""

    def __init__(self, num_layers: int, max_len: int) -> None:
        if num_layers < 1 or max_len < 1:
            raise ValueError(f"num_layers and max_len must be positive, got {num_layers}, {max_len}")
        self.num_layers = num_layers
        self.max_len = max_len
        self.length = 0
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.k_idx: list[torch.Tensor | None] = [None] * num_layers

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, k_idx: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Write the new positions [length, length + Tq) of `layer`; return views of all cached ones."""
        B, Tq = k.shape[:2]
        s, e = self.length, self.length + Tq
        if e > self.max_len:
            raise ValueError(f"KV cache overflow: {e} positions > max_len={self.max_len}")
        if self.k[layer] is None:
            self.k[layer] = k.new_empty((B, self.max_len) + tuple(k.shape[2:]))
            self.v[layer] = v.new_empty((B, self.max_len) + tuple(v.shape[2:]))
            if k_idx is not None:
                self.k_idx[layer] = k_idx.new_empty((B, self.max_len) + tuple(k_idx.shape[2:]))
        self.k[layer][:, s:e] = k
        self.v[layer][:, s:e] = v
        ki = None
        if k_idx is not None:
            self.k_idx[layer][:, s:e] = k_idx
            ki = self.k_idx[layer][:, :e]
        return self.k[layer][:, :e], self.v[layer][:, :e], ki

    def advance(self, n: int) -> None:
        self.length += n


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """logits [B, V] -> next tokens int64 [B]."""
    if temperature is None or temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature!r}")
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    V = logits.shape[-1]
    if top_k is not None:
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        if top_k < V:
            kth = logits.topk(top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if top_p < 1:
            srt, order = logits.sort(dim=-1, descending=True)
            cum = srt.softmax(-1).cumsum(-1)
            drop = cum - srt.softmax(-1) >= top_p  # keep the smallest prefix reaching top_p (always >= 1 token)
            drop = torch.zeros_like(drop).scatter(-1, order, drop)
            logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    dev = probs.device
    if generator is not None and generator.device != dev:
        probs = probs.to(generator.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(dev)


def _emit(streamer: Any, tokens: torch.Tensor) -> None:
    """A callable gets the new tokens [B]; an HF-style streamer object gets .put(tokens on CPU)."""
    if streamer is None:
        return
    put = getattr(streamer, "put", None)
    if callable(put):
        put(tokens.detach().cpu())
    else:
        streamer(tokens)


def _loop(
    step: Callable[[torch.Tensor | None], torch.Tensor],
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
    streamer: Callable[[torch.Tensor], Any] | None,
    eos_token_id: int | Sequence[int] | None,
    return_logits: bool,
):
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    eos = None
    if eos_token_id is not None:
        eos = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id),
                           device=input_ids.device)
    out = [input_ids]
    step_logits = []
    finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    if max_new_tokens > 0:
        logits = step(None)
        for i in range(max_new_tokens):
            if return_logits:
                step_logits.append(logits.float())
            nxt = sample_next(logits, temperature, top_k, top_p, generator)
            if eos is not None:
                nxt = torch.where(finished, eos[0], nxt)
                finished |= torch.isin(nxt, eos)
            out.append(nxt.unsqueeze(1))
            _emit(streamer, nxt)
            if i == max_new_tokens - 1 or (eos is not None and bool(finished.all())):
                break
            logits = step(nxt.unsqueeze(1))
    end = getattr(streamer, "end", None)
    if callable(end):
        end()
    tokens = torch.cat(out, dim=1)
    if return_logits:
        return tokens, (torch.stack(step_logits, dim=1) if step_logits else None)
    return tokens


def _run_eval(model: Any, make_step: Callable[[], Callable[[torch.Tensor | None], torch.Tensor]],
              input_ids: torch.Tensor, max_new_tokens: int, *loop_args: Any):
    """Check input_ids, then run _loop with make_step()'s step in eval mode (training mode restored)."""
    if input_ids.dim() != 2 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must have shape [B, T] with T >= 1, got {tuple(input_ids.shape)}")
    was_training = model.training
    model.eval()
    try:
        return _loop(make_step(), input_ids, max_new_tokens, *loop_args)
    finally:
        model.train(was_training)


@torch.no_grad()
def generate(
    model: Any,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    streamer: Callable[[torch.Tensor], Any] | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    return_logits: bool = False,
):
    """Cached generation for models with `forward_cached` (M3ForCausalLM) -> tokens [B, T + n]
    (and the per-step logits [B, n, V] with return_logits).  Stops early once every row has
    produced an eos token (finished rows repeat the first eos id)."""
    def make_step() -> Callable[[torch.Tensor | None], torch.Tensor]:
        cache = KVCache(model.config.num_hidden_layers, input_ids.shape[1] + max(max_new_tokens, 1))

        def step(new: torch.Tensor | None) -> torch.Tensor:
            return model.forward_cached(input_ids if new is None else new, cache)

        return step

    return _run_eval(model, make_step, input_ids, max_new_tokens, temperature, top_k, top_p, generator, streamer,
                     eos_token_id, return_logits)


@torch.no_grad()
def generate_uncached(
    model: Any,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    streamer: Callable[[torch.Tensor], Any] | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    return_logits: bool = False,
):
    """The same loop recomputing the whole sequence each step (any model whose forward(input_ids,
    compute_kl=False) returns .logits); the reference the cached path is tested against."""
    def make_step() -> Callable[[torch.Tensor | None], torch.Tensor]:
        seq = [input_ids]

        def step(new: torch.Tensor | None) -> torch.Tensor:
            if new is not None:
                seq.append(new)
            ids = torch.cat(seq, dim=1)
            return model(ids, compute_kl=False).logits[:, -1]

        return step

    return _run_eval(model, make_step, input_ids, max_new_tokens, temperature, top_k, top_p, generator, streamer,
                     eos_token_id, return_logits)
