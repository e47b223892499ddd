"""`msa_decode`: MiniMax Sparse Attention decode over a paged KV cache with index keys.

For a batch of sequences of different lengths with nq (1..8) new query tokens each (their K, V
and index keys already appended to the cache; several for speculative verification, causal among
themselves), every page of each sequence's index keys is scored, the top-k pages per
(sequence, group, query) are selected with the query's own page forced (the `index_topk`
contract; block = page) and only those pages are attended.  Token t of a sequence decodes to
exactly row t of the prefill path (`index_topk` + `sparse_attention` on the whole sequence).

    plan = plan_decode(cache.layer(0), batch=B, nq=nq, num_heads=Hq, width=meta.width,
                       topk=16, seq_lens=meta.seq_lens_host, page_table=meta.page_table_host)
    o = msa_decode(q, q_idx, cache.layer(l), meta.page_table, meta.seq_lens, plan=plan)

Inputs: q [B, nq, Hq, D], q_idx [B, nq, G, Di], the layer's pools (`PagedLayer`, layout in
reference.py), page_table int32 [B, width], seq_lens int32 [B] (lengths INCLUDING the new
tokens; 0 marks a padding slot whose output is 0).  Returns o [B, nq, Hq, D] in q's dtype,
then lse [B, Hq, nq] float32 with return_lse, then block_idx int32 [B, G, nq, topk] with
return_block_idx (the plan's buffer: valid until the plan's next call).

plan() / run() contract (as MiniMax's official decode): `plan_decode` runs outside CUDA-graph
capture -- it checks the host-side metadata (seq_lens as a list / CPU tensor, the CPU page
table: ValueError for a page id out of range, a sequence longer than its pages, 0 < length < nq,
nq > 8) and allocates the workspace (split buffers, counters).  `msa_decode(..., plan=plan)`
with device tensors then never reads GPU memory on the host: no .item(), no .tolist(); the
grids depend only on the shapes, so it can be captured once and replayed for any lengths that
fit the page table.  Without a plan, msa_decode builds one (eager use).  One plan serves all
layers of a forward (the page table is shared) but must not run on two streams at once.

Launches (`DecodeTiling.launch`): "split" (scoring, attention and, for 16-bit / fp32 index
keys, a combine kernel, one launch each) or "ticket" (one launch of the whole step, one program
per work item), the same work items and math (kernels in triton.py); "auto" (the default) takes
"ticket" for fp8 index keys with nq >= 2 and "split" otherwise (measured on an H100 at 1M, batch
1: split 118 / 81 us against ticket 123 / 84 at nq = 1 with bf16 / fp8 keys; at nq = 4 split 154
against 208 with bf16 keys, ticket 169 against 204 with fp8 keys; docs/kernels.md,
where a third launch, ~2 programs per SM looping over the items, lost everywhere and was removed).  For nq > 1 every launch reads each index-key page
once for all nq * G index queries and each selected K / V page once per (group, query chunk of up
to 128 / heads-per-group queries) for all the queries that selected it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..checks import check_positive_int
from ..dispatch import use_triton
from ..index_topk import check_selection
from .reference import FP8, PagedLayer, gather_sequence, msa_decode_reference

__all__ = ["msa_decode", "plan_decode", "DecodePlan", "DecodeTiling", "PagedLayer", "msa_decode_reference", "gather_sequence", "MAX_NQ"]

MAX_NQ = 8
FLOATS = (torch.float16, torch.bfloat16, torch.float32)
SCORE_PROGRAMS_PER_SM = 2  # scoring programs per SM over the batch (default score_splits)
MIN_PAGES_PER_SPLIT = 4  # fewer, longer splits below this: fewer lists to merge
LAUNCHES = ("auto", "split", "ticket")


def _pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class DecodeTiling:
    """How `msa_decode` cuts one call's work; a None field is chosen from the device and the
    shapes by `plan_decode`.  Tests set fields to reach, at small shapes, the code paths that the
    defaults take at large ones (two merge levels, row-chunked merges, a chunked final top-k).

    score_splits: splits of each sequence's pages in the scoring grid (at most 512; above 32 cut
    to a multiple of 16).  cluster: split lists merged by the last split of a cluster to finish (a
    power of two; default one merge level up to 32 lists, else clusters of 16 and a second level).
    attn_splits: splits of a (sequence, group, query chunk)'s selection entries in the attention
    grid.  merge_budget: int64 keys (rows x lists x topk) of one selection-merge tile.
    end_chunk: pages per chunk of the v2 scoring's final top-k pass (a power of two, raised to the
    top-k; one value for every shape keeps the number of compiled variants small).
    launch: "split" (the multi-launch path: scoring grid, attention grid, combine grid for v1),
    "ticket" (one launch with one program per item, each taking its item from a ticket counter)
    or "auto" ("ticket" for fp8 index keys with nq >= 2, else "split": the module docstring)."""

    score_splits: int | None = None
    cluster: int | None = None
    attn_splits: int | None = None
    merge_budget: int = 4096
    end_chunk: int = 32
    launch: str = "auto"

    def __post_init__(self) -> None:
        if self.launch not in LAUNCHES:
            raise ValueError(f"DecodeTiling.launch must be one of {LAUNCHES}, got {self.launch!r}")
        for name in ("score_splits", "cluster", "attn_splits", "merge_budget", "end_chunk"):
            val = getattr(self, name)
            if val is None and name in ("score_splits", "cluster", "attn_splits"):
                continue
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"DecodeTiling.{name} must be a positive integer, got {val!r}")
        if self.cluster is not None and self.cluster & (self.cluster - 1):
            raise ValueError(f"DecodeTiling.cluster must be a power of two, got {self.cluster}")


@dataclass
class DecodePlan:
    """Launch shapes and workspace of msa_decode for one (batch, nq, model shape, width).

    score_impl: "v1" (bf16 / fp16 / fp32 index keys: a running top-k per page, then the
    combine kernel) or "v2" (fp8 index keys: the page as the MMA's M dimension, block maxima
    then one top-k per split, the last attention split merging the partials: fuse_combine).
    launch: "split" or "ticket" (`DecodeTiling`; "auto" resolved).  "ticket" runs `programs`
    programs of `one_warps` warps with the fused combine; work int32 [2 + batch] holds its ticket
    and exit counters and per-sequence ready flags (0 between calls)."""

    batch: int
    nq: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    index_dim: int
    page_size: int
    width: int
    topk: int
    local_blocks: int
    init_blocks: int
    score_splits: int
    score_impl: str
    pch: int
    cluster: int
    num_clusters: int
    merge_budget: int
    attn_splits: int
    qc: int
    nqc: int
    ma: int
    mp: int
    mr: int
    kp: int
    fuse_combine: bool
    score_warps: int
    score_stages: int
    attn_warps: int
    device: torch.device
    cand: torch.Tensor
    cand2: torch.Tensor
    cnt1: torch.Tensor
    cnt2: torch.Tensor
    block_idx: torch.Tensor
    o_part: torch.Tensor
    lse_part: torch.Tensor
    bmax: torch.Tensor | None
    cnt3: torch.Tensor
    launch: str
    programs: int
    one_warps: int
    work: torch.Tensor

    def key(self) -> tuple:
        return (self.batch, self.nq, self.num_heads, self.num_kv_heads, self.head_dim, self.index_dim,
                self.page_size, self.topk, self.local_blocks, self.init_blocks)


def _check_pools(pools: PagedLayer) -> None:
    if not isinstance(pools, PagedLayer):
        raise ValueError(f"pools must be a PagedLayer (cache.layer(l)), got {type(pools).__name__}")
    k, v = pools.k, pools.v
    if k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"pools.k and pools.v must be [num_pages, G, page_size, D] of one shape, got "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.dtype != v.dtype or k.dtype not in FLOATS + (FP8,):
        raise ValueError(f"pools.k / pools.v must share a dtype in bf16/fp16/fp32/fp8 e4m3, got {k.dtype}, {v.dtype}")
    if pools.k_idx is None:
        raise ValueError("pools.k_idx is None: this layer has no index keys (a dense layer)")
    ki = pools.k_idx
    if ki.dim() != 3 or ki.shape[0] != k.shape[0] or ki.shape[1] != k.shape[2]:
        raise ValueError(f"pools.k_idx must be [num_pages={k.shape[0]}, page_size={k.shape[2]}, Di], got {tuple(ki.shape)}")
    if ki.dtype not in FLOATS + (FP8,):
        raise ValueError(f"pools.k_idx must be bf16/fp16/fp32/fp8 e4m3, got {ki.dtype}")
    for name, t in (("k", k), ("v", v), ("k_idx", ki)):
        if not t.is_contiguous():
            raise ValueError(f"pools.{name} must be contiguous")
    P, G, ps, _ = k.shape
    want = {"k_scale": (pools.kv_fp8, (P, G, ps)), "v_scale": (pools.kv_fp8, (P, G, ps)),
            "k_idx_scale": (pools.index_fp8, (P, ps))}
    for name, (need, shape) in want.items():
        t = getattr(pools, name)
        if need:
            if t is None or tuple(t.shape) != shape or t.dtype != torch.float32 or not t.is_contiguous():
                raise ValueError(f"fp8 pools need {name} float32 contiguous {list(shape)}, got "
                                 f"{None if t is None else (tuple(t.shape), t.dtype)}")
    for name, d in (("page_size", ps), ("head_dim", k.shape[3]), ("index_dim", ki.shape[2])):
        if d < 16 or d > 256 or d & (d - 1):
            raise ValueError(f"{name} must be a power of two in [16, 256] (tensor-core tiles), got {d}")
    devs = {t.device for t in (k, v, ki, pools.k_scale, pools.v_scale, pools.k_idx_scale) if t is not None}
    if len(devs) != 1:
        raise ValueError(f"the pools live on several devices: {devs}")


def _check_host_values(lens: list[int], table: torch.Tensor | None, nq: int, ps: int, num_pages: int, width: int) -> None:
    for b, L in enumerate(lens):
        if L < 0:
            raise ValueError(f"seq_lens[{b}] = {L} is negative")
        if 0 < L < nq:
            raise ValueError(f"seq_lens[{b}] = {L} < nq = {nq}: the cache must already hold the {nq} new tokens")
        if L > width * ps:
            raise ValueError(f"seq_lens[{b}] = {L} is longer than its pages: the page table holds {width} pages of "
                             f"{ps} tokens ({width * ps})")
        if table is not None and L > 0:
            n = _cdiv(L, ps)
            row = table[b, :n]
            lo, hi = int(row.min()), int(row.max())
            if lo < 0 or hi >= num_pages:
                raise ValueError(f"page_table[{b}, :{n}] holds page ids in [{lo}, {hi}] but the pool has pages "
                                 f"0..{num_pages - 1}")


def _host_lens(seq_lens) -> list[int] | None:
    if isinstance(seq_lens, (list, tuple)):
        return [int(x) for x in seq_lens]
    if isinstance(seq_lens, torch.Tensor) and seq_lens.device.type == "cpu":
        return [int(x) for x in seq_lens.tolist()]
    return None


def plan_decode(
    pools: PagedLayer,
    *,
    batch: int,
    nq: int,
    num_heads: int,
    width: int,
    topk: int = 16,
    local_blocks: int = 1,
    init_blocks: int = 0,
    seq_lens=None,
    page_table: torch.Tensor | None = None,
    tiling: DecodeTiling | None = None,
) -> DecodePlan:
    """Validate host-side metadata and allocate the workspace of msa_decode (outside capture).

    width: the page-table width (max pages per sequence) the plan will serve.  seq_lens (list or
    CPU tensor) and page_table (CPU tensor), when given, are checked (ValueError).  The scoring
    kernel follows the index keys' dtype: "v1" for bf16 / fp16 / fp32 keys (8 warps, 5 stages, the
    combine kernel), "v2" for fp8 keys (4 warps, 7 stages, the fused combine); the v2 kernel reads
    the key pages through a tensor map when the pool allows one (`triton._tma_ok`), else by
    pointer loads.  tiling: `DecodeTiling` (default: ~2 scoring programs per SM and at least
    MIN_PAGES_PER_SPLIT pages per split, ~2 attention programs per SM; the multi-launch path).
    The one-launch kernel (`DecodeTiling(launch="ticket")`) takes the same work items with the
    scoring's stages and warps (8 for v1; v2: 4, 8 above 32 attention rows)."""
    _check_pools(pools)
    check_selection(pools.page_size, topk, local_blocks, init_blocks)
    for name, val in (("batch", batch), ("nq", nq), ("num_heads", num_heads), ("width", width)):
        check_positive_int(name, val)
    if nq > MAX_NQ:
        raise ValueError(f"nq = {nq} new queries per sequence: msa_decode takes 1..{MAX_NQ}")
    if topk > 64:
        raise ValueError(f"topk = {topk}: msa_decode supports topk <= 64")
    if tiling is None:
        tiling = DecodeTiling()
    elif not isinstance(tiling, DecodeTiling):
        raise ValueError(f"tiling must be a DecodeTiling or None, got {type(tiling).__name__}")
    G, D, Di, ps = pools.num_kv_heads, pools.head_dim, pools.index_dim, pools.page_size
    if num_heads % G:
        raise ValueError(f"num_heads = {num_heads} must be a multiple of the pools' kv heads G = {G}")
    hpg = num_heads // G
    if hpg > 128:
        raise ValueError(f"{hpg} query heads per kv head: msa_decode supports at most 128")
    lens = _host_lens(seq_lens)
    if lens is not None:
        if len(lens) != batch:
            raise ValueError(f"seq_lens has {len(lens)} entries for batch = {batch}")
        table = None
        if page_table is not None:
            if page_table.device.type != "cpu":
                raise ValueError("plan_decode checks a CPU page table (the host copy); pass the device one to msa_decode")
            table = page_table
            if table.dim() != 2 or table.shape[0] != batch:
                raise ValueError(f"page_table must be [batch={batch}, width], got {tuple(table.shape)}")
        _check_host_values(lens, table, nq, ps, pools.num_pages, width if table is None else table.shape[1])
    dev = pools.k.device
    v2 = pools.index_fp8
    score_warps, score_stages = (4, 7) if v2 else (8, 5)
    elt = 1 if v2 else pools.k_idx.element_size()
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
    S = tiling.score_splits
    if S is None:
        S = min(_cdiv(SCORE_PROGRAMS_PER_SM * num_sms, batch), _cdiv(width, MIN_PAGES_PER_SPLIT))
    S = max(1, min(int(S), width, 512))
    if S > 32:  # whole clusters of 16 split lists: 264 -> 256 (both merge levels then take 16 lists)
        S -= S % 16
    cluster = tiling.cluster
    if cluster is None:  # one merge level up to 32 split lists, else clusters of 16 then one more level
        cluster = _pow2(S) if S <= 32 else 16
    S = min(S, cluster * 64)
    NC = _cdiv(S, cluster)
    qc = max(1, min(nq, 128 // hpg))
    nqc = _cdiv(nq, qc)
    E = qc * topk
    attn_splits = tiling.attn_splits
    if attn_splits is None:
        attn_splits = min(64, _cdiv(2 * num_sms, batch * G * nqc))
    NSA = max(1, min(int(attn_splits), E))
    ma = _pow2(max(16, qc * hpg))
    mr = _pow2(nq * G)
    mp = max(16, mr)
    kp = _pow2(topk)
    # Triton 3.6 on sm_90 keeps 3 fp8 index-key pages in shared memory at 7 stages for v2 (48 KiB;
    # the page table takes the other stages)
    stages = max(1, min(score_stages, (160 * 1024) // (ps * Di * elt) + (2 if v2 else 0)))
    i64, i32, f32 = torch.int64, torch.int32, torch.float32
    attn_warps = 4 if ma <= 64 else 8
    items = batch * S + batch * G * nqc * NSA
    one_warps = score_warps if not v2 else (4 if ma <= 32 else 8)
    launch = tiling.launch
    if launch == "auto":
        launch = "ticket" if v2 and nq >= 2 else "split"
    return DecodePlan(
        batch=batch, nq=nq, num_heads=num_heads, num_kv_heads=G, head_dim=D, index_dim=Di, page_size=ps,
        width=width, topk=topk, local_blocks=local_blocks, init_blocks=init_blocks, score_splits=S,
        score_impl="v2" if v2 else "v1", pch=max(kp, _pow2(tiling.end_chunk)),
        cluster=cluster, num_clusters=NC, merge_budget=tiling.merge_budget, attn_splits=NSA, qc=qc, nqc=nqc,
        ma=ma, mp=mp, mr=mr, kp=kp, fuse_combine=v2 or launch != "split", score_warps=score_warps,
        score_stages=stages, attn_warps=attn_warps, device=dev,
        cand=torch.empty(batch, S, mr, kp, dtype=i64, device=dev),
        cand2=torch.empty(batch, NC, mr, kp, dtype=i64, device=dev),
        cnt1=torch.zeros(batch, NC, dtype=i32, device=dev),
        cnt2=torch.zeros(batch, dtype=i32, device=dev),
        block_idx=torch.empty(batch, G, nq, topk, dtype=i32, device=dev),
        o_part=torch.empty(batch, G, nqc, NSA, ma, D, dtype=f32, device=dev),
        lse_part=torch.empty(batch, G, nqc, NSA, ma, dtype=f32, device=dev),
        bmax=torch.empty(batch, width, mr, dtype=f32, device=dev) if v2 else None,
        cnt3=torch.zeros(batch, G, nqc, dtype=i32, device=dev),
        launch=launch, programs=items, one_warps=one_warps,
        work=torch.zeros(2 + batch, dtype=i32, device=dev),
    )


def _check_qs(q, q_idx, pools: PagedLayer):
    for name, x, nd in (("q", q, 4), ("q_idx", q_idx, 4)):
        if not isinstance(x, torch.Tensor) or x.dim() != nd:
            raise ValueError(f"{name} must be a {nd}-d tensor")
        if x.dtype not in FLOATS:
            raise ValueError(f"{name} must be bf16/fp16/fp32, got {x.dtype}")
    B, nq, Hq, D = q.shape
    G, Di = pools.num_kv_heads, pools.index_dim
    if nq < 1 or nq > MAX_NQ:
        raise ValueError(f"q holds nq = {nq} new queries per sequence: msa_decode takes 1..{MAX_NQ}")
    if D != pools.head_dim:
        raise ValueError(f"q's head dim {D} differs from the cache's {pools.head_dim}")
    if tuple(q_idx.shape) != (B, nq, G, Di):
        raise ValueError(f"q_idx must have shape [B={B}, nq={nq}, G={G}, Di={Di}], got {tuple(q_idx.shape)}")
    if Hq % G:
        raise ValueError(f"q's head count {Hq} must be a multiple of the cache's kv heads G = {G}")
    if q.device != pools.k.device or q_idx.device != q.device:
        raise ValueError(f"q ({q.device}), q_idx ({q_idx.device}) and the pools ({pools.k.device}) must share a device")
    return B, nq, Hq, D


def msa_decode(
    q: torch.Tensor,
    q_idx: torch.Tensor,
    pools: PagedLayer,
    page_table: torch.Tensor,
    seq_lens,
    *,
    plan: DecodePlan | None = None,
    topk: int = 16,
    local_blocks: int = 1,
    init_blocks: int = 0,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    return_block_idx: bool = False,
    validate: bool | None = None,
    backend: str = "auto",
):
    """MSA decode step.  See the module docstring.

    validate: None (default) checks the metadata values only when they are on the host
    (seq_lens a list / CPU tensor, page_table a CPU tensor; they are then copied to q's device);
    True also copies device metadata to the host to check it (a GPU sync: not under capture);
    False skips the value checks.  Shape and dtype checks always run (no sync)."""
    _check_pools(pools)
    B, nq, Hq, D = _check_qs(q, q_idx, pools)
    check_selection(pools.page_size, topk, local_blocks, init_blocks)
    if plan is not None:
        topk, local_blocks, init_blocks = plan.topk, plan.local_blocks, plan.init_blocks
    if not isinstance(page_table, torch.Tensor) or page_table.dim() != 2 or page_table.shape[0] != B:
        raise ValueError(f"page_table must be an int32 tensor [B={B}, width]")
    if page_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"page_table must be int32, got {page_table.dtype}")
    width = page_table.shape[1]
    lens = _host_lens(seq_lens)
    if isinstance(seq_lens, torch.Tensor) and (seq_lens.dim() != 1 or seq_lens.shape[0] != B):
        raise ValueError(f"seq_lens must be [B={B}], got {tuple(seq_lens.shape)}")
    if lens is not None and len(lens) != B:
        raise ValueError(f"seq_lens has {len(lens)} entries for B = {B}")
    if validate is not False:
        vlens = lens
        table = page_table if page_table.device.type == "cpu" else None
        if validate:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise ValueError("validate=True reads device metadata: not allowed during CUDA-graph capture")
            vlens = vlens if vlens is not None else [int(x) for x in seq_lens.tolist()]
            table = page_table.cpu() if table is None else table
        if vlens is not None:
            _check_host_values(vlens, table, nq, pools.page_size, pools.num_pages, width)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    if not use_triton("msa_decode", backend, q.device):
        o, lse, bi = msa_decode_reference(q, q_idx, pools, page_table, seq_lens if lens is None else lens,
                                          topk=topk, local_blocks=local_blocks, init_blocks=init_blocks,
                                          softmax_scale=scale)
        res = (o,) + ((lse,) if return_lse else ()) + ((bi,) if return_block_idx else ())
        return res[0] if len(res) == 1 else res
    from .triton import launch

    if plan is None:
        plan = plan_decode(pools, batch=B, nq=nq, num_heads=Hq, width=width, topk=topk,
                           local_blocks=local_blocks, init_blocks=init_blocks)
    want = (B, nq, Hq, pools.num_kv_heads, D, pools.index_dim, pools.page_size)
    if plan.key()[:7] != want or plan.device != q.device:
        raise ValueError(f"plan was made for (batch, nq, Hq, G, D, Di, page_size) = {plan.key()[:7]} on "
                         f"{plan.device}, got {want} on {q.device}")
    if plan.score_impl != ("v2" if pools.index_fp8 else "v1"):
        raise ValueError(f"plan was made for {'fp8' if plan.score_impl == 'v2' else '16-bit / fp32'} index keys, "
                         f"but pools.k_idx is {pools.k_idx.dtype}")
    dev = q.device
    if lens is not None:
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    elif seq_lens.dtype != torch.int32 or seq_lens.device != dev:
        seq_lens = seq_lens.to(device=dev, dtype=torch.int32)
    if page_table.dtype != torch.int32 or page_table.device != dev:
        page_table = page_table.to(device=dev, dtype=torch.int32)
    if page_table.stride(1) != 1:
        page_table = page_table.contiguous()
    o, lse = launch(plan, q.contiguous(), q_idx.contiguous(), pools, page_table, seq_lens, scale, return_lse)
    res = (o,) + ((lse,) if return_lse else ()) + ((plan.block_idx,) if return_block_idx else ())
    return res[0] if len(res) == 1 else res
