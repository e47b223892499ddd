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

Paged path (`generate(..., cache="paged")`, the default on CUDA through cache="auto"): the
prompt runs through the same prefill as the contiguous path (`forward_cached` on a capturing
cache), its per-layer K / V / index keys go into a `msakit.cache.PagedKVCache` (one sequence per
row, page = selection block, index keys for the MSA layers only), and every decode step runs
the layers one by one on the new token: project, `cache.write` into the step's slots, then
`msa_decode` for sparse-mode MSA layers (one page table and one `plan_decode` per step, shared
by all layers) or full attention over the gathered pages for dense-mode / dense GQA layers
(device-side gather through the page table; no host sync inside the layer loop).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

__all__ = ["KVCache", "sample_next", "generate", "generate_uncached", "paged_supported", "PagedDecoder"]

CACHE_KINDS = ("auto", "contiguous", "paged")


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
    sel = layers[0].self_attn.cfg
    if not _pow2_in(sel.block_size):
        return f"index block size {sel.block_size} (the page size) must be a power of two in [16, 256]"
    if not _pow2_in(sel.head_dim):
        return f"head_dim {sel.head_dim} must be a power of two in [16, 256]"
    if any(l.self_attn.index_branch for l in layers):
        if not _pow2_in(sel.index_dim):
            return f"index dim {sel.index_dim} must be a power of two in [16, 256]"
        if sel.topk > 64:
            return f"topk {sel.topk} > 64"
        if sel.num_heads // sel.num_kv_heads > 128:
            return f"{sel.num_heads // sel.num_kv_heads} query heads per kv head > 128"
    return None


class _PrefillCapture:
    """KVCache stand-in for the prefill forward (Tq == Tk): keeps each layer's k, v, k_idx and
    hands them back unchanged, so the prompt runs exactly the contiguous path's prefill."""

    def __init__(self, num_layers: int) -> None:
        self.length = 0
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.k_idx: list[torch.Tensor | None] = [None] * num_layers

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, k_idx: torch.Tensor | None):
        if self.length:
            raise ValueError("_PrefillCapture records one prefill only")
        self.k[layer], self.v[layer], self.k_idx[layer] = k, v, k_idx
        return k, v, k_idx

    def advance(self, n: int) -> None:
        self.length += n


