"""`speculative_generate`: DSpark drafting + lossless verification with a rolled-back KV cache.

One round per row (state: the target's KV cache holds positions 0 .. L-1, the anchor token at
position L is emitted but not yet run through the target, the drafter's context holds the
target's tap states of positions 0 .. L-1):

1. draft: the drafter runs the block [anchor, mask x (gamma - 1)] at positions L .. L+gamma-1
   against its cached context keys / values (sliding window up to the anchor) and draws g drafts
   left to right through the Markov head (`DSparkDrafter.propose`);
2. verify: one target forward over [anchor, x_1 .. x_g] at positions L .. L+g, writing their keys
   into the cache, gives p_1 .. p_(g+1); `verify` accepts n drafts and draws one extra token;
3. roll back: the row's cache length becomes L + n + 1 (anchor + accepted drafts); the keys of
   the rejected positions stay in the buffer but are masked and overwritten next round; the tap
   states of the g + 1 verified positions are projected into the drafter's context cache the same
   way (only the first n + 1 count).  The extra token is the next anchor.

Rows advance by different amounts, so every cache has a per-row length and attention masks by
position (keys j <= the query's position, j < the row's length).  The verify forward is the
target's own forward over a `SpecCache` (`target(tokens, cache=cache, taps=...)`, the cache
behind `msakit.cache.KVCacheProtocol`), with MSA layers in sparse mode selecting blocks exactly
as `msakit.ops.index_topk`'s reference does, per row; the drafter's taps are that forward's
`out.taps`.

Sampling: temperature / top-k / top-p go through `sampling_probs` for the target and the
drafter alike, so each q is the exact distribution its draft was drawn from.  The drafter and the
verifier draw from two separate generators derived from `generator` (same seed -> same output).
Temperature 0 is greedy on both sides and reproduces plain greedy decoding token for token.

Confidence budget (optional, `confidence_budget=True`): per round, `verify.confidence_budget`
picks how many drafts of each row to verify from the confidence head (DSpark's scheduler, break
at the first drop of expected tokens per unit of verify cost); the choice never looks at the
drafts it cuts, so the output distribution stays exact.  The target forward then covers only the
longest chosen prefix + 1 (one extra host sync per round).

Rounds without the confidence budget (`_fused_rounds`): one fixed-shape function per round,
`StaticRounds.round` -- (a) the drafter block `draft_hidden(drafter, cache, anchor, lengths)`
(the context is all max_len positions with the window / length mask) and the drafts
(`propose`; sampling from race noise drawn beforehand), (b) the verify forward `target_step`:
[anchor, x_1 .. x_g] at positions lengths + i, keys written, attention over all max_len
positions masked by position (MSA: block selection over all blocks, blocks past the query
masked), logits, the tap states' context keys for the drafter (`draft_context_update`), (c)
`verify` (acceptance uniforms and the extra token's noise drawn beforehand), (d) the next
round's lengths and anchor.  It reads only static device buffers (`lengths`, `tokens`,
`active`, the noise buffers and the `SpecCache` buffers, preallocated at the prefill) and writes
`next_*` and `result`, so on CUDA it is one CUDA graph captured at its first use (warm-up on a
side stream under torch.cuda.set_sync_debug_mode("error"), capture, replay) and replayed; any
failure -> eager rounds with a one-time warning.  The randomness is drawn outside the graph from
the two streams (`exponential_` / `uniform_` into the static buffers), so graph and eager give
the same output.  The rounds are pipelined one round deep: round r + 1 is queued before round
r's [n, tokens] are read back (pinned buffer + event), so the host bookkeeping never idles the
GPU; the last queued round is discarded.  Host syncs: none beyond that readback.

With the confidence budget (`_budget_rounds`): the drafter block (a graph; greedy: with the
argmax drafts and confidences), the scheduler's verify lengths (a host sync: the verify width),
the target forward over that width (one graph per width), `verify`, the bookkeeping.

Outside the graphs: the prefill (`target_forward`, chunks of growing length) and its first
token.  `autoregressive_generate` runs its per-token forward through `target_step` the same way.

Kept across calls: the `SpecCache`, the static rounds and their captured graphs of a call come
from a per-target pool (`msakit.graphs.StatePool`) keyed by (batch, max_len rounded up, kind of
round, g, sampling settings) for the same target and drafter state (`model_state_key`), so a later
call of that shape replays the graphs without capturing again (`clear_runs` frees them; with
cuda_graph=False nothing is pooled).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from msakit.generate import paged_supported
from msakit.graphs import (
    GraphCaptureError,
    StatePool,
    capture_graph,
    graph_warning,
    model_state_key,
    round_length,
)
from msakit.ops.dispatch import triton_available
from msakit.sampling import keyword_options
from msakit.speculative.cache import SPEC_CACHE_KINDS, SpecCache
from msakit.speculative.cache import positions_check as _positions_check
from msakit.speculative.drafter import DraftProposal, DSparkDrafter
from msakit.speculative.verify import (
    check_sampling,
    sample_probs,
    sampling_probs,
    verify,
)
from msakit.speculative.verify import confidence_budget as schedule_budget

__all__ = ["speculative_generate", "autoregressive_generate", "SpecStats", "SpecCache", "target_forward",
           "draft_context_update", "draft_hidden", "target_step", "clear_runs", "StaticRounds"]


# ---------------------------------------------------------------------------------------------
# Target forward over new tokens at per-row offsets
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def target_forward(
    target,
    cache: SpecCache,
    tokens: torch.Tensor,
    taps: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run tokens [B, Tq] at positions cache.lengths[b] + i, writing their keys into `cache`
    (lengths unchanged: the caller decides how many stay).  Returns the logits [B, Tq, V] and
    the concatenated residual stream after the `taps` layers [B, Tq, len(taps) * H] (or None).
    Attention covers the first max(host lengths) + Tq positions (`target_step` covers all)."""
    B, Tq = tokens.shape
    _positions_check(cache, Tq)
    out = _target_forward(target, cache, tokens, cache.lengths, max(cache.host_lengths) + Tq, taps)
    cache.written = [h_ + Tq for h_ in cache.host_lengths]
    return out


