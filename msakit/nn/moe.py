"""M3's mixture of experts: an FP32 sigmoid router with a routing-correction bias, grouped routed
experts (SwiGLU-OAI) and one shared expert.

Routing (DeepSeek-V3 style, auxiliary-loss-free; transformers `MiniMaxM3VLTopKRouter`):

    s      = sigmoid(x @ gate.T)                      float32 (router weight and math in fp32)
    chosen = top_k(s + e_score_correction_bias)       the bias only steers the choice
    w      = s[chosen] / sum(s[chosen]) * routed_scaling_factor      (un-biased scores)
    y      = sum_e w_e * expert_e(x) + shared_experts(x)

The bias is a parameter with `requires_grad=False`, updated outside the optimizer by
`update_routing_bias` (bias += rate * sign(mean_load - load)).

Routed experts are stored stacked (`experts.w1` / `w3` [E, I, H], `w2` [E, H, I]: gate / up /
down, the HF per-expert `experts.{e}.w1/w3/w2` weights) and run grouped: the token-expert pairs
are sorted by expert and each projection is one grouped matmul (`torch._grouped_mm` where its
alignment rules hold, else one padded `bmm` over experts).  No Python loop over experts.  Without
autograd on CUDA, at most `FEW_PAIRS` (token, expert) pairs (decoding) skip the sort and run
`msakit.ops.moe.routed_experts`: two kernels that read each pair's expert rows directly.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from msakit.nn.mlp import SwiGLUMLP, swiglu_oai
from msakit.ops.dispatch import use_triton
from msakit.ops.moe import routed_experts

__all__ = ["route", "grouped_mm", "grouped_mm_ok", "grouped_mm_failed", "grouped_mm_trial", "compute_dtype", "GroupedExperts", "MoE",
           "FEW_PAIRS"]

# Most (token, expert) pairs of a call that run `routed_experts` (each pair reads its expert's
# rows; beyond a few dozen pairs the sorted grouped matmuls read each expert once).
FEW_PAIRS = 64


def route(
    logits: torch.Tensor,
    top_k: int,
    *,
    bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    norm_topk_prob: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid top-k routing.  logits [N, E] -> (weights float32 [N, k], expert ids int64 [N, k]).

    The bias (if any) is added to the sigmoid scores for the choice only; the weights are the
    chosen un-biased scores, renormalised to sum 1 when `norm_topk_prob`, times the scaling factor.
    """
    scores = torch.sigmoid(logits.float())
    choice = scores if bias is None else scores + bias.float()
    idx = choice.topk(top_k, dim=-1).indices
    w = scores.gather(-1, idx)
    if norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * routed_scaling_factor, idx


def _aligned(n: int, t: torch.Tensor) -> bool:
    return (n * t.element_size()) % 16 == 0


def grouped_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """True when `torch._grouped_mm` can multiply x [M, K] by w [E, K, N] (dtype, device, alignment)."""
    if not hasattr(torch, "_grouped_mm") or x.device.type not in ("cuda", "cpu"):
        return False
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or x.dtype != w.dtype:
        return False
    # CUDA (torch 2.11) needs 16-byte aligned strides for both operands; CPU (2.13) has no such rule
    return _aligned(w.shape[1], x) and _aligned(w.shape[2], x)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, offs: torch.Tensor | None = None) -> torch.Tensor:
    """Segment matmul: x [M, K] sorted by group (group e owns `counts[e]` consecutive rows),
    w [E, K, N] (any strides) -> [M, N] with rows of group e multiplied by w[e].

    `torch._grouped_mm` when available and aligned; otherwise a padded bmm over the experts
    (capacity = the largest group; one host sync for that size).
    """
    if offs is None:
        offs = counts.cumsum(0).to(torch.int32)
    if x.dtype != torch.bfloat16 and torch.compiler.is_compiling():
        # torch._grouped_mm's fake (meta) kernel takes bf16 only: under torch.compile other dtypes
        # multiply each row by its group's weight, gathered (no host sync, any M)
        grp = torch.repeat_interleave(torch.arange(w.shape[0], device=x.device), counts.long(),
                                      output_size=x.shape[0])
        return torch.bmm(x.unsqueeze(1), w.index_select(0, grp).to(x.dtype)).squeeze(1)
    key = (x.device.type, x.dtype)
    if key not in grouped_mm_failed and grouped_mm_ok(x, w):
        try:
            return torch._grouped_mm(x.contiguous(), w, offs=offs)
        except (RuntimeError, NotImplementedError):  # e.g. a build without this device's kernel
            grouped_mm_failed.add(key)
    return _padded_bmm(x, w, counts, offs)


