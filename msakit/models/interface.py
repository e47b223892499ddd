"""The model interface: what training, evaluation, generation and speculative decoding may call
on a model, and the forward contract's shared pieces.

Three declared protocols, each a superset of the one before:

- `SparseModel`: ``has_indexer`` (bool), ``attention_mode``, ``set_attention_mode("dense" |
  "sparse")``: a model that can switch its attention to the selected blocks;
- `SelectionModel`: + ``set_selection_policy(fn | None)``, ``fn(layer_idx, q [B,T,Hq,D], k
  [B,T,G,D], q_idx, k_idx, sel) -> block_idx int32 [B, G, T, K]`` (evaluation's policies;
  `msakit.eval.HFPolicyModel` has this much, with ``has_indexer = False``);
- `MSAModel`: + the training / generation interface: ``forward(...) -> M3Output``,
  ``set_kl_tokens``, ``index_parameters``, ``update_routing_bias``,
  ``gradient_checkpointing_enable``, ``save_pretrained`` (`M3ForCausalLM`, and
  `msakit.models.hf.MSAWrappedModel` for converted HF models).

The protocols are structural (``isinstance(model, SelectionModel)`` checks the members; a
method set to None does not count).

The forward contract, written once for every `MSAModel`:

    call = begin_forward(input_ids, labels, positions, cu_seqlens, compute_kl, return_attn_inputs,
                         cache, logits_to_keep)   # checks; documents and positions; cache.begin
    ... the layers, with call.positions, call.segments, call.cache, call.compute_kl ...
    return end_forward(call, logits, labels=labels, kls=..., expert_load=..., attn_inputs=...)
                                                  # cache.end, or KL sum, LM loss, M3Output

Packed batches: `cu_seqlens` (int32 [ndocs + 1], B == 1) splits the sequence into documents;
positions restart per document and the LM loss never crosses a document boundary (the target of
a document's last token, the next document's first token, is ignored).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from msakit.cache.base import KVCacheProtocol
from msakit.nn.attention import INDEX_MODULES, KL_TOKENS, MODES

__all__ = [
    "ForwardCall",
    "M3Output",
    "MSAModel",
    "SelectionModel",
    "SelectionPolicy",
    "SparseModel",
    "begin_forward",
    "check_kl_tokens",
    "check_mode",
    "check_policy",
    "document_segments",
    "end_forward",
    "index_parameters",
    "lm_loss",
    "segment_positions",
]

# fn(layer_idx, q [B,T,Hq,D], k [B,T,G,D], q_idx or None, k_idx or None, sel: Selection) -> block_idx [B,G,T,K]
SelectionPolicy = Callable[..., torch.Tensor]


@dataclass
class M3Output:
    """What an `MSAModel`'s forward returns: logits [B, T, V] (or the last `logits_to_keep`
    positions), the mean LM loss (with labels), the sum of the layers' index KL terms,
    expert_load [n_moe, E], per-layer attention inputs (return_attn_inputs), the residual stream
    (output_hidden_states) and the tapped layers' outputs (taps)."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None
    kl: torch.Tensor | None = None
    expert_load: torch.Tensor | None = None
    attn_inputs: list[dict[str, Any]] | None = None
    hidden_states: list[torch.Tensor] | None = None
    taps: torch.Tensor | None = None


# ---------------------------------------------------------------------------------------------
# The declared interface
# ---------------------------------------------------------------------------------------------


@runtime_checkable
class SparseModel(Protocol):
    """A model whose attention switches between "dense" and "sparse" (the selected blocks)."""

    has_indexer: bool  # whether the model selects blocks itself (an index branch: the "msa" policy)

    @property
    def attention_mode(self) -> str: ...

    def set_attention_mode(self, mode: str) -> None: ...


@runtime_checkable
class SelectionModel(SparseModel, Protocol):
    """A `SparseModel` whose block selection can be replaced (evaluation's selection policies)."""

    def set_selection_policy(self, policy: SelectionPolicy | None) -> None: ...


@runtime_checkable
class MSAModel(SelectionModel, Protocol):
    """What training, generation and speculative decoding call on a model."""

    config: Any

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None, compute_kl: bool = True,
                return_attn_inputs: bool = False, output_hidden_states: bool = False, *,
                cache: KVCacheProtocol | None = None, logits_to_keep: int = 0) -> M3Output: ...

    def set_kl_tokens(self, tokens: str) -> None: ...

    def index_parameters(self) -> list[tuple[str, nn.Parameter]]: ...

    def update_routing_bias(self, expert_load: torch.Tensor, rate: float = 1e-3) -> None: ...

    def gradient_checkpointing_enable(self, enabled: bool = True) -> None: ...

    def save_pretrained(self, path: Any, **kwargs: Any) -> None: ...


def check_mode(mode: str) -> str:
    """`mode` if it is an attention mode ("dense" or "sparse"), else ValueError."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return mode


def check_kl_tokens(tokens: str) -> str:
    """`tokens` if it names the KL's tokens ("selected" or "all"), else ValueError."""
    if tokens not in KL_TOKENS:
        raise ValueError(f"tokens must be one of {KL_TOKENS}, got {tokens!r}")
    return tokens


def check_policy(policy: SelectionPolicy | None) -> SelectionPolicy | None:
    """`policy` if it is callable or None, else ValueError."""
    if policy is not None and not callable(policy):
        raise ValueError(f"policy must be callable or None, got {type(policy).__name__}")
    return policy


