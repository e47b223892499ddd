"""Reference meaning of `msa_decode` (pure PyTorch): gather each sequence's pages into contiguous
K / V / index-key tensors and run the prefill references with the queries being the LAST `nq`
positions of the sequence.

Paged layout of one layer (`PagedLayer`; see msakit/cache/paged.py for the cache that owns it):

    k, v         [num_pages, G, page_size, D]    bf16 / fp16 / fp32, or float8_e4m3fn codes
    k_scale      [num_pages, G, page_size]       float32, only with fp8 K  (k ~= codes * k_scale)
    v_scale      [num_pages, G, page_size]       float32, only with fp8 V
    k_idx        [num_pages, page_size, Di]      bf16 / fp16 / fp32, or float8_e4m3fn codes
    k_idx_scale  [num_pages, page_size]          float32, only with fp8 index keys
    page_table   int32 [batch, width]            physical page of the sequence's block p
    seq_lens     int32 [batch]                   tokens in the cache, INCLUDING the new ones

Token j of sequence b lives in page page_table[b, j // page_size] at slot j % page_size; a
block of the selection is a page (block_size = page_size).  The nq new queries of sequence b
sit at positions seq_lens[b] - nq .. seq_lens[b] - 1 (their K / V / index keys are already in
the cache), so query i selects and attends causally exactly as row seq_lens[b] - nq + i of
the prefill path (`index_topk` + `sparse_attention` on the whole sequence) does.  fp8 entries
mean their dequantized float32 values (codes * per-token scale).  A sequence of length 0 is a
padding slot: its output is 0, its lse -inf and its selection -1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..index_topk.reference import index_topk_reference
from ..sparse_attention.reference import sparse_attention_reference

FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class PagedLayer:
    """The pools of one layer of a paged KV cache (see the module docstring for the layout)."""

    k: torch.Tensor
    v: torch.Tensor
    k_idx: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    k_idx_scale: torch.Tensor | None = None

    @property
    def num_pages(self) -> int:
        return self.k.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k.shape[3]

    @property
    def index_dim(self) -> int:
        return 0 if self.k_idx is None else self.k_idx.shape[2]

    @property
    def kv_fp8(self) -> bool:
        return self.k.dtype == FP8

    @property
    def index_fp8(self) -> bool:
        return self.k_idx is not None and self.k_idx.dtype == FP8


def _dequant(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    if x.dtype == FP8:
        return x.float() * scale.unsqueeze(-1)
    return x


def _take(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x[idx] along dim 0 (through uint8 bytes for fp8, which lacks some indexing kernels)."""
    if x.dtype == FP8:
        return x.view(torch.uint8)[idx].view(FP8)
    return x[idx]


def gather_sequence(pools: PagedLayer, pages: list[int], length: int):
    """Contiguous (k [L, G, D], v [L, G, D], k_idx [L, Di] or None) of one sequence; fp8 pools
    come back dequantized to float32, the others in their own dtype."""
    n = (length + pools.page_size - 1) // pools.page_size
    idx = torch.tensor(pages[:n], dtype=torch.long, device=pools.k.device)

    def kv(x, s):
        x = _dequant(_take(x, idx), None if s is None else s[idx])  # [n, G, ps, D]
        return x.permute(0, 2, 1, 3).reshape(n * pools.page_size, x.shape[1], x.shape[3])[:length]

    k = kv(pools.k, pools.k_scale)
    v = kv(pools.v, pools.v_scale)
    ki = None
    if pools.k_idx is not None:
        x = _dequant(_take(pools.k_idx, idx), None if pools.k_idx_scale is None else pools.k_idx_scale[idx])
        ki = x.reshape(n * pools.page_size, x.shape[-1])[:length]
    return k, v, ki


def msa_decode_reference(
    q: torch.Tensor,
    q_idx: torch.Tensor,
    pools: PagedLayer,
    page_table,
    seq_lens,
    *,
    topk: int = 16,
    local_blocks: int = 1,
    init_blocks: int = 0,
    softmax_scale: float | None = None,
):
    """q [B, nq, Hq, D], q_idx [B, nq, G, Di] -> (o [B, nq, Hq, D] in q's dtype,
    lse [B, Hq, nq] float32, block_idx int32 [B, G, nq, topk])."""
    B, nq, Hq, D = q.shape
    G = q_idx.shape[2]
    ps = pools.page_size
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    lens = [int(x) for x in (seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else seq_lens)]
    table = page_table.tolist() if isinstance(page_table, torch.Tensor) else [list(r) for r in page_table]
    o = torch.zeros(B, nq, Hq, D, dtype=q.dtype, device=q.device)
    lse = torch.full((B, Hq, nq), float("-inf"), dtype=torch.float32, device=q.device)
    bi = torch.full((B, G, nq, topk), -1, dtype=torch.int32, device=q.device)
    for b in range(B):
        L = lens[b]
        if L == 0:
            continue
        if L < nq:
            raise ValueError(f"seq_lens[{b}] = {L} < nq = {nq}: the cache must hold the new tokens")
        k, v, ki = gather_sequence(pools, table[b], L)
        sel = index_topk_reference(
            q_idx[b : b + 1], ki[None], block_size=ps, topk=topk, local_blocks=local_blocks, init_blocks=init_blocks
        )
        ob, lb = sparse_attention_reference(
            q[b : b + 1], k[None], v[None], sel, block_size=ps, softmax_scale=scale, return_lse=True
        )
        o[b] = ob[0]
        lse[b] = lb[0]
        bi[b] = sel[0]
    return o, lse, bi