# (device type, dtype) pairs where torch._grouped_mm raised: grouped_mm uses the padded bmm there.
grouped_mm_failed: set[tuple[str, torch.dtype]] = set()


@contextlib.contextmanager
def grouped_mm_trial() -> Iterator[None]:
    """A trial run (a CUDA-graph warm-up under a sync check): a failure of torch._grouped_mm
    inside it does not mark that kernel failed for good."""
    saved = set(grouped_mm_failed)
    try:
        yield
    finally:
        grouped_mm_failed.intersection_update(saved)


def _padded_bmm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    E = w.shape[0]
    M = x.shape[0]
    if M == 0:
        return x.new_zeros(0, w.shape[2])
    cap = int(counts.max())
    starts = offs.long() - counts.long()
    grp = torch.repeat_interleave(torch.arange(E, device=x.device), counts.long(), output_size=M)
    slot = torch.arange(M, device=x.device) - starts[grp]
    flat = grp * cap + slot
    xp = x.new_zeros(E * cap, x.shape[1]).index_copy(0, flat, x).view(E, cap, x.shape[1])
    y = torch.bmm(xp, w.to(x.dtype))
    return y.reshape(E * cap, -1).index_select(0, flat)


class GroupedExperts(nn.Module):
    """E SwiGLU-OAI experts with stacked weights w1 (gate) / w3 (up) [E, I, H] and w2 (down) [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, alpha: float = 1.702,
                 limit: float = 7.0) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.alpha = float(alpha)
        self.limit = float(limit)
        self.w1 = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.w3 = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1, w3, w2) as used by forward: the hook for fake-quantization (QAT) wrappers."""
        return self.w1, self.w3, self.w2

    def forward(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """xs [M, H] sorted by expert (counts[e] rows for expert e) -> [M, H]."""
        w1, w3, w2 = self.expert_weights()
        dt = compute_dtype(xs, w1)
        x = xs.to(dt)
        offs = counts.cumsum(0).to(torch.int32)
        g = grouped_mm(x, w1.to(dt).transpose(1, 2), counts, offs)
        u = grouped_mm(x, w3.to(dt).transpose(1, 2), counts, offs)
        h = swiglu_oai(g, u, self.alpha, self.limit)
        return grouped_mm(h, w2.to(dt).transpose(1, 2), counts, offs)

    def uses_pairs(self, x: torch.Tensor, k: int) -> bool:
        """Whether `forward_pairs` serves x [N, H] with k experts per token: CUDA (the kernel),
        N * k <= FEW_PAIRS and no autograd through x or the weights."""
        if x.shape[0] * k > FEW_PAIRS or x.shape[0] == 0 or not use_triton("routed_experts", "auto", x.device):
            return False
        return not (torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters())))

    def forward_pairs(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [N, H], idx / w [N, k] -> float32 [N, H] = sum_j w[n, j] expert_{idx[n, j]}(x[n]), unsorted
        (`msakit.ops.moe.routed_experts`, in the experts' compute dtype)."""
        w1, w3, w2 = self.expert_weights()
        return routed_experts(x.to(compute_dtype(x, w1)), idx, w, w1, w3, w2, alpha=self.alpha, limit=self.limit)

    def forward_naive(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Reference: a Python loop over experts (tests only).  x [N, H], idx/w [N, k] -> [N, H]."""
        out = torch.zeros_like(x, dtype=torch.float32)
        for e in range(self.num_experts):
            tok, slot = torch.where(idx == e)
            if tok.numel() == 0:
                continue
            xe = x[tok]
            h = swiglu_oai(xe @ self.w1[e].T, xe @ self.w3[e].T, self.alpha, self.limit) @ self.w2[e].T
            out.index_add_(0, tok, (h * w[tok, slot].unsqueeze(-1)).float())
        return out.to(x.dtype)

    def reset_parameters(self, std: float = 0.02, out_std: float | None = None) -> None:
        nn.init.normal_(self.w1, std=std)
        nn.init.normal_(self.w3, std=std)
        nn.init.normal_(self.w2, std=std if out_std is None else out_std)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
                f"alpha={self.alpha}, limit={self.limit}")


def compute_dtype(x: torch.Tensor, w: torch.Tensor) -> torch.dtype:
    """The dtype the experts compute in for input `x` and weight `w`: autocast's dtype where
    autocast is on for x's device, else w's dtype."""
    dev = x.device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return w.dtype


class MoE(nn.Module):
    """M3 `block_sparse_moe`: gate (fp32 router), e_score_correction_bias, experts, shared_experts.

    forward(x [..., H]) -> (y [..., H], load float32 [E]: tokens routed to each expert).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, *,
                 shared_intermediate_size: int = 0, routed_scaling_factor: float = 1.0, norm_topk_prob: bool = True,
                 use_routing_bias: bool = True, alpha: float = 1.702, limit: float = 7.0) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.norm_topk_prob = bool(norm_topk_prob)
        self.gate = nn.Linear(hidden_size, num_experts, bias=False, dtype=torch.float32)
        if use_routing_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32), requires_grad=False)
        else:
            self.e_score_correction_bias = None
        self.experts = GroupedExperts(num_experts, hidden_size, intermediate_size, alpha=alpha, limit=limit)
        self.shared_experts = (
            SwiGLUMLP(hidden_size, shared_intermediate_size, alpha=alpha, limit=limit) if shared_intermediate_size > 0 else None
        )

    # The router weight and bias stay float32 whatever `.to(dtype)` / `.half()` does to the rest.
    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        super()._apply(fn, recurse)
        for p in (self.gate.weight, self.e_score_correction_bias):
            if p is not None and p.is_floating_point() and p.dtype != torch.float32:
                p.data = p.data.float()
        return self

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, H] -> float32 [N, E], computed in fp32 (autocast off)."""
        off = torch.autocast(x.device.type, enabled=False) if x.device.type in ("cuda", "cpu") else contextlib.nullcontext()
        with off:
            return F.linear(x.float(), self.gate.weight.float())

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (weights float32 [N, k], expert ids [N, k])."""
        return route(
            self.router_logits(x), self.top_k, bias=self.e_score_correction_bias,
            routed_scaling_factor=self.routed_scaling_factor, norm_topk_prob=self.norm_topk_prob,
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        N, k = xf.shape[0], self.top_k
        w, idx = self.route(xf)
        flat_e = idx.reshape(-1)
        # not torch.bincount: on CUDA it reads the largest id on the host (a sync per layer, and
        # no CUDA-graph capture of a decode step); integer scatter-adds give the same counts
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=flat_e.device).scatter_add_(
            0, flat_e, torch.ones_like(flat_e))
        if self.experts.uses_pairs(xf, k):
            y = self.experts.forward_pairs(xf, idx, w)
        else:
            order = flat_e.argsort(stable=True)
            h = self.experts(xf[order // k], counts)  # [N*k, H], sorted by expert
            # un-sort (a permutation: a plain gather, no atomics) and sum each token's k outputs in
            # float32 in a fixed order, so the forward is deterministic on GPU too
            inv = torch.empty_like(order)
            inv[order] = torch.arange(order.numel(), device=order.device)
            h = h.index_select(0, inv).view(N, k, -1).float()
            y = (h * w.unsqueeze(-1)).sum(dim=1)
        if self.shared_experts is not None:
            y = y + self.shared_experts(xf).to(y.dtype)
        return y.to(x.dtype).reshape(shape), counts.detach().float()

    def capture_blocker(self) -> str | None:
        """Why this MoE's forward would sync with the host (no CUDA-graph capture), or None: the
        experts' grouped GEMMs would take the padded-bmm fallback (its capacity is read on the host).
        Expert subclasses (QAT, packed) are checked by the capture's warm-up instead."""
        ex = self.experts
        if type(ex) is not GroupedExperts:
            return None
        dt = compute_dtype(ex.w1.new_empty(0), ex.w1)  # GroupedExperts.forward's compute dtype
        x = torch.empty(0, ex.hidden_size, dtype=dt, device=ex.w1.device)
        ws = [torch.empty(w.shape, dtype=dt, device="meta").transpose(1, 2) for w in (ex.w1, ex.w3, ex.w2)]
        if (x.device.type, dt) in grouped_mm_failed or not all(grouped_mm_ok(x, w) for w in ws):
            return ("the MoE experts would use the padded-bmm fallback of grouped_mm (int(counts.max()): a host "
                    "sync) instead of torch._grouped_mm")
        return None

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor, rate: float = 1e-3) -> None:
        """Auxiliary-loss-free balancing: bias += rate * sign(mean(load) - load)."""
        if self.e_score_correction_bias is None:
            return
        load = load.to(self.e_score_correction_bias.device, torch.float32)
        self.e_score_correction_bias.add_(rate * torch.sign(load.mean() - load))

    def reset_parameters(self, std: float = 0.02, out_std: float | None = None) -> None:
        nn.init.normal_(self.gate.weight, std=std)
        if self.e_score_correction_bias is not None:
            nn.init.zeros_(self.e_score_correction_bias)
        self.experts.reset_parameters(std, out_std)
        if self.shared_experts is not None:
            self.shared_experts.reset_parameters(std, out_std)

