"""The decode loop over the model's forward (`model(ids, cache=...)`), and CUDA-graph capture.

Every path runs the model's one forward with a cache (`msakit.cache.KVCacheProtocol`); what
differs is the cache.  Contiguous path (`cache="contiguous"`): a `msakit.cache.KVCache`; the
prompt runs in one forward, then one token per step; in sparse mode every decode step selects
blocks with the indexer over all cached index keys and attends the selected blocks only.

Sampling: temperature 0 is greedy (argmax); otherwise logits / temperature, then top-k, then
top-p (nucleus) filtering, then one draw from `torch.multinomial` with the given
`torch.Generator` (same seed -> same tokens).  The streamer gets each step's new tokens: a
callable is called as `streamer(tokens [B])`; an object with `put` / `end` (the transformers
streamer protocol, e.g. TextStreamer for B == 1) gets `put(tokens on CPU)` per step and `end()`
once at the end (the prompt is not sent).

Paged path (`generate(..., cache="paged")`, the default on CUDA through cache="auto"): the
prompt runs through the contiguous prefill (a `KVCache` of the prompt's length), its per-layer
K / V / index keys go into a `msakit.cache.PagedKVCache` (one sequence per row, page = selection
block, index keys for the MSA layers only), and every decode step is the model's forward over a
`msakit.cache.PagedStep` (the step's slots, page table, lengths and msa_decode plan): each layer
writes its new keys into the step's slots, then attends through `msa_decode` (sparse-mode MSA
layers; one page table and one `plan_decode` per step, shared by all layers) or full attention
over the gathered pages (dense-mode / dense GQA layers; no host sync inside the forward).

CUDA graph (`generate(..., cuda_graph=None)`: on for the paged path on CUDA unless False): the
per-token forward (the model's forward over a `PagedStep` of static buffers) is
`PagedDecoder.static_step`, which reads
everything that changes from step to step from static device buffers (`_GraphStep`: token ids,
positions, slots, a page table as wide as max_len, lengths, and an msa_decode plan made for that
width; shapes never depend on the length).  Host bookkeeping stays outside: `stage` reserves the
slots (`append_slots_host`) and copies ids (device to device), positions / slots and page table
/ lengths (pinned, non-blocking) into the buffers.  The first step of each (batch, nq) runs
`static_step` eagerly on a side stream with `torch.cuda.set_sync_debug_mode("error")` (any
host sync aborts it), then captures it; every later step replays (msakit's MoE counts experts
with scatter-adds, not `torch.bincount`, which syncs on CUDA).  A step that cannot be captured (msa_decode's reference backend, the
padded-bmm MoE fallback, a custom MoE, any sync or capture error) decodes eagerly with a
one-time warning (`PagedDecoder.graph_disabled_reason`); a step past max_len runs eagerly.
Sampling stays outside the graph.  On CPU the eager step is the only path.

Compiled step (`generate(..., compile=True)`, `PagedDecoder(compile=True)`): the static step's
forward runs under torch.compile (`compiled_step_forward`: fullgraph, static shapes, no inductor
CUDA graphs), so inductor fuses its elementwise work; each layer's cache write + attention is
one op opaque to dynamo (`paged_step_attend`, which finds the cache and the plan of the running
step in a module-level context, so neither is an input of the compiled graph).  With CUDA graphs
the compiled step runs once before the warm-up (compilation and autotuning synchronize), then is
captured like the uncompiled one; without them (CPU) every step within max_len runs the
compiled step from the static buffers.

Kept across calls: `generate` takes its paged decoder from `decoder_for`, a per-model pool
(`msakit.graphs.StatePool`) keyed by (batch, max_len rounded up to `msakit.graphs.LENGTH_QUANTUM`, kv_dtype, backend,
cuda_graph, compile), so a later call of the same shape reuses the pools, static buffers and captured
graphs (no new capture); a change of the model's weights or attention modes
(`model_state_key`) drops them; `clear_decoders` frees them.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import torch

from msakit.cache import DeferredPagedStep, KVCache, PagedKVCache, PagedStep
from msakit.graphs import (
    GraphCaptureError,
    StatePool,
    capture_graph,
    error_site,
    graph_warning,
    model_state_key,
    round_length,
)
from msakit.nn.core import paged_step_context
from msakit.nn.moe import MoE
from msakit.ops.decode import plan_decode
from msakit.ops.dispatch import triton_available, use_triton
from msakit.sampling import keyword_options, sample_next

__all__ = ["KVCache", "sample_next", "generate", "generate_uncached", "paged_supported", "PagedDecoder",
           "decoder_for", "clear_decoders", "compiled_step_forward", "COMPILE_OPTIONS"]

CACHE_KINDS = ("auto", "contiguous", "paged")


def _pow2_in(x: int, lo: int = 16, hi: int = 256) -> bool:
    return lo <= x <= hi and not x & (x - 1)


def paged_supported(model: Any) -> str | None:
    """None when `model` (an M3ForCausalLM) can decode on the paged path, else the reason why not
    (msa_decode's shape limits: page = selection block, head / index dims powers of two in
    [16, 256], topk <= 64, <= 128 query heads per kv head)."""
    cfg = getattr(model, "config", None)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if cfg is None or layers is None or not all(hasattr(l, "self_attn") for l in layers):
        return "not an M3ForCausalLM-like model (config, model.layers[i].self_attn)"
    acfg = layers[0].self_attn.cfg
    sel = acfg.selection
    if not _pow2_in(sel.block_size):
        return f"index block size {sel.block_size} (the page size) must be a power of two in [16, 256]"
    if not _pow2_in(acfg.head_dim):
        return f"head_dim {acfg.head_dim} must be a power of two in [16, 256]"
    if any(l.self_attn.index_branch for l in layers):
        if not _pow2_in(acfg.index_dim):
            return f"index dim {acfg.index_dim} must be a power of two in [16, 256]"
        if sel.topk > 64:
            return f"topk {sel.topk} > 64"
        if acfg.num_heads // acfg.num_kv_heads > 128:
            return f"{acfg.num_heads // acfg.num_kv_heads} query heads per kv head > 128"
    return None


class _GraphStep:
    """Static buffers (and, once captured, the CUDA graph) of one decode step shape (B, nq).

    ids [B, nq] int64; i64 = [positions (B * nq) | slots (B * nq)] int64; i32 = [page table
    (B * width) | pad to 16 bytes | seq_lens (B)] int32; `plan` the msa_decode plan for the full
    width (None without sparse Triton layers).  Everything the step reads that changes from
    step to step is in these device tensors; the host refills them before each replay."""

    def __init__(self, batch: int, nq: int, width: int, device: torch.device, plan) -> None:
        self.batch, self.nq, self.width = batch, nq, width
        n, bw = batch * nq, batch * width
        self.ids = torch.zeros(batch, nq, dtype=torch.long, device=device)
        self.i64 = torch.zeros(2 * n, dtype=torch.long, device=device)
        self.lens_at = -(-bw // 4) * 4  # seq_lens start 16-byte aligned (Triton pointer specialization)
        self.i32 = torch.zeros(self.lens_at + batch, dtype=torch.int32, device=device)
        self.positions = self.i64[:n].view(batch, nq)
        self.slots = self.i64[n:]
        self.page_table = self.i32[:bw].view(batch, width)
        self.seq_lens = self.i32[self.lens_at:]
        self.plan = plan
        self.graph: Any = None
        self.logits: torch.Tensor | None = None


def _h2d(dst: torch.Tensor, values: list[int]) -> None:
    """Copy host values into a static device buffer without a host sync (pinned staging; the
    caching host allocator keeps the pinned block until the copy has run)."""
    src = torch.tensor(values, dtype=dst.dtype)
    if dst.device.type == "cuda":
        dst.copy_(src.pin_memory(), non_blocking=True)
    else:
        dst.copy_(src)


# ---------------------------------------------------------------------------------------------
# The compiled step (compile=True): torch.compile over the model's forward, the cache opaque
# ---------------------------------------------------------------------------------------------

def _step_forward(model: Any, new: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                  page_table: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """The model's forward over one paged step (what `compile=True` compiles) -> logits [B, V].
    Each layer's cache write and attention run inside one op opaque to dynamo
    (`msakit.nn.core.paged_step_attend`, over the cache of `paged_step_context`)."""
    step = DeferredPagedStep(positions, slots, page_table, seq_lens)
    return model(new, cache=step, logits_to_keep=1).logits[:, -1]


# torch.compile options of the step: no inductor CUDA graphs (PagedDecoder captures its own graph
# around the compiled step; "reduce-overhead" would capture a second one inside it), and
# inductor's same-input linear fusion with a reach that finds a layer's projections (q / k / v /
# index q / index k read one 2-D view, as do the shared expert's gate / up): one GEMM each at
# M = B * nq, where a decode step's GEMMs cost their launch, not their bytes.  The pass's own
# defaults look for >= 5 linears within 5 nodes.  The weights are concatenated inside the step
# (not folded as constants), so a changed weight is read by the next step.
COMPILE_OPTIONS: dict[str, Any] = {
    "fullgraph": True, "dynamic": False,
    "options": {"triton.cudagraphs": False,
                "pre_grad_fusion_options": {"batch_linear_lhs": {"min_fuse_set_size": 2, "max_fuse_search_depth": 64}}},
}
_COMPILED: list[Callable[..., torch.Tensor]] = []


def compiled_step_forward() -> Callable[..., torch.Tensor]:
    """`_step_forward` under torch.compile(**COMPILE_OPTIONS) (made once; dynamo keeps one
    graph per model structure, batch, nq and page-table width: the shapes are static)."""
    if not _COMPILED:
        _COMPILED.append(torch.compile(_step_forward, **COMPILE_OPTIONS))
    return _COMPILED[0]


class PagedDecoder:
    """Generation state of an M3ForCausalLM on a `PagedKVCache` (one sequence per batch row).

    `prefill(input_ids [B, T])` -> last logits [B, V]; `step(new [B, nq])` -> last logits [B, V]
    (nq <= 8 new tokens per row, all rows advancing together).  K / V of every layer and the
    index keys of the MSA layers live in the cache; sparse-mode MSA layers attend through
    `msa_decode` (one page table and plan per step), the others attend all their pages.

    cuda_graph=True (CUDA only): `step` replays one CUDA graph per nq (see the module
    docstring); the first step of each nq runs eagerly on a side stream (warm-up, checked for
    host syncs), then captures.  Falls back to the eager step, with a one-time warning naming
    the reason, when the model's step cannot be captured (`graph_disabled_reason` says why).

    compile=True: the step's forward over the static buffers (`static_step`) runs under
    torch.compile (fullgraph, static shapes, no inductor CUDA graphs; `compiled_step_forward`),
    the cache's write and attention inside one op opaque to dynamo (`paged_step_attend`); with
    cuda_graph the compiled step is what the graph captures, without it every step within
    max_len runs the compiled step from the static buffers (no capture; CPU too).  A step whose
    compilation fails runs uncompiled with a one-time warning (`compile_disabled_reason`)."""

    def __init__(self, model: Any, batch: int, max_len: int, *, kv_dtype: torch.dtype | None = None,
                 backend: str = "auto", num_pages: int | None = None, cuda_graph: bool = False,
                 compile: bool = False) -> None:
        why = paged_supported(model)
        if why is not None:
            raise ValueError(f"paged decoding is not supported for this model: {why}")
        self.model = model
        self._pooled = False
        self.layers = list(model.model.layers)
        self.cfg = self.layers[0].self_attn.cfg  # the attention shape (every layer's is the same)
        self.sel = self.cfg.selection
        self.backend = backend
        self.index_layers = [i for i, l in enumerate(self.layers) if l.self_attn.index_branch]
        ps = self.sel.block_size
        if kv_dtype is None:
            kv_dtype = model.dtype if model.dtype in (torch.float32, torch.float16, torch.bfloat16) else torch.bfloat16
        if num_pages is None:
            num_pages = batch * (-(-max_len // ps))
        self.cache = PagedKVCache(
            len(self.layers), num_pages, num_kv_heads=self.cfg.num_kv_heads, head_dim=self.cfg.head_dim,
            index_dim=self.cfg.index_dim if self.index_layers else 0, page_size=ps, kv_dtype=kv_dtype,
            index_dtype=kv_dtype, index_layers=self.index_layers, device=model.device,
        )
        self.seq_ids = [self.cache.allocate() for _ in range(batch)]
        self.plan = None
        self.max_len = int(max_len)
        self.graph_width = -(-self.max_len // ps)  # page-table width of the static step (max_len tokens)
        if cuda_graph and self.cache.device.type != "cuda":
            raise ValueError(f"cuda_graph=True needs a model on CUDA, got {self.cache.device}")
        self.cuda_graph = bool(cuda_graph)
        self.compile = bool(compile)
        self.graph_disabled_reason: str | None = None
        self.compile_disabled_reason: str | None = None
        self._graphs: dict[int, _GraphStep] = {}
        self.in_use = False

    def reset(self) -> None:
        """Empty the cache's sequences (new ones, length 0) keeping its pools, the static buffers
        and the captured graphs (`decoder_for` reuses a decoder this way)."""
        for sid in self.seq_ids:
            self.cache.free(sid)
        self.seq_ids = [self.cache.allocate() for _ in self.seq_ids]

    def __enter__(self) -> "PagedDecoder":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.in_use = False
        if self._pooled:
            self.model = None  # a pooled decoder holds no reference to its model

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[0] != len(self.seq_ids):
            raise ValueError(f"input_ids has {input_ids.shape[0]} rows for a decoder of batch {len(self.seq_ids)}")
        kv = KVCache(len(self.layers), input_ids.shape[1])
        logits = self.model(input_ids, cache=kv, logits_to_keep=1).logits[:, -1]
        for b, sid in enumerate(self.seq_ids):
            self.cache.prefill(sid, [k[b] for k in kv.k], [v[b] for v in kv.v],
                               [None if ki is None else ki[b] for ki in kv.k_idx])
        return logits

    def _sparse_triton(self) -> tuple[bool, bool]:
        """(any sparse-mode MSA layer, msa_decode runs its Triton kernels)."""
        sparse = any(self.layers[l].self_attn.mode == "sparse" for l in self.index_layers)
        return sparse, sparse and use_triton("msa_decode", self.backend, self.cache.device)

    def _plan(self, meta, nq: int):
        if not self._sparse_triton()[1]:
            return None
        p = self.plan
        if p is None or p.width != meta.width or p.nq != nq or p.batch != meta.batch:
            s = self.sel
            p = self.plan = plan_decode(
                self.cache.layer(self.index_layers[0]), batch=meta.batch, nq=nq, num_heads=self.cfg.num_heads,
                width=meta.width, topk=s.topk, local_blocks=s.local_blocks, init_blocks=s.init_blocks,
                seq_lens=meta.seq_lens_host, page_table=meta.page_table_host,
            )
        return p

    def _forward(self, new: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, page_table: torch.Tensor,
                 seq_lens: torch.Tensor, plan, compiled: bool = False) -> torch.Tensor:
        """The model's forward over one `PagedStep` from device metadata only: new [B, nq] token
        ids, positions [B, nq], slots int64 [B * nq], page_table int32 [B, W], seq_lens int32 [B]
        -> the last position's logits [B, V].  No host sync and no Python value that depends on
        the lengths (shapes only), so it can be captured (the ops are the same either way).
        compiled: through `compiled_step_forward` (unless its compilation failed before; errors
        of the step itself propagate as in the uncompiled forward)."""
        if compiled and self.compile_disabled_reason is None:
            try:
                with paged_step_context(self.cache, plan, self.backend):
                    return compiled_step_forward()(self.model, new, positions, slots, page_table, seq_lens)
            except torch._dynamo.exc.TorchDynamoException as e:  # dynamo / inductor failed: run uncompiled
                self.compile_disabled_reason = f"the compiled step failed{error_site(e)} ({type(e).__name__}: " \
                                               f"{str(e).strip()[:300]})"
                warnings.warn(f"msakit.generate: compile=True disabled, decoding uncompiled: "
                              f"{self.compile_disabled_reason}", RuntimeWarning, stacklevel=3)
        step = PagedStep(self.cache, positions, slots, page_table, seq_lens, plan, self.backend)
        return self.model(new, cache=step, logits_to_keep=1).logits[:, -1]

    def _check_new(self, new: torch.Tensor) -> tuple[int, int]:
        B, nq = new.shape
        if B != len(self.seq_ids):
            raise ValueError(f"new tokens for {B} rows, decoder batch {len(self.seq_ids)}")
        return B, nq

    def _eager_forward(self, new: torch.Tensor, starts: list[int], slots: torch.Tensor) -> torch.Tensor:
        """The eager step after its bookkeeping (slots reserved): metadata and plan of the current width."""
        nq = new.shape[1]
        meta = self.cache.decode_metadata(self.seq_ids)
        plan = self._plan(meta, nq)
        positions = torch.tensor(starts, device=new.device).unsqueeze(1) + torch.arange(nq, device=new.device)
        return self._forward(new, positions, slots, meta.page_table, meta.seq_lens, plan)

    @torch.no_grad()
    def step(self, new: torch.Tensor) -> torch.Tensor:
        nq = self._check_new(new)[1]
        if self.cuda_graph and self.graph_disabled_reason is None:
            out = self._graph_step(new)
            if out is not None:
                return out
        elif self.compile:  # the compiled step from the static buffers, no capture
            g = self.static_buffers(nq)
            if self.stage(g, new):
                return self.static_step(g)
        starts = [self.cache.length(sid) for sid in self.seq_ids]
        slots = self.cache.append_slots(self.seq_ids, nq)
        return self._eager_forward(new, starts, slots)

    # ------------------------------------------------------------------ static (CUDA-graph) step
    def graph_unsupported_reason(self) -> str | None:
        """Why this model's decode step cannot be captured (checked before any capture), or None."""
        sparse, triton = self._sparse_triton()
        if sparse and not triton:
            return (f"msa_decode runs its PyTorch reference (decode_backend={self.backend!r}), which reads the "
                    "lengths on the host")
        for i, layer in enumerate(self.layers):
            if not layer.is_moe:
                continue
            moe = layer.block_sparse_moe
            if not isinstance(moe, MoE) or type(moe).forward is not MoE.forward:
                return f"layer {i}: the MoE ({type(moe).__name__}) is not msakit's MoE (its forward may sync)"
            why = moe.capture_blocker()
            if why is not None:
                return f"layer {i}: {why}"
        return None

    def static_buffers(self, nq: int) -> _GraphStep:
        """The static buffers of the (batch, nq) step (created once; a new plan for the full width)."""
        g = self._graphs.get(nq)
        if g is None:
            B, W, s = len(self.seq_ids), self.graph_width, self.sel
            plan = None
            if self._sparse_triton()[1]:
                plan = plan_decode(self.cache.layer(self.index_layers[0]), batch=B, nq=nq, num_heads=self.cfg.num_heads,
                                   width=W, topk=s.topk, local_blocks=s.local_blocks, init_blocks=s.init_blocks)
            g = self._graphs[nq] = _GraphStep(B, nq, W, self.cache.device, plan)
        return g

    def stage(self, g: _GraphStep, new: torch.Tensor) -> bool:
        """Host bookkeeping of one static step: reserve the new slots (pages) and write ids,
        positions, slots, page table and lengths into g's device buffers (no host sync).  False,
        reserving nothing, when a sequence would outgrow the static page table (max_len)."""
        cache, ps, W = self.cache, self.cache.page_size, g.width
        nq = new.shape[1]
        starts = [cache.length(sid) for sid in self.seq_ids]
        if any(-(-(st + nq) // ps) > W for st in starts):
            return False
        slots = cache.append_slots_host(self.seq_ids, nq)
        table: list[int] = []
        for sid in self.seq_ids:
            pages = cache.pages(sid)
            table += pages + [0] * (W - len(pages))
        table += [0] * (g.lens_at - len(table)) + [st + nq for st in starts]
        g.ids.copy_(new, non_blocking=True)
        _h2d(g.i64, [st + i for st in starts for i in range(nq)] + slots)
        _h2d(g.i32, table)
        return True

    def static_step(self, g: _GraphStep) -> torch.Tensor:
        """The whole decode step from g's buffers (what the CUDA graph captures) -> logits [B, V];
        compiled with compile=True."""
        return self._forward(g.ids, g.positions, g.slots, g.page_table, g.seq_lens, g.plan, compiled=self.compile)

    def _disable_graph(self, reason: str) -> None:
        self.graph_disabled_reason = reason
        graph_warning(reason)

    def _graph_step(self, new: torch.Tensor) -> torch.Tensor | None:
        """Replay (capturing first if needed) the step graph; None: run the eager step instead."""
        nq = new.shape[1]
        if nq not in self._graphs:
            reason = self.graph_unsupported_reason()
            if reason is not None:
                self._disable_graph(reason)
                return None
        g = self.static_buffers(nq)
        if not self.stage(g, new):
            return None  # longer than max_len: this step runs eagerly (the cache is shared)
        if g.graph is None:
            return self._capture(g, new)
        g.graph.replay()
        return g.logits.clone()

    def _capture(self, g: _GraphStep, new: torch.Tensor) -> torch.Tensor:
        """Warm-up (the real step, eagerly on a side stream, any host sync an error), capture,
        replay.  On failure the step's logits come from the warm-up or the eager forward.  With
        compile=True the compiled step runs once first, outside the warm-up's sync check:
        compilation and inductor's autotuning synchronize (the step is idempotent: it writes the
        same keys into the same slots)."""
        if self.compile:
            self.static_step(g)
        try:
            out, graph, logits = capture_graph(lambda: self.static_step(g), self.cache.device)
        except GraphCaptureError as e:
            if e.out is not None:  # the warm-up ran the step: its logits are this step's
                self._disable_graph(e.describe("the decode step"))
                return e.out
            self._disable_graph(e.describe("the warm-up step"))
            starts = [L - g.nq for L in (self.cache.length(sid) for sid in self.seq_ids)]
            slots = g.slots.clone()  # the slots reserved by stage()
            return self._eager_forward(new, starts, slots)
        g.graph, g.logits = graph, logits
        graph.replay()
        return logits.clone()



# ---------------------------------------------------------------------------------------------
# Decoders (and their captured graphs) kept across generate calls
# ---------------------------------------------------------------------------------------------

_DECODERS = StatePool()


def decoder_for(model: Any, batch: int, max_len: int, *, kv_dtype: torch.dtype | None = None, backend: str = "auto",
                cuda_graph: bool = False, compile: bool = False) -> PagedDecoder:
    """A `PagedDecoder` for `batch` rows of up to `max_len` tokens (`round_length`), reset and
    reused from earlier calls with the same (batch, rounded max_len, kv_dtype, backend,
    cuda_graph, compile) while `model_state_key(model)` is unchanged, so its pools and CUDA graphs survive
    across `generate` calls.  Use it as a context manager (`with decoder_for(...) as dec:`):
    leaving it returns the decoder to the pool.  `clear_decoders` frees them."""
    L = round_length(max_len)

    def make() -> PagedDecoder:
        dec = PagedDecoder(model, batch, L, kv_dtype=kv_dtype, backend=backend, cuda_graph=cuda_graph,
                           compile=compile)
        dec._pooled = True
        return dec

    key = (int(batch), L, kv_dtype, backend, bool(cuda_graph), bool(compile))
    dec = _DECODERS.get(model, model_state_key(model), key, make)
    dec.model = model
    return dec


def clear_decoders(model: Any = None) -> None:
    """Drop the pooled decoders (and their graphs) of `model`, or of every model."""
    _DECODERS.clear(model)


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
    cache: str = "auto",
    decode_backend: str = "auto",
    kv_dtype: torch.dtype | None = None,
    cuda_graph: bool | None = None,
    compile: bool = False,
):
    """Cached generation for models whose forward takes a cache (M3ForCausalLM) -> tokens [B, T + n]
    (and the per-step logits [B, n, V] with return_logits).  Stops early once every row has
    produced an eos token (finished rows repeat the first eos id).

    cache: "contiguous" (`KVCache`), "paged" (`PagedKVCache` + `msa_decode`; see the module
    docstring) or "auto" (paged on CUDA when `paged_supported(model)`, contiguous otherwise).
    decode_backend is msa_decode's backend on the paged path ("auto" | "triton" | "reference");
    kv_dtype the paged pools' dtype (default: the model's dtype; fp8 e4m3 is accepted).
    cuda_graph: None (auto: on for the paged path on CUDA), True (the paged path on CUDA only) or
    False (eager): the paged decode step is captured once as a CUDA graph and replayed (see the
    module docstring); a model whose step cannot be captured decodes eagerly with a warning.
    compile: the paged decode step runs under torch.compile (inductor fuses its elementwise work;
    the CUDA graph, if any, captures the compiled step; see `PagedDecoder`); needs the paged
    path, which cache="auto" then picks on any device where `paged_supported(model)`."""
    if cache not in CACHE_KINDS:
        raise ValueError(f"cache must be one of {CACHE_KINDS}, got {cache!r}")
    if cuda_graph not in (None, True, False):
        raise ValueError(f"cuda_graph must be None, True or False, got {cuda_graph!r}")
    if compile not in (True, False):
        raise ValueError(f"compile must be True or False, got {compile!r}")
    if compile and cache == "contiguous":
        raise ValueError("compile=True compiles the paged decode step: use cache='paged' or 'auto'")
    if cache == "auto":

        on_gpu = input_ids.device.type == "cuda" and triton_available()
        cache = "paged" if compile or (on_gpu and paged_supported(model) is None) else "contiguous"
    if cache == "paged":
        why = paged_supported(model)
        if why is not None:
            need = "compile=True needs the paged path" if compile else "cache='paged'"
            raise ValueError(f"{need}, which is not supported for this model: {why}")
    graph = cache == "paged" and input_ids.device.type == "cuda" and cuda_graph is not False
    if cuda_graph and not graph:
        raise ValueError(f"cuda_graph=True needs the paged cache on CUDA, got cache={cache!r} on "
                         f"{input_ids.device.type}")

    loop_args = (temperature, top_k, top_p, generator, streamer, eos_token_id, return_logits)
    max_len = input_ids.shape[1] + max(max_new_tokens, 1)
    if cache == "paged":
        with decoder_for(model, input_ids.shape[0], max_len, kv_dtype=kv_dtype, backend=decode_backend,
                         cuda_graph=graph, compile=compile) as dec:

            def make_paged_step() -> Callable[[torch.Tensor | None], torch.Tensor]:
                return lambda new: dec.prefill(input_ids) if new is None else dec.step(new)

            return _run_eval(model, make_paged_step, input_ids, max_new_tokens, *loop_args)

    def make_step() -> Callable[[torch.Tensor | None], torch.Tensor]:
        kv = KVCache(model.config.num_hidden_layers, max_len)
        return lambda new: model(input_ids if new is None else new, cache=kv, logits_to_keep=1).logits[:, -1]

    return _run_eval(model, make_step, input_ids, max_new_tokens, *loop_args)


@torch.no_grad()
def generate_uncached(model: Any, input_ids: torch.Tensor, max_new_tokens: int, **sampling: Any):
    """The same loop recomputing the whole sequence each step (any model whose forward(input_ids,
    compute_kl=False) returns .logits); the reference the cached path is tested against.
    `sampling`: generate's keyword arguments temperature, top_k, top_p, generator, streamer,
    eos_token_id and return_logits (same defaults)."""
    opts = keyword_options(sampling, dict(temperature=1.0, top_k=None, top_p=None, generator=None, streamer=None,
                                          eos_token_id=None, return_logits=False), "generate_uncached")
    def make_step() -> Callable[[torch.Tensor | None], torch.Tensor]:
        seq = [input_ids]

        def step(new: torch.Tensor | None) -> torch.Tensor:
            if new is not None:
                seq.append(new)
            ids = torch.cat(seq, dim=1)
            return model(ids, compute_kl=False).logits[:, -1]

        return step

    return _run_eval(model, make_step, input_ids, max_new_tokens, *opts.values())
