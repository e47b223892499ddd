"""The sampling transform shared by `generate` and speculative decoding, and the two draws.

One transform of logits [..., V] (float32 throughout): temperature 0 is greedy (argmax);
otherwise logits / temperature, then top-k (keep the k largest; ties with the k-th are kept),
then top-p (keep the smallest prefix of the descending order whose probability reaches top_p,
always at least one token).  Speculative verification needs the resulting distribution for the
target and the drafter alike (`sampling_probs`); plain decoding draws from it (`sample_next`).

Draws: `sample_next` uses ``torch.multinomial`` (one draw per row, may sync the host);
`sample_probs` uses an exponential race (no host sync; its Exp(1) draws can be made beforehand,
e.g. outside a CUDA graph).  Both take an optional ``torch.Generator``; a CPU generator with CUDA
tensors draws on the CPU and moves the result.

This module imports only torch: everything that samples (the decode loop, speculative
decoding, training-data regeneration) can use it.
"""

from __future__ import annotations

import torch

__all__ = ["check_sampling", "filter_logits", "sampling_probs", "sample_next", "sample_probs", "keyword_options"]


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """ValueError naming the argument unless temperature >= 0, top_k is None or an int >= 1,
    and top_p is None or in (0, 1]."""
    if temperature is None or isinstance(temperature, bool) or not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")


def _check_logits(logits: object) -> torch.Tensor:
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() < 1:
        what = f"{logits.dtype} tensor of shape {tuple(logits.shape)}" if isinstance(logits, torch.Tensor) \
            else type(logits).__name__
        raise ValueError(f"logits must be a floating-point tensor [..., V], got {what}")
    if logits.shape[-1] < 1:
        raise ValueError(f"logits must have a non-empty last (vocabulary) dimension, got shape {tuple(logits.shape)}")
    return logits.float()


def filter_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                  top_p: float | None = None) -> torch.Tensor:
    """logits [..., V] -> float32 logits / temperature with the tokens outside top-k and top-p set
    to -inf (their softmax is the sampling distribution).  temperature must be > 0 here."""
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        raise ValueError("temperature must be > 0 for filter_logits (temperature 0 is greedy: argmax)")
    logits = _check_logits(logits) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        srt, order = logits.sort(dim=-1, descending=True)
        ps = srt.softmax(-1)
        drop = ps.cumsum(-1) - ps >= top_p  # the mass before a token already reaches top_p
        drop = torch.zeros_like(drop).scatter(-1, order, drop)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sampling_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                   top_p: float | None = None) -> torch.Tensor:
    """logits [..., V] -> float32 probabilities [..., V] of the sampler; temperature 0 gives the
    one-hot argmax distribution."""
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        x = _check_logits(logits)
        return torch.nn.functional.one_hot(x.argmax(-1), x.shape[-1]).float()
    return filter_logits(logits, temperature, top_k, top_p).softmax(dim=-1)


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B, V] -> next tokens int64 [B] on logits' device: argmax for temperature 0, else one
    ``torch.multinomial`` draw from `sampling_probs`."""
    check_sampling(temperature, top_k, top_p)
    if _check_logits(logits).dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
    if temperature == 0:
        return logits.float().argmax(dim=-1)
    probs = filter_logits(logits, temperature, top_k, top_p).softmax(dim=-1)
    dev = probs.device
    if generator is not None and generator.device != dev:
        probs = probs.to(generator.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(dev)


def sample_probs(probs: torch.Tensor, generator: torch.Generator | None = None, *,
                 noise: torch.Tensor | None = None) -> torch.Tensor:
    """One draw per row of probs [..., V] (need not be normalised) -> int64 [...].

    Exponential race: argmax(p / E) with E ~ Exp(1) i.i.d., an exact sample of p / sum(p) with no
    host sync.  Zero-probability tokens are never drawn.  noise: the Exp(1) draws E themselves
    (float32, probs' shape), drawn beforehand; then `generator` is not used."""
    if not isinstance(probs, torch.Tensor) or probs.dim() < 1:
        raise ValueError(f"probs must be a tensor [..., V], got {type(probs).__name__}")
    if noise is not None:
        if noise.shape != probs.shape:
            raise ValueError(f"noise must have the shape of probs {tuple(probs.shape)}, got {tuple(noise.shape)}")
        e = noise
    elif generator is not None and generator.device.type == "cpu" and probs.device.type != "cpu":
        e = torch.empty(probs.shape, dtype=torch.float32).exponential_(generator=generator).to(probs.device)
    else:
        e = torch.empty(probs.shape, dtype=torch.float32, device=probs.device).exponential_(generator=generator)
    # an Exp(1) draw can be exactly 0 (u = 0 in float32): clamp, so that a zero-probability token
    # scores 0 (never NaN, which argmax would pick) and a positive one stays finite
    score = probs.float() / e.clamp_min(torch.finfo(torch.float32).tiny)
    return score.argmax(dim=-1)


def keyword_options(given: dict, defaults: dict, where: str) -> dict:
    """`defaults` updated by `given` (a function's **options), in the defaults' order; ValueError
    naming `where` and the allowed names for an unknown option."""
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ValueError(f"{where} takes {', '.join(defaults)}; got {', '.join(unknown)}")
    return {k: given.get(k, v) for k, v in defaults.items()}