def index_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every index-branch parameter of `model` (modules named as
    `INDEX_MODULES` under an attention module), in named_parameters() order."""
    return [(n, p) for n, p in model.named_parameters() if any(f".{m}." in f".{n}" for m in INDEX_MODULES)]


# ---------------------------------------------------------------------------------------------
# The forward contract
# ---------------------------------------------------------------------------------------------


def document_segments(cu_seqlens: torch.Tensor | Sequence[int] | None, B: int, T: int) -> list[tuple[int, int]]:
    """[(start, end)] of the documents of a packed batch ([(0, T)] without cu_seqlens)."""
    if cu_seqlens is None:
        return [(0, T)]
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cu_seqlens must be a 1-D int32 tensor, got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
        cu = [int(x) for x in cu_seqlens.tolist()]
    else:
        cu = [int(x) for x in cu_seqlens]
    if B != 1:
        raise ValueError(f"cu_seqlens needs a packed batch with B == 1, got B={B}")
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to T={T} (one entry per document boundary), got {cu[:8]}"
                         f"{'...' if len(cu) > 8 else ''}")
    return [(a, b) for a, b in zip(cu, cu[1:]) if b > a]


def segment_positions(segments: Sequence[tuple[int, int]], T: int, device: torch.device) -> torch.Tensor:
    """Positions [1, T] restarting at 0 at each document start."""
    pos = torch.arange(T, device=device)
    if len(segments) > 1:
        starts = torch.zeros(T, dtype=torch.long, device=device)
        for s, _ in segments:
            starts[s:] = s
        pos = pos - starts
    return pos.unsqueeze(0)


def lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    segments: Sequence[tuple[int, int]] | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Mean next-token cross-entropy (float32): logits[:, i] predicts labels[:, i + 1].

    Targets equal to `ignore_index` and targets at document starts (after the first) are skipped.
    With no target left the loss is 0 (still attached to the graph).
    """
    if labels.shape != logits.shape[:2]:
        raise ValueError(f"labels must have shape {tuple(logits.shape[:2])}, got {tuple(labels.shape)}")
    tgt = labels[:, 1:]
    if segments is not None and len(segments) > 1:
        tgt = tgt.clone()
        for s, _ in segments[1:]:
            tgt[:, s - 1] = ignore_index
    lg = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
    tgt = tgt.reshape(-1)
    total = F.cross_entropy(lg, tgt, ignore_index=ignore_index, reduction="sum")
    return total / (tgt != ignore_index).sum().clamp_min(1)


@dataclass
class ForwardCall:
    """One forward's resolved inputs (`begin_forward`).

    positions: [B or 1, T], or None (0 .. T-1 in every row); segments: the documents [(start,
    end)] of a full-sequence forward, None in a cached one; cache: the cache the new positions
    go to (None: a full sequence); compute_kl / want_inputs: the KL terms and the attention
    inputs are wanted (never in a cached forward)."""

    B: int
    T: int
    positions: torch.Tensor | None
    segments: list[tuple[int, int]] | None
    cache: KVCacheProtocol | None
    compute_kl: bool
    want_inputs: bool
    logits_to_keep: int


def begin_forward(input_ids: torch.Tensor, labels: torch.Tensor | None, positions: torch.Tensor | None,
                  cu_seqlens: torch.Tensor | None, compute_kl: bool, return_attn_inputs: bool,
                  cache: KVCacheProtocol | None, logits_to_keep: int) -> ForwardCall:
    """Check a forward's arguments and resolve them.  With `cache` the T tokens are new
    positions: `cache.begin` places them (their positions unless `positions` is given); no
    labels, packed documents or attention inputs then.  Without, `cu_seqlens` gives the
    documents and, unless `positions` is given, positions restarting at each document."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must have shape [B, T], got {tuple(input_ids.shape)}")
    if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or logits_to_keep < 0:
        raise ValueError(f"logits_to_keep must be an integer >= 0, got {logits_to_keep!r}")
    B, T = input_ids.shape
    if cache is not None:
        if cu_seqlens is not None or labels is not None or return_attn_inputs:
            raise ValueError("a cached forward takes no cu_seqlens, labels or return_attn_inputs")
        placed = cache.begin(B, T, input_ids.device)
        return ForwardCall(B, T, placed if positions is None else positions, None, cache, False, False,
                           logits_to_keep)
    if labels is not None and 0 < logits_to_keep < T:
        raise ValueError("labels need the logits of every position (logits_to_keep=0)")
    segments = document_segments(cu_seqlens, B, T)
    if positions is None and len(segments) > 1:
        positions = segment_positions(segments, T, input_ids.device)
    return ForwardCall(B, T, positions, segments, None, bool(compute_kl), bool(return_attn_inputs), logits_to_keep)


def end_forward(
    call: ForwardCall,
    logits: torch.Tensor,
    *,
    labels: torch.Tensor | None = None,
    kls: Sequence[torch.Tensor] = (),
    expert_load: torch.Tensor | None = None,
    attn_inputs: list[dict[str, Any]] | None = None,
    hidden_states: list[torch.Tensor] | None = None,
    taps: torch.Tensor | None = None,
) -> M3Output:
    """The M3Output of a forward.  Cached: `cache.end()`, then logits, hidden states and taps
    only.  Full sequence: kl = the sum of `kls` (0 without), expert_load (default [0, 0]), the LM
    loss over the call's documents with `labels`, the attention inputs if they were asked for."""
    if call.cache is not None:
        call.cache.end()
        return M3Output(logits=logits, hidden_states=hidden_states, taps=taps)
    dev = logits.device
    kl = torch.stack([x.float() for x in kls]).sum() if kls else torch.zeros((), device=dev)
    loss = lm_loss(logits, labels, call.segments) if labels is not None else None
    return M3Output(logits=logits, loss=loss, kl=kl,
                    expert_load=expert_load if expert_load is not None else torch.zeros(0, 0, device=dev),
                    attn_inputs=attn_inputs if call.want_inputs else None, hidden_states=hidden_states, taps=taps)
