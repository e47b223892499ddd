"""Lossless verification of a block of drafts (Leviathan et al. 2023; Chen et al. 2023) and
DSpark's confidence-budgeted schedule (the sampling transform is `msakit.sampling`).

`verify(draft_tokens [B, g], draft_probs [B, g, V], target_probs [B, g + 1, V])`, per row:

    for k = 1 .. g:  accept draft x_k iff  u_k * q_k(x_k) < p_k(x_k)     (u_k ~ U[0, 1), fresh)
    first rejection at k:  emit a sample of normalize(max(0, p_k - q_k)), stop
    all g accepted:        emit a bonus sample of p_(g+1)

so every emitted token is an exact sample of the target's (processed) distribution given the
tokens before it.  Requirements (DSpark's verification rules):

- q_k must be exactly the distribution x_k was drawn from: after the Markov bias, the
  temperature and the top-k / top-p truncation (`sampling_probs` on both sides);
- the uniforms and the residual / bonus draw use their own random stream (`generator`), not the
  drafter's;
- everything is float32 (bf16 probabilities are promoted before any comparison);
- a per-row verify length (``lengths``, the confidence budget) must be non-anticipating: chosen
  without looking at the drafts it cuts.  Rows then behave as if g were ``lengths[b]``.

Greedy mode (temperature 0): accept while the draft equals the target's argmax; the extra token
is the target's argmax at the first mismatch (or after the last draft).

Everything is vectorised over the batch (no Python loop over rows, no host sync).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from msakit.sampling import check_sampling, sample_probs, sampling_probs

__all__ = [
    "verify",
    "sampling_probs",
    "sample_probs",
    "check_sampling",
    "confidence_budget",
]


def _uniform(shape, device, generator: torch.Generator | None) -> torch.Tensor:
    if generator is not None and generator.device.type == "cpu" and torch.device(device).type != "cpu":
        return torch.rand(shape, generator=generator).to(device)
    return torch.rand(shape, generator=generator, device=device)


def verify(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    *,
    generator: torch.Generator | None = None,
    greedy: bool = False,
    lengths: torch.Tensor | None = None,
    uniforms: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify g drafts per row.

    draft_tokens int64 [B, g]; draft_probs [B, g, V] (row k: the exact distribution draft k was
    sampled from; ignored and may be None when greedy); target_probs [B, g + 1, V] (row k: the
    target's processed distribution of position k + 1; with greedy anything whose argmax is the
    target's choice, e.g. logits).  lengths (optional) int64 [B] in [0, g]: verify only the first
    lengths[b] drafts of row b.  uniforms float32 [B, g] in [0, 1) and noise float32 [B, V]
    (Exp(1)), optional: the acceptance uniforms and the extra token's race noise drawn beforehand
    (from the acceptance stream, e.g. outside a CUDA graph); `generator` is then not used.

    Returns (num_accepted int64 [B], tokens int64 [B, g + 1]): the accepted drafts followed by the
    one extra token (residual sample, bonus sample or greedy correction), -1 after it.
    """
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must have shape [B, g], got {tuple(draft_tokens.shape)}")
    B, g = draft_tokens.shape
    if target_probs.dim() != 3 or target_probs.shape[:2] != (B, g + 1):
        raise ValueError(f"target_probs must have shape [B, g + 1, V] = [{B}, {g + 1}, V], got {tuple(target_probs.shape)}")
    V = target_probs.shape[-1]
    dev = target_probs.device
    d = draft_tokens.to(device=dev, dtype=torch.long)
    ks = torch.arange(g, device=dev)
    if lengths is not None:
        lengths = torch.as_tensor(lengths, device=dev).long().clamp(0, g)
        in_budget = ks.unsqueeze(0) < lengths.unsqueeze(1)  # [B, g]
    else:
        in_budget = None
    if greedy:
        best = target_probs.argmax(dim=-1)  # [B, g + 1]
        acc = d == best[:, :g]
        if in_budget is not None:
            acc = acc & in_budget
        n = acc.long().cumprod(dim=1).sum(dim=1)
        extra = best.gather(1, n.unsqueeze(1)).squeeze(1)
    else:
        if draft_probs is None:
            raise ValueError("draft_probs is required unless greedy=True (the exact distribution of each draft)")
        if draft_probs.shape != (B, g, V):
            raise ValueError(f"draft_probs must have shape [B, g, V] = [{B}, {g}, {V}], got {tuple(draft_probs.shape)}")
        p = target_probs.float()
        q = draft_probs.to(device=dev, dtype=torch.float32)
        px = p[:, :g].gather(-1, d.unsqueeze(-1)).squeeze(-1)  # [B, g]
        qx = q.gather(-1, d.unsqueeze(-1)).squeeze(-1)
        if uniforms is not None:
            if uniforms.shape != (B, g):
                raise ValueError(f"uniforms must have shape [B, g] = [{B}, {g}], got {tuple(uniforms.shape)}")
            u = uniforms.to(device=dev, dtype=torch.float32)
        else:
            u = _uniform((B, g), dev, generator)
        acc = u * qx < px
        if in_budget is not None:
            acc = acc & in_budget
        n = acc.long().cumprod(dim=1).sum(dim=1)  # [B] accepted drafts
        # the distribution of the extra token: max(0, p_n - q_n) normalised, q = 0 past the
        # verified drafts (bonus = p_n itself)
        if in_budget is not None:
            q = q * in_budget.unsqueeze(-1)
        q_ext = torch.cat([q, q.new_zeros(B, 1, V)], dim=1)  # [B, g + 1, V]
        idx = n.view(B, 1, 1).expand(B, 1, V)
        p_n = p.gather(1, idx).squeeze(1)
        q_n = q_ext.gather(1, idx).squeeze(1)
        res = (p_n - q_n).clamp_min(0)
        mass = res.sum(dim=-1, keepdim=True)
        # p == q exactly (rejection then has probability 0): fall back to p, as DeepSpec does
        res = torch.where(mass > 1e-8, res, p_n)
        extra = sample_probs(res, generator, noise=noise)
    tokens = torch.where(ks.unsqueeze(0) < n.unsqueeze(1), d, torch.full_like(d, -1))
    tokens = torch.cat([tokens, d.new_full((B, 1), -1)], dim=1)
    tokens.scatter_(1, n.unsqueeze(1), extra.unsqueeze(1))
    return n, tokens