def _target_forward(target, cache: SpecCache, tokens: torch.Tensor, lengths: torch.Tensor, Lk: int,
                    taps: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`target_forward` with the lengths [B] given as a device tensor and Lk keys attended (masked
    by position); reads no host length and updates no host state."""
    cache.place(lengths, Lk)
    out = target(tokens, cache=cache, taps=list(taps) if taps else None)
    return out.logits, out.taps


@torch.no_grad()
def target_step(target, cache: SpecCache, tokens: torch.Tensor, lengths: torch.Tensor, taps: Sequence[int] = (),
                drafter: DSparkDrafter | None = None) -> torch.Tensor:
    """The fixed-shape target forward of a round (what the CUDA graph captures): tokens [B, w]
    at positions lengths[b] + i (lengths int64 [B] on the device), attention over all
    cache.max_len positions (masked by position), keys written into `cache`; with a drafter,
    the tap states are projected into its context cache at the same positions
    (`draft_context_update`).  No host length is read, no host state updated -> logits [B, w, V]."""
    logits, tap = _target_forward(target, cache, tokens, lengths, cache.max_len, taps)
    if drafter is not None:
        _draft_context_write(drafter, cache, tap, lengths)
    return logits


@torch.no_grad()
def draft_context_update(drafter: DSparkDrafter, cache: SpecCache, taps: torch.Tensor) -> None:
    """Project the tap states of positions cache.lengths[b] + i (taps [B, T, n * H]) into every
    draft layer's context keys / values."""
    _draft_context_write(drafter, cache, taps, cache.lengths)


def _draft_context_write(drafter: DSparkDrafter, cache: SpecCache, taps: torch.Tensor, lengths: torch.Tensor) -> None:
    B, T, _ = taps.shape
    dev = taps.device
    pos = lengths.view(B, 1) + torch.arange(T, device=dev).view(1, T)
    rows = torch.arange(B, device=dev).view(B, 1).expand(B, T)
    ctx = drafter.context(taps)
    for li, (k, v) in enumerate(drafter.context_kv(ctx, pos)):
        cache.write_draft(li, k, v, rows, pos)


@torch.no_grad()
def draft_hidden(drafter: DSparkDrafter, cache: SpecCache, anchor: torch.Tensor,
                 lengths: torch.Tensor | None = None) -> torch.Tensor:
    """The block [anchor, mask...] at positions cache.lengths[b] + j over the cached context
    (keys L - W < j < L) -> final-normed hidden states [B, gamma, H].  With `lengths` (int64 [B]
    on the device, in place of cache.lengths) the context covers all cache.max_len positions
    (fixed shapes, no host length read: the static / CUDA-graph round)."""
    if lengths is None:
        return _draft_hidden(drafter, cache, anchor, cache.lengths, max(1, max(cache.host_lengths)))
    return _draft_hidden(drafter, cache, anchor, lengths, cache.max_len)


def _draft_hidden(drafter: DSparkDrafter, cache: SpecCache, anchor: torch.Tensor, lengths: torch.Tensor,
                  Lc: int) -> torch.Tensor:
    g = drafter.config.draft_block_size
    B = anchor.shape[0]
    dev = anchor.device
    L = lengths.view(B, 1)
    j = torch.arange(Lc, device=dev).view(1, Lc)
    ctx_ok = (j < L) & (j > L - drafter.config.sliding_window)  # [B, Lc]
    mask = torch.cat([ctx_ok.unsqueeze(1).expand(B, g, Lc), torch.ones(B, g, g, dtype=torch.bool, device=dev)], dim=-1)
    kv = [(cache.dk[i][:, :Lc], cache.dv[i][:, :Lc]) for i in range(len(drafter.layers))]
    pos = L + torch.arange(g, device=dev).view(1, g)
    return drafter.run_blocks(drafter.block_ids(anchor), pos, kv, mask.unsqueeze(1))


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------


class _Graphed:
    """Runs fixed-shape functions of static device buffers either eagerly or, on CUDA with
    `use_graph`, through one CUDA graph per key (captured at the first call: a warm-up on a side
    stream under torch.cuda.set_sync_debug_mode("error"), capture, replay; later calls replay).
    Any failure turns graphs off for the rest of the run (a one-time warning) and the call runs
    eagerly.  Returns the function's output tensors (clones of the graph's on replay)."""

    def __init__(self, use_graph: bool, device: torch.device) -> None:
        self.use_graph = use_graph and device.type == "cuda"  # CPU: always eager
        self.device = device
        self.disabled_reason: str | None = None
        self.graphs: dict[Any, tuple[Any, tuple[torch.Tensor, ...]]] = {}

    def _disable(self, reason: str) -> None:

        self.disabled_reason = reason
        graph_warning(f"(speculative_generate) {reason}")

    def __call__(self, key: Any, fn: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
        if not self.use_graph or self.disabled_reason is not None:
            return fn()
        hit = self.graphs.get(key)
        if hit is not None:
            graph, outs = hit
            graph.replay()
            return tuple(o.clone() for o in outs)
        return self._capture(key, fn)

    def _capture(self, key: Any, fn: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
        with torch.cuda.device(self.device):
            return self._capture_on_device(key, fn)

    def _capture_on_device(self, key: Any, fn: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:

        try:
            out, graph, outs = capture_graph(fn, self.device)
        except GraphCaptureError as e:
            self._disable(e.describe(f"the round step {key!r}"))
            return e.out if e.out is not None else fn()
        self.graphs[key] = (graph, outs)
        graph.replay()
        return tuple(o.clone() for o in outs)


class StaticRounds:
    """The static buffers of the speculative rounds of one run (batch B, block g): `lengths`
    int64 [B] (the cache lengths at the round's start) and `tokens` int64 [B, g + 1] ([anchor,
    drafts]); the drafter block and the target verify forward read only these and the
    preallocated `SpecCache` buffers (`draft_hidden(..., lengths)`, `target_step`), so their
    shapes and addresses never change and they can be CUDA graphs: the whole round (`round`,
    after `fused_setup`), or, with the confidence budget, one drafter graph (`draft`) and one
    target graph per verify width (`verify_forward`)."""

    def __init__(self, target, drafter: DSparkDrafter, cache: SpecCache, taps: Sequence[int], g: int,
                 use_graph: bool, propose_kw: dict[str, Any] | None) -> None:
        B = cache.batch
        self.target, self.drafter, self.cache, self.taps, self.g = target, drafter, cache, tuple(taps), g
        self.lengths = torch.zeros(B, dtype=torch.long, device=cache.device)
        self.tokens = torch.zeros(B, g + 1, dtype=torch.long, device=cache.device)
        self.propose_kw = propose_kw  # greedy: propose (no generator) runs inside the drafter graph
        self.run = _Graphed(use_graph, cache.device)
        if cache.rows is not None:  # msa_decode plans of every verify width, made outside any capture
            for w in range(1, min(g + 1, cache.rows.MAX_NQ) + 1):
                cache.rows.plan(w)

    def draft(self, anchor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """-> (h,) or, greedy, (draft tokens [B, g], confidence [B, g] or nothing)."""
        self.lengths.copy_(self.cache.lengths)
        self.tokens[:, 0].copy_(anchor)
        return self.run("drafter", self._draft)

    def _draft(self) -> tuple[torch.Tensor, ...]:
        anchor = self.tokens[:, 0]
        h = draft_hidden(self.drafter, self.cache, anchor, self.lengths)
        if self.propose_kw is None:
            return (h,)
        prop = self.drafter.propose(h, anchor, **self.propose_kw)
        return (prop.tokens,) if prop.confidence is None else (prop.tokens, prop.confidence)

    def fused_setup(self, sample_kw: dict[str, Any], process: Callable[[torch.Tensor], torch.Tensor],
                    anchor: torch.Tensor, active: Sequence[bool]) -> None:
        """The fused round's state and buffers: the round starts at the cache's lengths with
        `anchor` [B]; `active` (per row) says which rows advance; `process` turns the target's
        logits into what `verify` takes (greedy: the logits; sampling: `sampling_probs`).
        Buffers: the next round's state (`next_lengths`, `next_anchor`), `result` int64 [B, g + 2]
        ([n, tokens]); sampling: the round's Exp(1) race noise of the drafts [B, g, V] and of the
        extra token [B, V], acceptance uniforms [B, g] (None when greedy)."""
        B, g, dev = self.tokens.shape[0], self.g, self.tokens.device
        V = self.target.lm_head.weight.shape[0]
        self.sample_kw, self.process = sample_kw, process
        self.greedy = sample_kw["temperature"] == 0
        self.lengths.copy_(self.cache.lengths)
        self.tokens[:, 0].copy_(anchor)
        # allocated once: a pooled round keeps them (its graph reads them) across calls
        sampled = not self.greedy
        for name, shape, dtype, on in (("active", (B,), torch.bool, True), ("next_lengths", (B,), torch.long, True),
                                       ("next_anchor", (B,), torch.long, True), ("result", (B, g + 2), torch.long, True),
                                       ("noise_draft", (B, g, V), torch.float32, sampled),
                                       ("uniforms", (B, g), torch.float32, sampled),
                                       ("noise_extra", (B, V), torch.float32, sampled)):
            if not on:
                setattr(self, name, None)
            elif getattr(self, name, None) is None:
                setattr(self, name, torch.zeros(shape, dtype=dtype, device=dev))
        self.active.copy_(torch.tensor(list(active), dtype=torch.bool))

    def round(self) -> torch.Tensor:
        """One whole round (one CUDA graph) -> result [B, g + 2] = [n, accepted drafts, extra token,
        -1 ...]; then the state advances (lengths += n + 1 and the anchor = the extra token, for
        active rows).  The captured function only reads the state and writes `next_*`, so a
        replay is idempotent (the capture's warm-up call and its replay give the same round)."""
        (res,) = self.run("round", self._round)
        self.lengths.copy_(self.next_lengths)
        self.tokens[:, 0].copy_(self.next_anchor)
        return res

    def _round(self) -> tuple[torch.Tensor]:
        anchor = self.tokens[:, 0]
        h = draft_hidden(self.drafter, self.cache, anchor, self.lengths)
        prop = self.drafter.propose(h, anchor, noise=self.noise_draft, **self.sample_kw)
        self.tokens[:, 1:].copy_(prop.tokens)
        logits = target_step(self.target, self.cache, self.tokens, self.lengths, self.taps, self.drafter)
        n, toks = verify(prop.tokens, prop.probs, self.process(logits), greedy=self.greedy, uniforms=self.uniforms,
                         noise=self.noise_extra)
        self.next_lengths.copy_(self.lengths + torch.where(self.active, n + 1, torch.zeros_like(n)))
        extra = toks.gather(1, n.view(-1, 1)).squeeze(1)
        self.next_anchor.copy_(torch.where(self.active, extra, anchor))
        self.result[:, 0].copy_(n)
        self.result[:, 1:].copy_(toks)
        return (self.result,)

    def verify_forward(self, drafts: torch.Tensor) -> torch.Tensor:
        """drafts [B, w - 1] after the staged anchor -> target logits [B, w, V] (keys and draft
        context written at lengths + i)."""
        w = drafts.shape[1] + 1
        _positions_check(self.cache, w)
        self.tokens[:, 1:w].copy_(drafts)
        (logits,) = self.run(("target", w), lambda: (target_step(self.target, self.cache, self.tokens[:, :w],
                                                                 self.lengths, self.taps, self.drafter),))
        self.cache.written = [h_ + w for h_ in self.cache.host_lengths]
        return logits


class _Book:
    """Host bookkeeping of a speculative run: the tokens emitted per row, which rows are done
    (max_new_tokens reached or an eos emitted), the statistics and the streamer."""

    def __init__(self, B: int, g: int, max_new: int, eos: list[int] | None, streamer, stats: SpecStats) -> None:
        self.B, self.g, self.max_new, self.eos, self.streamer, self.stats = B, g, max_new, eos, streamer, stats
        self.out: list[list[int]] = [[] for _ in range(B)]
        self.done = [False] * B

    def start(self, first: list[int]) -> None:
        """The prefill's token of each row."""
        for b, t in enumerate(first):
            self.out[b] = [t]
            self.done[b] = (self.eos is not None and t in self.eos) or len(self.out[b]) >= self.max_new
        if self.streamer is not None:
            self.streamer([list(r) for r in self.out])

    def active(self) -> list[bool]:
        return [not d for d in self.done]

    def absorb(self, n: list[int], toks: list[list[int]], tried: list[int] | int) -> None:
        """One round's results: accepted drafts n[b], tokens toks[b] (accepted drafts + the extra
        token first), drafts verified (per row, or one width for all).  Rows already done when
        the round was read are skipped (a pipelined round may run past a row's end)."""
        st = self.stats
        st.rounds += 1
        new_tokens: list[list[int]] = [[] for _ in range(self.B)]
        for b in range(self.B):
            if self.done[b]:
                continue
            nb = n[b]
            new = toks[b][: nb + 1]
            tr = tried if isinstance(tried, int) else tried[b]
            st.row_rounds += 1
            st.tokens += nb + 1
            st.accepted_drafts += nb
            st.verified_drafts += tr
            for j in range(min(tr, self.g)):
                st.position_tries[j] += 1
                if j < nb:
                    st.position_accepts[j] += 1
            if self.eos is not None:
                for i, t in enumerate(new):
                    if t in self.eos:
                        new = new[: i + 1]
                        self.done[b] = True
                        break
            new = new[: self.max_new - len(self.out[b])]
            self.out[b].extend(new)
            new_tokens[b] = new
            if len(self.out[b]) >= self.max_new:
                self.done[b] = True
        if self.streamer is not None:
            self.streamer(new_tokens)


def _fused_rounds(rounds: "StaticRounds", book: _Book, draft_gen: torch.Generator, accept_gen: torch.Generator) -> None:
    """The rounds without a confidence budget: each is one `StaticRounds.round` call (one CUDA
    graph: draft, verify forward, verification, next state), pipelined one round deep -- round
    r + 1 is queued before round r's results are read (one event wait per round, no stall of the
    GPU on the host's bookkeeping).  The last queued round is discarded, and a row that ended in
    round r still runs (ignored) in round r + 1."""
    dev = rounds.lengths.device
    cuda = dev.type == "cuda"
    B, g = rounds.tokens.shape[0], rounds.g
    host = [torch.empty(B, g + 2, dtype=torch.long, pin_memory=cuda) for _ in range(2)]
    events = [torch.cuda.Event() for _ in range(2)] if cuda else None
    active = book.active()
    pending = None
    i = 0
    while True:
        if not all(book.done):
            slot = i % 2
            if not rounds.greedy:  # the round's randomness, drawn from the two streams outside the graph
                rounds.noise_draft.exponential_(generator=draft_gen)
                rounds.uniforms.uniform_(generator=accept_gen)
                rounds.noise_extra.exponential_(generator=accept_gen)
            res = rounds.round()
            host[slot].copy_(res, non_blocking=cuda)
            if cuda:
                events[slot].record()
        else:
            slot = None
        if pending is not None:
            if cuda:
                events[pending].synchronize()
            r = host[pending].tolist()
            book.absorb([x[0] for x in r], [x[1:] for x in r], g)
            now = book.active()
            if now != active:  # rows that ended stop advancing (from the next queued round on)
                active = now
                rounds.active.copy_(torch.tensor(active, dtype=torch.bool))
        if slot is None or all(book.done):
            break
        pending = slot
        i += 1


def _budget_rounds(rounds: "StaticRounds", anchor: torch.Tensor, book: _Book, greedy: bool, process, draft_gen,
                   accept_gen, cost, propose_kw: dict) -> None:
    """The rounds with DSpark's confidence budget: the drafter block (a graph; greedy: with the
    argmax drafts), the scheduler's verify lengths (a host sync: the verify width), the target
    forward over that width (one graph per width), `verify`, the host bookkeeping."""
    cache, drafter = rounds.cache, rounds.drafter
    B = cache.batch
    dev = cache.device
    while not all(book.done):
        active_h = book.active()
        active = torch.tensor(active_h, dtype=torch.bool, device=dev)
        drafted = rounds.draft(anchor)
        if greedy:  # the drafter graph drew the drafts (argmaxes)
            prop = DraftProposal(tokens=drafted[0], probs=None, confidence=drafted[1])
        else:  # sampling (the draft generator) stays outside the graph
            prop = drafter.propose(drafted[0], anchor, generator=draft_gen, **propose_kw)
        lengths = schedule_budget(prop.confidence * active.unsqueeze(1), cost)
        lengths = torch.where(active, lengths, torch.zeros_like(lengths))
        w = int(lengths.max())  # host sync: the verify width
        d_tok = prop.tokens[:, :w]
        d_prob = None if greedy else prop.probs[:, :w]
        # [anchor, drafts] at positions L .. L + w; also writes the drafter's context
        logits = rounds.verify_forward(d_tok)
        n, toks = verify(d_tok, d_prob, process(logits), generator=accept_gen, greedy=greedy, lengths=lengths)
        n_h = n.tolist()  # one host sync per round: accepted counts and tokens
        book.absorb(n_h, toks.tolist(), lengths.tolist())
        # roll back past the rejected drafts: length L + n + 1 for rows still running
        step = torch.where(active, n + 1, torch.zeros_like(n))
        host = [h_ + (n_h[b] + 1 if active_h[b] else 0) for b, h_ in enumerate(cache.host_lengths)]
        cache.set_lengths(cache.lengths + step, host)
        extra = toks.gather(1, n.view(B, 1)).squeeze(1)
        anchor = torch.where(active, extra, anchor)


class _RunState:
    """A run's `SpecCache` with its static rounds (or the plain loop's graph and buffers), kept
    across calls by `_run_state` (`msakit.graphs.StatePool`): the cache buffers, the static
    buffers and the captured CUDA graphs survive; the models are attached for the call only."""

    def __init__(self, cache: SpecCache) -> None:
        self.cache = cache
        self.rounds: StaticRounds | None = None
        self.plain: tuple[Any, torch.Tensor, torch.Tensor] | None = None
        self.in_use = False

    def reset(self) -> None:
        self.cache.reset()

    def rounds_for(self, target, drafter: DSparkDrafter, taps: Sequence[int], g: int, use_graph: bool,
                   propose_kw: dict[str, Any] | None) -> "StaticRounds":
        if self.rounds is None:
            self.rounds = StaticRounds(target, drafter, self.cache, taps, g, use_graph, propose_kw)
        self.rounds.target, self.rounds.drafter = target, drafter
        return self.rounds

    def __enter__(self) -> "_RunState":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.in_use = False
        if self.rounds is not None:  # a pooled state holds no reference to the models
            self.rounds.target = self.rounds.drafter = None


_RUNS = StatePool(size=4)  # per target: e.g. greedy and sampled rounds, the budget rounds, the plain loop


def _run_state(models: tuple, batch: int, max_len: int, num_draft_layers: int, device: torch.device, key: tuple,
               pooled: bool, paged: bool) -> _RunState:
    """The run state for `batch` rows of up to `max_len` positions (rounded up, `round_length`):
    from the pool (reset) when `pooled` and an idle one of this key exists for the same model
    state, else a new one."""
    L = round_length(max_len)

    def make() -> _RunState:
        return _RunState(SpecCache.for_target(models[0], num_draft_layers, batch, L, device, paged=paged))

    if not pooled:
        return make()
    return _RUNS.get(models[0], model_state_key(*models), (batch, L, str(device), paged) + key, make)


def _paged(target, cache: str, device: torch.device) -> bool:
    """Whether a run keeps the target's keys in pages (`cache`: "auto" | "contiguous" | "paged")."""

    if cache not in SPEC_CACHE_KINDS:
        raise ValueError(f"cache must be one of {SPEC_CACHE_KINDS}, got {cache!r}")
    if cache == "auto":
        return device.type == "cuda" and triton_available() and paged_supported(target) is None
    if cache == "paged":
        why = paged_supported(target)
        if why is not None:
            raise ValueError(f"cache='paged' is not supported for this target: {why}")
    return cache == "paged"


def clear_runs(model: Any = None) -> None:
    """Drop the pooled speculative run states (and their graphs) of `model` (the target), or all."""
    _RUNS.clear(model)


def _check_target(target) -> None:
    ok = all(hasattr(target, a) for a in ("config", "model", "lm_head")) and all(
        hasattr(target.model, a) for a in ("embed_tokens", "layers", "norm"))
    if not ok:
        raise ValueError(f"the target must be an M3ForCausalLM (msakit.models), got {type(target).__name__}")


PREFILL_CHUNK = 1024
MIN_ACCEPTED_LENGTH = 1.05  # tokens per round below which speculation cannot pay: the drafts are (almost) all rejected


@dataclass
class SpecStats:
    """Per-run statistics.  `accepted_length` = mean tokens per verify step and row (accepted
    drafts + the extra token), the paper's "accepted length"."""

    rounds: int = 0
    row_rounds: int = 0  # (row, round) pairs that produced tokens
    tokens: int = 0  # tokens produced by rounds (the prefill's first token excluded)
    accepted_drafts: int = 0
    verified_drafts: int = 0  # drafts sent to the target (< rounds * g with the budget)
    position_accepts: list[int] = field(default_factory=list)  # per draft position: times accepted
    position_tries: list[int] = field(default_factory=list)  # times it was verified
    seconds: float = 0.0
    # decoding speeds after the first token (the prefill excluded), where measured
    # (`msakit.speculative.textgen.TextGenerator.stream`): speculative, and plain decoding's
    tokens_per_s: float | None = None
    plain_tokens_per_s: float | None = None

    @property
    def accepted_length(self) -> float:
        return self.tokens / self.row_rounds if self.row_rounds else float("nan")

    def cost_warning(self) -> str | None:
        """Why speculation did not pay, where it did not: the drafts (almost) never accepted
        (accepted length below MIN_ACCEPTED_LENGTH: each round pays the drafter and a verification
        for about one token), or speculative decoding measured slower than plain decoding.  None
        when neither holds."""
        if not self.row_rounds:
            return None
        L = self.accepted_length
        why = []
        if self.tokens_per_s and self.plain_tokens_per_s and self.tokens_per_s < self.plain_tokens_per_s:
            why.append(f"speculative decoding ran at {self.tokens_per_s:.1f} tokens/s, plain decoding at "
                       f"{self.plain_tokens_per_s:.1f} tokens/s ({self.tokens_per_s / self.plain_tokens_per_s:.2f}x)")
        if L < MIN_ACCEPTED_LENGTH:
            why.append(f"the drafts were (almost) never accepted ({self.accepted_drafts} of {self.verified_drafts}; "
                       f"accepted length {L:.2f}): every round pays the drafter and a verification for about one "
                       "token")
        if not why:
            return None
        return "speculation costs more than it saves here: " + "; ".join(why) + \
            ": decode without --drafter, or train the drafter for this target longer"

    @property
    def position_acceptance(self) -> list[float]:
        return [a / t if t else float("nan") for a, t in zip(self.position_accepts, self.position_tries)]

    def as_dict(self) -> dict[str, Any]:
        return {"rounds": self.rounds, "row_rounds": self.row_rounds, "tokens": self.tokens,
                "accepted_drafts": self.accepted_drafts, "verified_drafts": self.verified_drafts,
                "accepted_length": self.accepted_length, "position_acceptance": self.position_acceptance,
                "seconds": self.seconds, "tokens_per_s": self.tokens_per_s, "plain_tokens_per_s": self.plain_tokens_per_s}


def _streams(generator: torch.Generator | None, device: torch.device) -> tuple[torch.Generator, torch.Generator]:
    """Two independent device generators (drafts; acceptance + residual/bonus) from `generator`."""
    if generator is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    else:
        seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device).item())
    draft = torch.Generator(device=device).manual_seed(seed)
    accept = torch.Generator(device=device).manual_seed((seed * 0x9E3779B97F4A7C15 + 0x5851F42D) % (2**63 - 1))
    return draft, accept


@torch.no_grad()
def speculative_generate(target, drafter: DSparkDrafter, prompt: torch.Tensor, max_new_tokens: int, *,
                         temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                         generator: torch.Generator | None = None, num_drafts: int | None = None,
                         confidence_budget: bool = False,
                         budget_cost: tuple[float, float] | Callable[[torch.Tensor], torch.Tensor] | None = None,
                         eos_token_id: int | Sequence[int] | None = None,
                         streamer: Callable[[list[list[int]]], Any] | None = None, return_stats: bool = False,
                         cuda_graph: bool | None = None, cache: str = "auto"):
    """Sample `max_new_tokens` after prompt [B, T] with DSpark speculative decoding -> tokens
    [B, T + n] (and a `SpecStats` with return_stats).

    The output has exactly the distribution of `generate(target, prompt, max_new_tokens,
    temperature, top_k, top_p)` (greedy: the same tokens).  num_drafts (<= the drafter's block
    size, default all) drafts are verified per round; the block is always drafted whole.
    confidence_budget: verify only the prefix DSpark's scheduler picks (`budget_cost`: (fixed,
    per verified position) cost of a round of the whole batch in any unit, or a callable on the
    number of verified positions (B anchors + admitted drafts); profile it on the machine, as
    benchmarks/spec.py does; the default (1, 0.5 / (B (g + 1))) says verifying every draft costs
    1.5x verifying none).
    eos_token_id: rows stop after an eos (finished rows are padded with the first eos id; the
    result is as long as the longest row).  streamer(new_tokens_per_row) is called each round.
    cache: where the target's keys live: "paged" (a PagedKVCache; verify forwards of up to 8
    positions per row attend through msa_decode), "contiguous" (position-masked attention over
    contiguous buffers) or "auto" (paged on CUDA with Triton when `paged_supported(target)`).
    cuda_graph: None (on CUDA: on), True or False (eager); on CPU the rounds always run eagerly.
    Either way the rounds run the same fixed-shape code (`StaticRounds`), so the output does not
    depend on it.
    """
    check_sampling(temperature, top_k, top_p)
    if cuda_graph is not None and not isinstance(cuda_graph, bool):
        raise ValueError(f"cuda_graph must be None, True or False, got {cuda_graph!r}")
    if prompt.dim() != 2 or prompt.shape[1] < 1:
        raise ValueError(f"prompt must have shape [B, T] with T >= 1, got {tuple(prompt.shape)}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
    _check_target(target)
    drafter.bind(target)
    if target.lm_head.weight.device != drafter.device:
        raise ValueError(f"the target is on {target.lm_head.weight.device} but the drafter on {drafter.device}")
    dcfg = drafter.config
    g = dcfg.draft_block_size if num_drafts is None else num_drafts
    if isinstance(g, bool) or not isinstance(g, int) or g < 1:
        raise ValueError(f"num_drafts must be a positive integer, got {num_drafts!r}")
    if g > dcfg.draft_block_size:
        raise ValueError(f"num_drafts={g} exceeds the drafter's trained block ({dcfg.draft_block_size} drafts per round)")
    if confidence_budget and drafter.confidence_head is None:
        raise ValueError("confidence_budget needs a drafter with a confidence head")
    if int(prompt.min()) < 0 or int(prompt.max()) >= target.config.vocab_size:
        raise ValueError(f"prompt token ids must lie in [0, {target.config.vocab_size})")
    B, T = prompt.shape
    dev = drafter.device
    paged = _paged(target, cache, dev)
    prompt = prompt.to(dev)
    eos = None
    if eos_token_id is not None:
        eos = [eos_token_id] if isinstance(eos_token_id, int) else [int(e) for e in eos_token_id]
    greedy = temperature == 0
    stats = SpecStats(position_accepts=[0] * g, position_tries=[0] * g)
    if max_new_tokens == 0:
        return (prompt.clone(), stats) if return_stats else prompt.clone()

    was_training = (target.training, drafter.training)
    target.eval()
    drafter.eval()
    t0 = time.perf_counter()
    stack = contextlib.ExitStack()
    try:
        draft_gen, accept_gen = _streams(generator, dev)
        taps = dcfg.target_layer_ids
        use_graph = cuda_graph is not False
        sample_kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, num_drafts=g)
        budget_kw = dict(sample_kw, want_confidence=True)
        # room for the last round's overshoot and one more (discarded) pipelined round
        state = _run_state((target, drafter), B, T + max_new_tokens + 3 * (dcfg.draft_block_size + 1),
                           dcfg.num_hidden_layers, dev, ("budget" if confidence_budget else "fused", g, temperature,
                                                         top_k, top_p), use_graph, paged)
        stack.enter_context(state)
        cache = state.cache

        def process(logits: torch.Tensor) -> torch.Tensor:
            return logits.float() if greedy else sampling_probs(logits, temperature, top_k, top_p)

        # prefill (in chunks: sparse selection scores are [chunk, keys]): the prompt's keys and
        # tap states; the first token comes from the target
        for s0 in range(0, T, PREFILL_CHUNK):
            s1 = min(T, s0 + PREFILL_CHUNK)
            logits, tap = target_forward(target, cache, prompt[:, s0:s1], taps)
            draft_context_update(drafter, cache, tap)
            cache.set_lengths(torch.full((B,), s1, dtype=torch.long, device=dev), [s1] * B)
        p0 = process(logits[:, -1])
        anchor = p0.argmax(-1) if greedy else sample_probs(p0, accept_gen)
        book = _Book(B, g, max_new_tokens, eos, streamer, stats)
        book.start(anchor.tolist())
        if confidence_budget:
            rounds = state.rounds_for(target, drafter, taps, g, use_graph, budget_kw if greedy else None)
            _budget_rounds(rounds, anchor, book, greedy, process, draft_gen, accept_gen,
                           budget_cost if budget_cost is not None else (1.0, 0.5 / (B * (g + 1))), budget_kw)
        else:
            rounds = state.rounds_for(target, drafter, taps, g, use_graph, None)
            rounds.fused_setup(sample_kw, process, anchor, book.active())
            _fused_rounds(rounds, book, draft_gen, accept_gen)
        out = book.out
    finally:
        stack.close()
        target.train(was_training[0])
        drafter.train(was_training[1])
    stats.seconds = time.perf_counter() - t0
    n_out = max(len(r) for r in out)
    pad = eos[0] if eos is not None else 0
    gen = torch.tensor([r + [pad] * (n_out - len(r)) for r in out], dtype=torch.long, device=dev)
    tokens = torch.cat([prompt, gen], dim=1)
    return (tokens, stats) if return_stats else tokens


@torch.no_grad()
def autoregressive_generate(target, prompt: torch.Tensor, max_new_tokens: int, **options: Any) -> torch.Tensor:
    """Plain decoding (one token per target forward) through the same cache and attention code
    as `speculative_generate`: the same-engine baseline its speed is compared with.  `options`:
    speculative_generate's temperature (1.0), top_k, top_p, generator, cuda_graph and cache
    ("auto"), with the same meaning.  The per-token forward is `target_step` (fixed shapes), a
    CUDA graph on CUDA unless cuda_graph is False."""
    o = keyword_options(options, dict(temperature=1.0, top_k=None, top_p=None, generator=None, cuda_graph=None,
                                      cache="auto"), "autoregressive_generate")
    temperature, top_k, top_p, generator, cuda_graph, cache = o.values()
    check_sampling(temperature, top_k, top_p)
    if cuda_graph is not None and not isinstance(cuda_graph, bool):
        raise ValueError(f"cuda_graph must be None, True or False, got {cuda_graph!r}")
    _check_target(target)
    B, T = prompt.shape
    dev = target.lm_head.weight.device
    prompt = prompt.to(dev)
    if max_new_tokens <= 0:
        return prompt.clone()
    was = target.training
    target.eval()
    stack = contextlib.ExitStack()
    try:
        _, gen = _streams(generator, dev)
        state = _run_state((target,), B, T + max_new_tokens + 1, 0, dev, ("plain",), cuda_graph is not False,
                           _paged(target, cache, dev))
        stack.enter_context(state)
        cache = state.cache
        out = [prompt]
        if state.plain is None:  # the per-token graph and its static buffers (kept with a pooled state)
            state.plain = (_Graphed(cuda_graph is not False, dev), torch.zeros(B, dtype=torch.long, device=dev),
                           torch.zeros(B, 1, dtype=torch.long, device=dev))
        run, lens, tok_buf = state.plain
        if cache.rows is not None:
            cache.rows.plan(1)  # outside the capture
        for s0 in range(0, T, PREFILL_CHUNK):
            s1 = min(T, s0 + PREFILL_CHUNK)
            logits, _ = target_forward(target, cache, prompt[:, s0:s1])
            cache.set_lengths(torch.full((B,), s1, dtype=torch.long, device=dev), [s1] * B)
        for i in range(max_new_tokens):
            if i:
                _positions_check(cache, 1)
                lens.copy_(cache.lengths)
                tok_buf.copy_(tok)
                (logits,) = run(("target", 1), lambda: (target_step(target, cache, tok_buf, lens),))
                cache.set_lengths(cache.lengths + 1, [h + 1 for h in cache.host_lengths])
            last = logits[:, -1]
            nxt = last.argmax(-1) if temperature == 0 else sample_probs(sampling_probs(last, temperature, top_k, top_p), gen)
            tok = nxt.view(B, 1)
            out.append(tok)
        return torch.cat(out, dim=1)
    finally:
        stack.close()
        target.train(was)