class PagedDecoder:
    """Generation state of an M3ForCausalLM on a `PagedKVCache` (one sequence per batch row).

    `prefill(input_ids [B, T])` -> last logits [B, V]; `step(new [B, nq])` -> last logits [B, V]
    (nq <= 8 new tokens per row, all rows advancing together).  K / V of every layer and the
    index keys of the MSA layers live in the cache; sparse-mode MSA layers attend through
    `msa_decode` (one page table and plan per step), the others attend all their pages."""

    def __init__(self, model: Any, batch: int, max_len: int, *, kv_dtype: torch.dtype | None = None,
                 backend: str = "auto", num_pages: int | None = None) -> None:
        from msakit.cache import PagedKVCache

        why = paged_supported(model)
        if why is not None:
            raise ValueError(f"paged decoding is not supported for this model: {why}")
        self.model = model
        self.layers = list(model.model.layers)
        self.sel = self.layers[0].self_attn.cfg
        self.backend = backend
        self.index_layers = [i for i, l in enumerate(self.layers) if l.self_attn.index_branch]
        self._is_index = set(self.index_layers)
        ps = self.sel.block_size
        if kv_dtype is None:
            kv_dtype = model.dtype if model.dtype in (torch.float32, torch.float16, torch.bfloat16) else torch.bfloat16
        if num_pages is None:
            num_pages = batch * (-(-max_len // ps))
        self.cache = PagedKVCache(
            len(self.layers), num_pages, num_kv_heads=self.sel.num_kv_heads, head_dim=self.sel.head_dim,
            index_dim=self.sel.index_dim if self.index_layers else 0, page_size=ps, kv_dtype=kv_dtype,
            index_dtype=kv_dtype, index_layers=self.index_layers, device=model.device,
        )
        self.seq_ids = [self.cache.allocate() for _ in range(batch)]
        self.plan = None

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[0] != len(self.seq_ids):
            raise ValueError(f"input_ids has {input_ids.shape[0]} rows for a decoder of batch {len(self.seq_ids)}")
        cap = _PrefillCapture(len(self.layers))
        logits = self.model.forward_cached(input_ids, cap)
        for b, sid in enumerate(self.seq_ids):
            self.cache.prefill(sid, [k[b] for k in cap.k], [v[b] for v in cap.v],
                               [None if ki is None else ki[b] for ki in cap.k_idx])
        return logits

    def _plan(self, meta, nq: int):
        from msakit.ops._dispatch import use_triton
        from msakit.ops.decode import plan_decode

        if not any(self.layers[l].self_attn.mode == "sparse" for l in self.index_layers):
            return None
        if not use_triton("msa_decode", self.backend, self.cache.device):
            return None
        p = self.plan
        if p is None or p.width != meta.width or p.nq != nq or p.batch != meta.batch:
            s = self.sel
            p = self.plan = plan_decode(
                self.cache.layer(self.index_layers[0]), batch=meta.batch, nq=nq, num_heads=s.num_heads,
                width=meta.width, topk=s.topk, local_blocks=s.local_blocks, init_blocks=s.init_blocks,
                seq_lens=meta.seq_lens_host, page_table=meta.page_table_host,
            )
        return p

    @staticmethod
    def _pages(pool: torch.Tensor, scale: torch.Tensor | None, table: torch.Tensor) -> torch.Tensor:
        """pool [P, G, ps, D] gathered through table [B, W] -> [B, G, W * ps, D] (fp8 dequantized)."""
        B, W = table.shape
        if pool.dtype == torch.float8_e4m3fn:
            x = pool.view(torch.uint8)[table].view(torch.float8_e4m3fn).float() * scale[table].unsqueeze(-1)
        else:
            x = pool[table]  # [B, W, G, ps, D]
        G, ps, D = x.shape[2:]
        return x.permute(0, 2, 1, 3, 4).reshape(B, G, W * ps, D)

    def _dense(self, q: torch.Tensor, pools, table: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Full causal attention of q [B, nq, Hq, D] over every page of the rows (mask [B, 1, nq, W*ps])."""
        Hq, G = q.shape[2], pools.num_kv_heads
        qh = q.transpose(1, 2)
        kh = self._pages(pools.k, pools.k_scale, table).repeat_interleave(Hq // G, dim=1).to(qh.dtype)
        vh = self._pages(pools.v, pools.v_scale, table).repeat_interleave(Hq // G, dim=1).to(qh.dtype)
        o = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask,
                                                             scale=1.0 / math.sqrt(q.shape[-1]))
        return o.transpose(1, 2)

    @torch.no_grad()
    def step(self, new: torch.Tensor) -> torch.Tensor:
        from msakit.ops.decode import msa_decode

        B, nq = new.shape
        if B != len(self.seq_ids):
            raise ValueError(f"new tokens for {B} rows, decoder batch {len(self.seq_ids)}")
        cache, s = self.cache, self.sel
        dev = new.device
        starts = [cache.length(sid) for sid in self.seq_ids]
        slots = cache.append_slots(self.seq_ids, nq)
        meta = cache.decode_metadata(self.seq_ids)
        plan = self._plan(meta, nq)
        ar = torch.arange(nq, device=dev)
        positions = torch.tensor(starts, device=dev).unsqueeze(1) + ar  # [B, nq]
        # dense attention over all pages: key j visible to new query i iff j <= len - nq + i
        table = meta.page_table.long()
        rows = meta.seq_lens.long().unsqueeze(1) - nq + ar  # [B, nq]
        keys = torch.arange(meta.width * cache.page_size, device=dev)
        mask = (keys.view(1, 1, -1) <= rows.unsqueeze(-1)).unsqueeze(1)  # [B, 1, nq, W*ps]
        h = self.model.model.embed_tokens(new)
        G, D, Di = s.num_kv_heads, s.head_dim, s.index_dim
        for l, layer in enumerate(self.layers):
            attn = layer.self_attn
            q, k, v, q_idx, k_idx = attn.project(layer.input_layernorm(h), positions)
            ki = k_idx.reshape(B * nq, Di) if l in self._is_index else None
            cache.write(l, slots, k.reshape(B * nq, G, D), v.reshape(B * nq, G, D), ki)
            pools = cache.layer(l)
            if attn.index_branch and attn.mode == "sparse":
                o = msa_decode(q, q_idx, pools, meta.page_table, meta.seq_lens, plan=plan, topk=s.topk,
                               local_blocks=s.local_blocks, init_blocks=s.init_blocks, validate=False,
                               backend=self.backend)
            else:
                o = self._dense(q, pools, table, mask)
            h = h + attn.o_proj(o.reshape(B, nq, -1))
            h = layer._ffn(h)[0]
        return self.model.lm_head(self.model.model.norm(h[:, -1:]))[:, -1]


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
    cache: str = "auto",
    decode_backend: str = "auto",
    kv_dtype: torch.dtype | None = None,
):
    """Cached generation for models with `forward_cached` (M3ForCausalLM) -> tokens [B, T + n]
    (and the per-step logits [B, n, V] with return_logits).  Stops early once every row has
    produced an eos token (finished rows repeat the first eos id).

    cache: "contiguous" (`KVCache`), "paged" (`PagedKVCache` + `msa_decode`; see the module
    docstring) or "auto" (paged on CUDA when `paged_supported(model)`, contiguous otherwise).
    decode_backend is msa_decode's backend on the paged path ("auto" | "triton" | "reference");
    kv_dtype the paged pools' dtype (default: the model's dtype; fp8 e4m3 is accepted)."""
    if cache not in CACHE_KINDS:
        raise ValueError(f"cache must be one of {CACHE_KINDS}, got {cache!r}")
    if cache == "auto":
        from msakit.ops._dispatch import triton_available

        paged = input_ids.device.type == "cuda" and triton_available() and paged_supported(model) is None
        cache = "paged" if paged else "contiguous"
    if cache == "paged":
        why = paged_supported(model)
        if why is not None:
            raise ValueError(f"cache='paged' is not supported for this model: {why}")

    def make_step() -> Callable[[torch.Tensor | None], torch.Tensor]:
        if cache == "paged":
            dec = PagedDecoder(model, input_ids.shape[0], input_ids.shape[1] + max(max_new_tokens, 1),
                               kv_dtype=kv_dtype, backend=decode_backend)

            def step(new: torch.Tensor | None) -> torch.Tensor:
                return dec.prefill(input_ids) if new is None else dec.step(new)

            return step
        kv = KVCache(model.config.num_hidden_layers, input_ids.shape[1] + max(max_new_tokens, 1))

        def step(new: torch.Tensor | None) -> torch.Tensor:
            return model.forward_cached(input_ids if new is None else new, kv)

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