def confidence_budget(
    confidence: torch.Tensor,
    cost: Callable[[torch.Tensor], torch.Tensor] | Sequence[float] | tuple[float, float],
    *,
    max_len: int | None = None,
) -> torch.Tensor:
    """DSpark's scheduler: how many drafts of each row to verify.

    confidence [B, g]: c_k, the predicted probability that draft k survives given that drafts
    1 .. k-1 did (the confidence head).  Survival a_(r,j) = prod_(i<=j) c_(r,i).  Items (r, j) are
    admitted in order of survival (within a row always a prefix), and admission stops at the
    first item that lowers

        Theta(m) = (B + sum of the m admitted survivals) / cost(B + m)

    (expected tokens per round over the verify cost of B + m verified positions: B anchors plus m
    drafts).  Breaking at the first drop, rather than taking the global argmax of Theta, keeps
    the choice non-anticipating: whether draft j+1 is verified depends on c_(j+1), which reads
    the draft hidden state and draft j, never on draft j+1 itself, so the output stays exact.

    cost: a callable on an int64 tensor of verified positions, or a pair (fixed, per_token) for
    fixed + per_token * positions (relative units).  Returns int64 [B] lengths in [0, g].
    """
    if confidence.dim() != 2:
        raise ValueError(f"confidence must have shape [B, g], got {tuple(confidence.shape)}")
    B, g = confidence.shape
    if max_len is not None:
        g = min(g, int(max_len))
        confidence = confidence[:, :g]
    dev = confidence.device
    if g == 0:
        return torch.zeros(B, dtype=torch.long, device=dev)
    if callable(cost):
        cost_fn = cost
    else:
        fixed, per_tok = (float(x) for x in cost)
        if fixed < 0 or per_tok < 0 or fixed + per_tok <= 0:
            raise ValueError(f"cost (fixed, per_token) must be non-negative and not both 0, got {cost!r}")

        def cost_fn(n: torch.Tensor) -> torch.Tensor:
            return fixed + per_tok * n.float()

    surv = confidence.float().clamp(0, 1).cumprod(dim=1)  # [B, g], non-increasing along j
    # order by survival; the stable sort of the row-major flattening breaks ties by position j,
    # so a row is always admitted as a prefix
    order = surv.reshape(-1).argsort(descending=True, stable=True)
    s_sorted = surv.reshape(-1)[order]
    m = torch.arange(0, B * g + 1, device=dev)
    tau = B + torch.cat([s_sorted.new_zeros(1), s_sorted.cumsum(0)])  # [B*g + 1]
    theta = tau / cost_fn(B + m).to(tau.dtype)
    drop = theta[1:] <= theta[:-1]  # adding item m+1 does not raise Theta
    first = torch.where(drop.any(), drop.float().argmax(), torch.tensor(B * g, device=dev))
    admitted = torch.arange(B * g, device=dev) < first  # in sorted order
    rows = (order // g)
    return torch.zeros(B, dtype=torch.long, device=dev).index_add_(0, rows, admitted.long())
