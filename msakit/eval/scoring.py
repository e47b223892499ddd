"""Scores from one forward's logits: teacher-forced answer accuracy and per-position loss.

Layouts: logits [B, T, V] (any float dtype; reductions in float32), input_ids [B, T] int64.
Position t's logits predict token t + 1.
"""

from __future__ import annotations

import inspect
from typing import Any, Sequence

import torch

__all__ = [
    "answer_scores", "bucket_edges", "bucket_label", "bucket_start", "bucket_sums", "model_logits", "token_nll",
]


def _takes_compute_kl(model: Any) -> bool:
    fwd = getattr(model, "forward", model)
    try:
        return "compute_kl" in inspect.signature(fwd).parameters
    except (TypeError, ValueError):
        return False


def model_logits(model: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """`model(input_ids).logits` (or a plain tensor / tuple's first item) -> [B, T, V].

    A forward with a `compute_kl` argument (msakit models) is called with compute_kl=False: the
    indexer's KL term is a training signal, not needed for scores."""
    out = model(input_ids, compute_kl=False) if _takes_compute_kl(model) else model(input_ids)
    logits = getattr(out, "logits", None)
    if logits is None:
        logits = out[0] if isinstance(out, (tuple, list)) else out
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or logits.shape[:2] != input_ids.shape:
        raise ValueError(f"the model's forward must give logits [B, T, V] for input_ids {tuple(input_ids.shape)}, "
                         f"got {getattr(logits, 'shape', type(logits).__name__)}")
    return logits


def _check(logits: torch.Tensor, input_ids: torch.Tensor) -> None:
    if logits.dim() != 3 or input_ids.dim() != 2 or logits.shape[:2] != input_ids.shape:
        raise ValueError(f"logits must be [B, T, V] matching input_ids [B, T]; got {tuple(logits.shape)} and "
                         f"{tuple(input_ids.shape)}")


def answer_scores(logits: torch.Tensor, input_ids: torch.Tensor, answer_start: Sequence[int]) -> list[dict[str, Any]]:
    """Teacher-forced scoring of each row's answer ``input_ids[b, answer_start[b]:]``.

    exact: the argmax of logits[b, t - 1] equals input_ids[b, t] for every answer position t
    (what greedy decoding of the answer gives); correct: how many answer tokens match;
    nll: the answer's mean negative log-likelihood; pred: the argmax token ids."""
    _check(logits, input_ids)
    B, T = input_ids.shape
    if len(answer_start) != B:
        raise ValueError(f"answer_start must have one entry per row ({B}), got {len(answer_start)}")
    res = []
    for b, a in enumerate(answer_start):
        a = int(a)
        if not 1 <= a < T:
            raise ValueError(f"answer_start[{b}]={a} must lie in [1, {T})")
        lg = logits[b, a - 1:T - 1].detach().float()
        tgt = input_ids[b, a:T].to(lg.device)
        pred = lg.argmax(-1)
        hit = pred == tgt
        nll = torch.nn.functional.cross_entropy(lg, tgt, reduction="mean")
        res.append(dict(exact=bool(hit.all()), correct=int(hit.sum()), answer_tokens=int(T - a), nll=float(nll),
                        pred=[int(x) for x in pred.tolist()]))
    return res


def token_nll(logits: torch.Tensor, input_ids: torch.Tensor, *, chunk: int = 1024) -> torch.Tensor:
    """Per-token NLL float32 [B, T - 1]: entry t is -log p(input_ids[:, t + 1] | ..t) (chunked over t)."""
    _check(logits, input_ids)
    B, T, V = logits.shape
    out = torch.empty(B, T - 1, dtype=torch.float32, device=logits.device)
    tgt = input_ids[:, 1:].to(logits.device)
    for t0 in range(0, T - 1, chunk):
        t1 = min(T - 1, t0 + chunk)
        lg = logits[:, t0:t1].detach().float()
        out[:, t0:t1] = torch.nn.functional.cross_entropy(
            lg.reshape(-1, V), tgt[:, t0:t1].reshape(-1), reduction="none").view(B, t1 - t0)
    return out


def bucket_edges(length: int, first: int = 512) -> list[int]:
    """Position bucket edges 0, first, 2 * first, ... up to `length` (the last edge is `length`)."""
    if length < 2:
        raise ValueError(f"length must be >= 2, got {length}")
    edges = [0]
    e = first
    while e < length:
        edges.append(e)
        e *= 2
    return edges + [length]


def bucket_label(lo: int, hi: int) -> str:
    f = lambda n: f"{n // 1024}K" if n % 1024 == 0 and n else str(n)  # noqa: E731
    return f"{f(lo)}-{f(hi)}"


def bucket_start(label: str) -> int:
    """The first position of a `bucket_label` ("512-1K" -> 512), for ordering labels."""
    lo = label.split("-", 1)[0]
    return int(lo[:-1]) * 1024 if lo.endswith("K") else int(lo)


def bucket_sums(nll: torch.Tensor, positions: torch.Tensor, edges: Sequence[int]) -> dict[str, list[float]]:
    """Sum and count of `nll` [N] by the bucket of each predicted token's position `positions` [N].

    Returns {label: [sum, count]} for the buckets [edges[i], edges[i + 1]) that hold any token."""
    if nll.shape != positions.shape or nll.dim() != 1:
        raise ValueError(f"nll and positions must be 1-D of the same shape, got {tuple(nll.shape)} and "
                         f"{tuple(positions.shape)}")
    out: dict[str, list[float]] = {}
    nll = nll.double().cpu()
    positions = positions.cpu()
    for lo, hi in zip(edges[:-1], edges[1:]):
        m = (positions >= lo) & (positions < hi)
        n = int(m.sum())
        if n:
            out[bucket_label(lo, hi)] = [float(nll[m].sum()), n]
    return out
