"""Triton kernels of `msa_decode` (batched, split-K, no host sync, CUDA-graph capturable).

The multi-launch path (`DecodeTiling(launch="split")`): three launches per call with v1 scoring,
two with v2 (`plan_decode` picks by the index keys' dtype: v1 for bf16 / fp16 / fp32, v2 for fp8):

1. `_score_kernel` (v1), grid (S, B): split s of sequence b scores the pages
   [s * n / S, (s + 1) * n / S) of its n = ceil(L / page_size) pages.  One read of an
   index-key page [page_size, Di] serves every (query, group) row at once: the nq * G index
   queries are the rows of one [MP, Di] tile (MP = nq * G padded to 16), S = Q @ K^T on the
   tensor cores, causal mask, block max.  Each row keeps a running top-KP list of its split in
   registers as packed int64 keys (value bits << 32 | (2^31 - 1 - block)): the max key is the
   highest score and, among equal scores, the lowest block id -- the ranking of index_topk.
   Forced blocks score +inf, blocks past the row's own block -inf.
   At the end the list is sorted (ascending for even splits, descending for odd ones) and goes
   to a small buffer cand [B, S, MR, KP] (MR = nq * G padded to a power of 2).
   Selection merge (fused, "last arriver"): splits form clusters of CL; the last split of a
   cluster to finish (an atomic counter, acq_rel, after a CTA barrier) merges the cluster's
   CL lists into one (cand2 [B, NC, MR, KP]); the last cluster of a sequence merges the NC
   cluster lists into the final selection block_idx [B, G, nq, topk] (descending score, forced
   first, -1 padded).  The merges are bitonic merge-and-halve stages on the presorted lists
   (`_bitonic_merge`, no serial rounds).  The counters return to 0 for the next call.
1'. `_score2_kernel` (v2: fp8 index keys), same grid and selection merges: the page is the
   MMA's M dimension, S^T [PS, MP] = K [PS, Di] @ Q^T [Di, MP] (the key tile is the MMA's
   shared-memory operand; loads through a tensor map when the pool allows one, else pointer
   loads).  With a bf16 query the fp8 keys are scored as fp16 tensor-core products of the query
   pre-scaled by a power of 2 per row (exact: `_prescale_exp`).  The page loop only stores each
   page's block max per row to bmax [B, W, MR]; after the loop the split's top-KP list is built
   once from its maxima, in chunks of PCH pages (tl.topk, then a bitonic merge with the running
   list), and goes to the same cand buffer and merges as v1.  Selections equal v1's (the same
   keys; the dot differs only in summation order).
2. `_attn_kernel`, grid (NSA, G * NQC, B): the (query-chunk, group) rows -- the hpg heads of
   the group times the chunk's queries, M = hpg * QC rows padded to 16 -- attend the union
   of the chunk's selected blocks; split a of NSA takes a contiguous share of the chunk's
   flattened (query, slot) selection entries, skipping -1 and any block already listed by an
   earlier entry, and masks the rows of queries that did not select the block (and causally
   per token).  Writes a normalized partial output and its log2-sum-exp per row.
   With the plan's fuse_combine (v2), the last split of each (sequence, group, query chunk) to
   finish (an atomic counter, acq_rel, after a CTA barrier; reset to 0) merges the NSA
   partials itself and the third launch is skipped.
3. `_combine_kernel` (v1), grid (QC * hpg, G * NQC, B): LSE merge of the NSA partials.

One launch (`DecodeTiling(launch="ticket")`): `_ticket_kernel` runs the same
phases from the same @triton.jit helpers (`_score_v1` / `_score_v2` with their merges, `_attend`
with the fused combine).  Its programs take work items from an atomic ticket counter in order:
the scoring splits of every sequence first (sequence-major), then the attention splits.  The
last scorer of a sequence publishes the final selection with a ready flag (a release after a CTA
barrier); an attention item spins on its sequence's flag (acquire loads) and reads block_idx past
L1; the last attention split of a (sequence, group, query chunk) combines.  Since every scoring
ticket precedes every attention ticket, a spinning program waits only on items that running
programs hold and that wait on nothing: no deadlock whatever the grid and residency, and under
TRITON_INTERPRET=1 (programs one after another) program 0 takes every item.  One program per
item, each taking one ticket.  The last program to leave resets the ticket and exit counters and
the flags to 0 for the next call.

Everything reads the lengths from device memory; grids depend on shapes only (batch, nq,
the page-table width through the plan), so one capture serves every replay.
`tools.bench.decode.compile_report` compiles every kernel for sm_90 without a GPU (registers,
spills, shared memory, pipelined loads).
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from ..dispatch import interpret_mode

FP8 = torch.float8_e4m3fn
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
NEG_INF_KEY = tl.constexpr(-2139095041)  # float -inf (0xff800000) mapped to its ordered int32 key
INT64_MIN = tl.constexpr(-(2**63))
LN2_C = tl.constexpr(LN2)


def _dot_code(a: torch.dtype, b: torch.dtype) -> int:
    """0: bf16 tensor-core dots, 1: fp16, 2: fp32 (IEEE).  fp8 pools decode exactly into the
    query's 16-bit type."""
    b = a if b == FP8 else b
    if a == b == torch.bfloat16:
        # the Triton 3.6 interpreter computes bf16 x bf16 dots wrongly; bf16 -> fp32 is exact and
        # fp32 IEEE dots of the upcast values equal bf16 tensor-core dots up to summation order
        return 2 if interpret_mode() else 0
    if a == b == torch.float16:
        return 1
    return 2


@triton.jit
def _to_dot(x, CODE: tl.constexpr):
    if CODE == 0:
        y = x.to(tl.bfloat16)
    elif CODE == 1:
        y = x.to(tl.float16)
    else:
        y = x.to(tl.float32)
    return y


@triton.jit
def _dot(a, b, CODE: tl.constexpr):
    if CODE == 2:
        r = tl.dot(a, b, input_precision="ieee")
    else:
        r = tl.dot(a, b)
    return r


@triton.jit
def _pack(val, blk):
    """fp32 score + int32 block id -> int64 key ordered by (score desc, block asc)."""
    val = tl.where(val == 0.0, 0.0, val)  # -0.0 ties with +0.0, as in the reference's sort
    bits = val.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (key.to(tl.int64) << 32) | (2147483647 - blk).to(tl.int64)


@triton.constexpr_function
def _log2(n):
    """log2 of a power of two known at compile time."""
    return int(n).bit_length() - 1


@triton.jit
def _position_bit(ndim: tl.constexpr, j: tl.constexpr):
    """Bit j of the flat position in a [2] * ndim hypercube (whose axis ndim - 1 - j is bit j),
    as a 0 / 1 tensor that broadcasts against it."""
    return tl.reshape(tl.arange(0, 2), [1] * (ndim - 1 - j) + [2] + [1] * j)


@triton.jit
def _bitonic_merge(h, n_bits: tl.constexpr, order: tl.constexpr):
    """Sorts every run of 2^n_bits consecutive keys of h, an integer tensor of shape [2] * ndim
    (a hypercube over the flat positions: axis ndim - 1 - j is bit j), when each run is bitonic:
    ascending (order 0), descending (1), or run r ascending for even r and descending for odd r
    (2).  n_bits compare-exchange rounds, between the keys whose positions differ in bit
    n_bits - 1, then n_bits - 2, ..., 0; a key reads its partner as key ^ (xor over the pair's
    2-wide axis): one reduction per round."""
    tl.static_assert(h.dtype.is_int(), "_bitonic_merge sorts integer keys")
    ndim: tl.constexpr = _log2(h.numel)
    if order == 2:
        tl.static_assert(n_bits < ndim, "alternating order needs several runs")
        desc = _position_bit(ndim, n_bits)
    else:
        desc = order
    for r in tl.static_range(n_bits):  # partners differ in bit j = n_bits - 1 - r (axis ndim - n_bits + r)
        partner = h ^ tl.xor_sum(h, ndim - n_bits + r, keep_dims=True)
        wants_high = desc ^ _position_bit(ndim, n_bits - 1 - r)  # this position takes the pair's larger key
        h = tl.where((h > partner) != wants_high, partner, h)
    return h


@triton.jit
def _topk_of_sorted_chunks(x, K: tl.constexpr):
    """Top-K per row of x [R, W] int64 (descending) when every K-chunk of a row is already
    sorted, ascending for even chunks and descending for odd ones: log2(W / K) rounds of
    "max of each chunk pair (a bitonic run holding the pair's top K), then a bitonic merge of
    the runs" (alternating, the last one descending)."""
    log_n: tl.constexpr = _log2(x.shape[1])
    log_k: tl.constexpr = _log2(K)
    h = tl.reshape(x, [2] * _log2(x.numel))
    if log_k == log_n:  # a single (ascending) chunk: one bitonic merge sorts it descending
        h = _bitonic_merge(h, log_k, 1)
    for i in tl.static_range(log_k + 1, log_n + 1):
        h = tl.max(h, axis=(_log2(h.numel) - 1 - log_k))
        h = _bitonic_merge(h, log_k, 2 if i < log_n else 1)
    return tl.reshape(h, [x.shape[0], K])


@triton.jit
def _alt_sorted(keys, desc):
    """keys [R, KP] sorted along the last dim, ascending or (desc, a runtime flag) descending."""
    asc = tl.sort(keys, dim=1)
    return tl.where(desc, tl.flip(asc, 1), asc)


@triton.jit
def _merge(src_ptr, src_base, n_lists, dst_ptr, dst_base, b, dst_desc, FINAL: tl.constexpr,
           NQ: tl.constexpr, G: tl.constexpr, TOPK: tl.constexpr, MR: tl.constexpr, KP: tl.constexpr,
           NL: tl.constexpr, RB: tl.constexpr):
    """Top-KP keys per row of the union of `n_lists` (<= NL) lists [MR, KP] stored contiguously
    from src_ptr + src_base, list j sorted ascending for even j and descending for odd j
    (bitonic merges: compare-exchanges in registers and shuffles, no serial rounds), RB rows at a
    time.  FINAL: decode to block ids and write block_idx [B, G, NQ, TOPK] (-1 padded, valid
    ids first in descending score) for sequence b; else write the merged list [MR, KP] at
    dst_ptr + dst_base, sorted descending if dst_desc else ascending."""
    x = tl.arange(0, NL * KP)
    lst = x // KP
    kcol = tl.arange(0, KP)
    for r0 in tl.static_range(0, MR, RB):
        m = r0 + tl.arange(0, RB)
        off = src_base + (lst[None, :] * MR + m[:, None]).to(tl.int64) * KP + (x % KP)[None, :]
        keys = tl.load(src_ptr + off, mask=(lst < n_lists)[None, :], other=INT64_MIN, cache_modifier=".cg")
        top = _topk_of_sorted_chunks(keys, KP)  # [RB, KP], descending
        if FINAL:
            hi64 = top >> 32
            blk = (2147483647 - (top - (hi64 << 32))).to(tl.int32)
            blk = tl.where(hi64.to(tl.int32) > NEG_INF_KEY, blk, -1)
            i_m = m // G
            r_m = m % G
            o = ((b.to(tl.int64) * G + r_m[:, None]) * NQ + i_m[:, None]) * TOPK + kcol[None, :]
            tl.store(dst_ptr + o, blk, mask=(m < NQ * G)[:, None] & (kcol < TOPK)[None, :])
        else:
            top = tl.where(dst_desc, top, tl.flip(top, 1))
            tl.store(dst_ptr + dst_base + m[:, None].to(tl.int64) * KP + kcol[None, :], top)


@triton.jit
def _score_kernel(
    qi_ptr, kidx_ptr, pt_ptr, pt_stride, sl_ptr,
    cand_ptr, cand2_ptr, cnt1_ptr, cnt2_ptr, bidx_ptr,
    S, NC,
    NQ: tl.constexpr, G: tl.constexpr, DI: tl.constexpr, PS: tl.constexpr,
    TOPK: tl.constexpr, KP: tl.constexpr, MP: tl.constexpr, MR: tl.constexpr,
    LOCAL: tl.constexpr, INIT: tl.constexpr, CODE: tl.constexpr,
    CL: tl.constexpr, NC_PAD: tl.constexpr, RB1: tl.constexpr, RB2: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """Scoring v1 (16-bit or fp32 index keys; see the module docstring), grid (S, B)."""
    _score_v1(qi_ptr, kidx_ptr, pt_ptr, pt_stride, sl_ptr, cand_ptr, cand2_ptr, cnt1_ptr, cnt2_ptr, bidx_ptr,
              cnt2_ptr, tl.program_id(1), tl.program_id(0), S, NC, NQ, G, DI, PS, TOPK, KP, MP, MR, LOCAL, INIT,
              CODE, CL, NC_PAD, RB1, RB2, NUM_STAGES, False)


@triton.jit
def _score_v1(
    qi_ptr, kidx_ptr, pt_ptr, pt_stride, sl_ptr,
    cand_ptr, cand2_ptr, cnt1_ptr, cnt2_ptr, bidx_ptr, flag_ptr,
    b, s, S, NC,
    NQ: tl.constexpr, G: tl.constexpr, DI: tl.constexpr, PS: tl.constexpr,
    TOPK: tl.constexpr, KP: tl.constexpr, MP: tl.constexpr, MR: tl.constexpr,
    LOCAL: tl.constexpr, INIT: tl.constexpr, CODE: tl.constexpr,
    CL: tl.constexpr, NC_PAD: tl.constexpr, RB1: tl.constexpr, RB2: tl.constexpr,
    NUM_STAGES: tl.constexpr, PUBLISH: tl.constexpr,
):
    """Score split s of sequence b (v1), store its list, and merge as the last arriver;
    PUBLISH: the final merge also raises the sequence's ready flag (`_publish`)."""
    b64 = b.to(tl.int64)
    L, p0, p1 = _split_pages(sl_ptr, b, s, S, PS)

    m = tl.arange(0, MP)
    i_m = m // G
    pos = L - NQ + i_m  # position of the row's query; negative only for invalid input / padding
    own = tl.where(pos >= 0, pos // PS, -1)
    d = tl.arange(0, DI)
    t = tl.arange(0, PS)
    q = tl.load(qi_ptr + (b64 * (NQ * G) + m[:, None]) * DI + d[None, :], mask=(m < NQ * G)[:, None], other=0.0)
    q = _to_dot(q, CODE)
    kcol = tl.arange(0, KP)
    lst = tl.full([MP, KP], INT64_MIN, tl.int64)
    for p in tl.range(p0, p1, num_stages=NUM_STAGES):
        phys = tl.load(pt_ptr + b64 * pt_stride + p).to(tl.int64)
        ktt = tl.load(kidx_ptr + phys * (PS * DI) + t[None, :] * DI + d[:, None])  # [DI, PS]: K^T
        sc = _dot(q, _to_dot(ktt, CODE), CODE)  # [MP, PS] fp32
        j = p * PS + t
        sc = tl.where(j[None, :] <= pos[:, None], sc, float("-inf"))
        bm = tl.max(sc, axis=1)
        forced = ((p <= own) & (p > own - LOCAL)) | ((p < INIT) & (p <= own))
        bm = tl.where(forced, float("inf"), bm)
        bm = tl.where(p <= own, bm, float("-inf"))
        key = _pack(bm, tl.zeros([MP], tl.int32) + p)  # [MP]
        cur = tl.min(lst, axis=1)
        slot = tl.min(tl.where(lst == cur[:, None], kcol[None, :], KP), axis=1)
        upd = (kcol[None, :] == slot[:, None]) & (key > cur)[:, None]
        lst = tl.where(upd, key[:, None], lst)

    lst = _alt_sorted(lst, (s % 2) == 1)  # the merges expect even lists ascending, odd descending
    mrow = tl.arange(0, MP)
    cbase = (b64 * S + s) * (MR * KP)
    tl.store(cand_ptr + cbase + mrow[:, None].to(tl.int64) * KP + kcol[None, :], lst, mask=(mrow < MR)[:, None])
    _merge_tail(cand_ptr, cand2_ptr, cnt1_ptr, cnt2_ptr, bidx_ptr, flag_ptr, b, s, S, NC,
                NQ, G, TOPK, MR, KP, CL, NC_PAD, RB1, RB2, PUBLISH)


@triton.jit
def _split_pages(sl_ptr, b, s, S, PS: tl.constexpr):
    """Sequence b's length L and the page range [p0, p1) of score split s of S."""
    L = tl.load(sl_ptr + b)
    npg = (L + PS - 1) // PS
    p0 = ((s * npg.to(tl.int64)) // S).to(tl.int32)
    p1 = (((s + 1) * npg.to(tl.int64)) // S).to(tl.int32)
    return L, p0, p1


@triton.jit
def _publish(flag_ptr, b, PUBLISH: tl.constexpr):
    """With PUBLISH, raise sequence b's ready flag after its final selection stores (release)."""
    if PUBLISH:
        tl.debug_barrier()  # every thread's block_idx stores precede the release below
        tl.atomic_xchg(flag_ptr + b, 1, sem="release", scope="gpu")


@triton.jit
def _merge_tail(cand_ptr, cand2_ptr, cnt1_ptr, cnt2_ptr, bidx_ptr, flag_ptr, b, s, S, NC,
                NQ: tl.constexpr, G: tl.constexpr, TOPK: tl.constexpr, MR: tl.constexpr, KP: tl.constexpr,
                CL: tl.constexpr, NC_PAD: tl.constexpr, RB1: tl.constexpr, RB2: tl.constexpr,
                PUBLISH: tl.constexpr):
    """The fused selection merge ("last arriver") after split s of sequence b stored its list;
    the final merge raises b's ready flag with PUBLISH."""
    b64 = b.to(tl.int64)
    c = s // CL
    n_in = tl.minimum(CL, S - c * CL)
    tl.debug_barrier()  # every thread's candidate stores precede the release below
    old = tl.atomic_add(cnt1_ptr + b64 * NC + c, 1, sem="acq_rel", scope="gpu")
    if old == n_in - 1:  # last split of the cluster
        tl.store(cnt1_ptr + b64 * NC + c, 0)
        src = (b64 * S + c * CL) * (MR * KP)
        if NC == 1:
            _merge(cand_ptr, src, n_in, bidx_ptr, 0, b, True, True, NQ, G, TOPK, MR, KP, CL, RB1)
            _publish(flag_ptr, b, PUBLISH)
        else:
            _merge(cand_ptr, src, n_in, cand2_ptr, (b64 * NC + c) * (MR * KP), b, (c % 2) == 1, False,
                   NQ, G, TOPK, MR, KP, CL, RB1)
            tl.debug_barrier()
            old2 = tl.atomic_add(cnt2_ptr + b, 1, sem="acq_rel", scope="gpu")
            if old2 == NC - 1:  # last cluster of the sequence
                tl.store(cnt2_ptr + b, 0)
                _merge(cand2_ptr, b64 * NC * (MR * KP), NC, bidx_ptr, 0, b, True, True, NQ, G, TOPK, MR, KP,
                       NC_PAD, RB2)
                _publish(flag_ptr, b, PUBLISH)


@triton.jit
def _prescale_exp(amax):
    """Biased fp32 exponent field of a power-of-2 row scale for the fp16 scoring of fp8 keys:
    q * 2^(141 - E) < 2^15 (E the exponent field of the row's amax), so the bf16 query converts to
    fp16 exactly (down to ~2^-21 of the row max) and the fp8 x fp16 tensor-core products are
    exact; clamped so that the scale and its inverse stay normal numbers."""
    e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    return tl.minimum(tl.maximum(e, 15), 254)


@triton.jit
def _top_of_two(run, top, KP: tl.constexpr):
    """Top-KP (descending) of the union of two descending [R, KP] key lists."""
    x = tl.join(tl.flip(run, 1), top)  # [R, KP, 2]: an ascending then a descending chunk
    x = tl.reshape(tl.permute(x, (0, 2, 1)), [run.shape[0], 2 * KP])
    return _topk_of_sorted_chunks(x, KP)


@triton.jit
def _score2_kernel(
    qi_ptr, kidx_ptr, kdesc, kscale_ptr, pt_ptr, pt_stride, sl_ptr, bmax_ptr,
    cand_ptr, cand2_ptr, cnt1_ptr, cnt2_ptr, bidx_ptr,
    S, NC, W,
    NQ: tl.constexpr, G: tl.constexpr, DI: tl.constexpr, PS: tl.constexpr,
    TOPK: tl.constexpr, KP: tl.constexpr, MP: tl.constexpr, MR: tl.constexpr,
    LOCAL: tl.constexpr, INIT: tl.constexpr, CODE: tl.constexpr,
    TMA: tl.constexpr, PCH: tl.constexpr,
    CL: tl.constexpr, NC_PAD: tl.constexpr, RB1: tl.constexpr, RB2: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """Scoring v2 (fp8 index keys with per-token scales; see the module docstring), grid (S, B)."""
    _score_v2(qi_ptr, kidx_ptr, kdesc, kscale_ptr, pt_ptr, pt_stride, sl_ptr, bmax_ptr, cand_ptr, cand2_ptr,
              cnt1_ptr, cnt2_ptr, bidx_ptr, cnt2_ptr, tl.program_id(1), tl.program_id(0), S, NC, W, NQ, G, DI, PS,
              TOPK, KP, MP, MR, LOCAL, INIT, CODE, TMA, PCH, CL, NC_PAD, RB1, RB2, NUM_STAGES, False)


@triton.jit
def _score_v2(
    qi_ptr, kidx_ptr, kdesc, kscale_ptr, pt_ptr, pt_stride, sl_ptr, bmax_ptr,
    cand_ptr, cand2_ptr, cnt1_ptr, cnt2_ptr, bidx_ptr, flag_ptr,
    b, s, S, NC, W,
    NQ: tl.constexpr, G: tl.constexpr, DI: tl.constexpr, PS: tl.constexpr,
    TOPK: tl.constexpr, KP: tl.constexpr, MP: tl.constexpr, MR: tl.constexpr,
    LOCAL: tl.constexpr, INIT: tl.constexpr, CODE: tl.constexpr,
    TMA: tl.constexpr, PCH: tl.constexpr,
    CL: tl.constexpr, NC_PAD: tl.constexpr, RB1: tl.constexpr, RB2: tl.constexpr,
    NUM_STAGES: tl.constexpr, PUBLISH: tl.constexpr,
):
    """Score split s of sequence b (v2): S^T = K Q^T per page (the page's PS tokens are the M
    dimension), block max per row stored to bmax [B, W, MR]; the split's top-KP list is built
    once after the loop, then stored and merged as v1's (PUBLISH: see `_score_v1`)."""
    b64 = b.to(tl.int64)
    L, p0, p1 = _split_pages(sl_ptr, b, s, S, PS)

    m = tl.arange(0, MP)
    pos_m = L - NQ + m // G  # position of row m's query
    d = tl.arange(0, DI)
    t = tl.arange(0, PS)
    qt = tl.load(qi_ptr + (b64 * (NQ * G) + m[None, :]) * DI + d[:, None], mask=(m < NQ * G)[None, :], other=0.0)
    if CODE == 3:  # fp8 keys, 16-bit query: fp16 tensor-core dots of the exactly pre-scaled query
        qt = qt.to(tl.float32)
        e = _prescale_exp(tl.max(tl.abs(qt), axis=0))
        qt = (qt * ((268 - e) << 23).to(tl.float32, bitcast=True)[None, :]).to(tl.float16)
    else:
        qt = _to_dot(qt, CODE)
    brow = bmax_ptr + b64 * W * MR
    for p in tl.range(p0, p1, num_stages=NUM_STAGES):
        # evict_last: the page table and the block maxima stay in L2 while the keys stream through
        # (the attention grid reads the selected pages' entries, the end pass below the maxima)
        phys = tl.load(pt_ptr + b64 * pt_stride + p, eviction_policy="evict_last")
        if TMA:
            kt = kdesc.load([phys * PS, 0])  # [PS, DI]
        else:
            kt = tl.load(kidx_ptr + phys.to(tl.int64) * (PS * DI) + t[:, None] * DI + d[None, :])
        if CODE == 3:
            sc = tl.dot(kt.to(tl.float16), qt)  # [PS, MP] fp32
        else:
            sc = _dot(_to_dot(kt, CODE), qt, CODE)
        ks = tl.load(kscale_ptr + phys.to(tl.int64) * PS + t)
        sc = sc * ks[:, None]
        sc = tl.where((p * PS + t)[:, None] <= pos_m[None, :], sc, float("-inf"))
        tl.store(brow + p * MR + m, tl.max(sc, axis=0), mask=m < MR, eviction_policy="evict_last")

    # the split's top-KP per row from its block maxima (this CTA's own stores: a CTA barrier orders them)
    tl.debug_barrier()
    r = tl.arange(0, MR)
    pos_r = L - NQ + r // G
    own = tl.where(pos_r >= 0, pos_r // PS, -1)[:, None]
    if CODE == 3:  # undo the query's power-of-2 scale (exact)
        qr = tl.load(qi_ptr + (b64 * (NQ * G) + r[:, None]) * DI + d[None, :], mask=(r < NQ * G)[:, None],
                     other=0.0).to(tl.float32)
        inv = ((_prescale_exp(tl.max(tl.abs(qr), axis=1)) - 14) << 23).to(tl.float32, bitcast=True)[:, None]
    kcol = tl.arange(0, KP)
    run = tl.full([MR, KP], INT64_MIN, tl.int64)
    c = tl.arange(0, PCH)
    for c0 in range(p0, p1, PCH):
        pg = (c0 + c)[None, :]
        ok = pg < p1
        v = tl.load(brow + pg * MR + r[:, None], mask=ok, other=float("-inf"), cache_modifier=".cg")
        if CODE == 3:
            v = v * inv
        forced = ((pg <= own) & (pg > own - LOCAL)) | ((pg < INIT) & (pg <= own))
        v = tl.where(forced, float("inf"), v)
        v = tl.where(pg <= own, v, float("-inf"))
        key = tl.where(ok, _pack(v, pg + tl.zeros([MR, PCH], tl.int32)), INT64_MIN)
        if PCH == KP:
            top = tl.sort(key, dim=1, descending=True)
        else:
            top = tl.topk(key, KP, dim=1)
        if c0 == p0:
            run = top
        else:
            run = _top_of_two(run, top, KP)
    lst = tl.where((s % 2) == 1, run, tl.flip(run, 1))  # the merges expect even lists ascending, odd descending
    tl.store(cand_ptr + (b64 * S + s) * (MR * KP) + r[:, None].to(tl.int64) * KP + kcol[None, :], lst)
    _merge_tail(cand_ptr, cand2_ptr, cnt1_ptr, cnt2_ptr, bidx_ptr, flag_ptr, b, s, S, NC,
                NQ, G, TOPK, MR, KP, CL, NC_PAD, RB1, RB2, PUBLISH)


@triton.jit
def _attn_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, pt_ptr, pt_stride, sl_ptr, bidx_ptr, op_ptr, lp_ptr,
    o_ptr, lse_ptr, cnt3_ptr,
    qk_scale, NSA,
    NQ: tl.constexpr, G: tl.constexpr, HPG: tl.constexpr, D: tl.constexpr, PS: tl.constexpr,
    TOPK: tl.constexpr, KP: tl.constexpr, QC: tl.constexpr, NQC: tl.constexpr, MA: tl.constexpr,
    KV_FP8: tl.constexpr, CODE: tl.constexpr,
    FUSE_COMBINE: tl.constexpr = False, NSA_PAD: tl.constexpr = 1, RETURN_LSE: tl.constexpr = False,
):
    """Attention, grid (NSA, G * NQC, B) (see the module docstring)."""
    _attend(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, pt_ptr, pt_stride, sl_ptr, bidx_ptr, op_ptr, lp_ptr, o_ptr, lse_ptr,
            cnt3_ptr, qk_scale, NSA, tl.program_id(2), tl.program_id(1), tl.program_id(0), NQ, G, HPG, D, PS, TOPK,
            KP, QC, NQC, MA, KV_FP8, CODE, FUSE_COMBINE, NSA_PAD, RETURN_LSE)


@triton.jit
def _attend(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, pt_ptr, pt_stride, sl_ptr, bidx_ptr, op_ptr, lp_ptr,
    o_ptr, lse_ptr, cnt3_ptr,
    qk_scale, NSA, b, rc, s,
    NQ: tl.constexpr, G: tl.constexpr, HPG: tl.constexpr, D: tl.constexpr, PS: tl.constexpr,
    TOPK: tl.constexpr, KP: tl.constexpr, QC: tl.constexpr, NQC: tl.constexpr, MA: tl.constexpr,
    KV_FP8: tl.constexpr, CODE: tl.constexpr,
    FUSE_COMBINE: tl.constexpr, NSA_PAD: tl.constexpr, RETURN_LSE: tl.constexpr,
):
    """Attention split s of (sequence b, group-and-query-chunk rc): a normalized partial and its
    log2-sum-exp per row; with FUSE_COMBINE the last split to finish merges the NSA partials.
    block_idx is read past L1 (.cg): in the one-launch kernel another CTA wrote it."""
    r = rc // NQC
    qc = rc % NQC
    b64 = b.to(tl.int64)
    L = tl.load(sl_ptr + b)
    npg = (L + PS - 1) // PS
    E = QC * TOPK  # selection entries of this query chunk
    eps = (E + NSA - 1) // NSA
    e0 = s * eps
    e1 = tl.minimum(e0 + eps, E)

    m = tl.arange(0, MA)
    li = m // HPG  # query index inside the chunk
    i_m = qc * QC + li
    h_m = m % HPG
    row_ok = (m < QC * HPG) & (i_m < NQ)
    pos = L - NQ + i_m
    dd = tl.arange(0, D)
    t = tl.arange(0, PS)
    kcol = tl.arange(0, KP)
    q = tl.load(q_ptr + ((b64 * NQ + i_m[:, None]) * (G * HPG) + r * HPG + h_m[:, None]) * D + dd[None, :],
                mask=row_ok[:, None], other=0.0)
    q = _to_dot(q, CODE)
    sel_base = ((b64 * G + r) * NQ + qc * QC) * TOPK  # this chunk's entries, flattened (query, slot)
    sel = tl.load(bidx_ptr + sel_base + li[:, None] * TOPK + kcol[None, :],
                  mask=row_ok[:, None] & (kcol < TOPK)[None, :], other=-1, cache_modifier=".cg")
    flat = li[:, None] * TOPK + kcol[None, :]

    m_i = tl.full([MA], float("-inf"), tl.float32)
    l_i = tl.zeros([MA], tl.float32)
    acc = tl.zeros([MA, D], tl.float32)
    for e in tl.range(e0, e1, num_stages=1):  # (the one-launch kernel's num_stages is the scoring's)
        blk = tl.max(tl.max(tl.where(flat == e, sel, -1), axis=1), axis=0)  # entry e, from registers
        hit = sel == blk
        first = tl.min(tl.min(tl.where(hit, flat, E), axis=1), axis=0)
        if (blk >= 0) & (blk < npg) & (first == e):
            member = tl.max(hit.to(tl.int32), axis=1) > 0  # rows whose query selected blk
            phys = tl.load(pt_ptr + b64 * pt_stride + blk).to(tl.int64)
            j = blk * PS + t
            tok_ok = j < L
            kv_off = (phys * G + r) * (PS * D) + t[:, None] * D + dd[None, :]
            kt = tl.load(k_ptr + kv_off, mask=tok_ok[:, None], other=0.0)
            vt = tl.load(v_ptr + kv_off, mask=tok_ok[:, None], other=0.0)
            sc = _dot(q, tl.trans(_to_dot(kt, CODE)), CODE)  # [MA, PS]
            if KV_FP8:
                ks = tl.load(ks_ptr + (phys * G + r) * PS + t, mask=tok_ok, other=0.0)
                sc = sc * ks[None, :]
            sc = sc * qk_scale
            ok = member[:, None] & (j[None, :] <= pos[:, None])
            sc = tl.where(ok, sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(sc - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if KV_FP8:
                vs = tl.load(vs_ptr + (phys * G + r) * PS + t, mask=tok_ok, other=0.0)
                p = p * vs[None, :]
            acc = acc * alpha[:, None] + _dot(_to_dot(p, CODE), _to_dot(vt, CODE), CODE)
            m_i = m_new
    has = l_i > 0.0
    lse2 = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    row = ((b64 * G + r) * NQC + qc) * NSA + s
    tl.store(op_ptr + (row * MA + m[:, None]) * D + dd[None, :], o)
    tl.store(lp_ptr + row * MA + m, lse2)
    if FUSE_COMBINE:  # the last split of this (sequence, group, query chunk) to finish merges the NSA partials
        tl.debug_barrier()  # every thread's partial stores precede the release below
        cidx = (b64 * G + r) * NQC + qc
        old = tl.atomic_add(cnt3_ptr + cidx, 1, sem="acq_rel", scope="gpu")
        if old == NSA - 1:
            tl.store(cnt3_ptr + cidx, 0)
            base = cidx * NSA
            sp = tl.arange(0, NSA_PAD)
            lse_all = tl.load(lp_ptr + (base + sp[:, None]) * MA + m[None, :], mask=(sp < NSA)[:, None],
                              other=float("-inf"), cache_modifier=".cg")  # [NSA_PAD, MA]
            mx = tl.max(lse_all, axis=0)
            mxs = tl.where(mx == float("-inf"), 0.0, mx)
            den = tl.sum(tl.exp2(lse_all - mxs[None, :]), axis=0)
            acc = tl.zeros([MA, D], tl.float32)
            for j in tl.range(0, NSA, num_stages=1):
                lj = tl.load(lp_ptr + (base + j) * MA + m, cache_modifier=".cg")
                pj = tl.load(op_ptr + ((base + j) * MA + m[:, None]) * D + dd[None, :], cache_modifier=".cg")
                acc += tl.exp2(lj - mxs)[:, None] * pj
            ok = den > 0.0
            o = acc / tl.where(ok, den, 1.0)[:, None]
            h = r * HPG + h_m
            tl.store(o_ptr + ((b64 * NQ + i_m[:, None]) * (G * HPG) + h[:, None]) * D + dd[None, :],
                     o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
            if RETURN_LSE:
                val = tl.where(ok, (mxs + tl.log2(tl.where(ok, den, 1.0))) * LN2_C, float("-inf"))
                tl.store(lse_ptr + (b64 * (G * HPG) + h) * NQ + i_m, val, mask=row_ok)


@triton.jit
def _combine_kernel(
    op_ptr, lp_ptr, o_ptr, lse_ptr, NSA,
    NQ: tl.constexpr, G: tl.constexpr, HPG: tl.constexpr, D: tl.constexpr, QC: tl.constexpr,
    NQC: tl.constexpr, MA: tl.constexpr, NSA_PAD: tl.constexpr, RETURN_LSE: tl.constexpr,
):
    m = tl.program_id(0)  # row inside the (chunk, group): query m // HPG, head m % HPG
    rc = tl.program_id(1)
    b = tl.program_id(2)
    r = rc // NQC
    qc = rc % NQC
    i = qc * QC + m // HPG
    h = r * HPG + m % HPG
    if i < NQ:
        b64 = b.to(tl.int64)
        sp = tl.arange(0, NSA_PAD)
        dd = tl.arange(0, D)
        row = (((b64 * G + r) * NQC + qc) * NSA + sp) * MA + m
        ok = sp < NSA
        lse = tl.load(lp_ptr + row, mask=ok, other=float("-inf"))
        mx = tl.max(lse, axis=0)
        mxs = tl.where(mx == float("-inf"), 0.0, mx)
        w = tl.exp2(lse - mxs)
        den = tl.sum(w, axis=0)
        part = tl.load(op_ptr + row[:, None] * D + dd[None, :], mask=ok[:, None], other=0.0)
        o = tl.sum(w[:, None] * part, axis=0) / tl.where(den > 0.0, den, 1.0)
        tl.store(o_ptr + ((b64 * NQ + i) * (G * HPG) + h) * D + dd, o.to(o_ptr.dtype.element_ty))
        if RETURN_LSE:
            val = tl.where(den > 0.0, (mxs + tl.log2(tl.where(den > 0.0, den, 1.0))) * LN2_C, float("-inf"))
            tl.store(lse_ptr + (b64 * (G * HPG) + h) * NQ + i, val)


@triton.jit
def _ticket_kernel(
    qi_ptr, kidx_ptr, kdesc, kscale_ptr, pt_ptr, pt_stride, sl_ptr, bmax_ptr,
    cand_ptr, cand2_ptr, cnt1_ptr, cnt2_ptr, bidx_ptr, S, NC, W,
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, op_ptr, lp_ptr, o_ptr, lse_ptr, cnt3_ptr, qk_scale, NSA,
    work_ptr, B,
    NQ: tl.constexpr, G: tl.constexpr, DI: tl.constexpr, PS: tl.constexpr,
    TOPK: tl.constexpr, KP: tl.constexpr, MP: tl.constexpr, MR: tl.constexpr,
    LOCAL: tl.constexpr, INIT: tl.constexpr, CODE_IDX: tl.constexpr, V2: tl.constexpr,
    TMA: tl.constexpr, PCH: tl.constexpr,
    CL: tl.constexpr, NC_PAD: tl.constexpr, RB1: tl.constexpr, RB2: tl.constexpr, NUM_STAGES: tl.constexpr,
    HPG: tl.constexpr, D: tl.constexpr, QC: tl.constexpr, NQC: tl.constexpr, MA: tl.constexpr,
    KV_FP8: tl.constexpr, CODE_KV: tl.constexpr, NSA_PAD: tl.constexpr, RETURN_LSE: tl.constexpr,
):
    """The whole decode step of one layer in one launch (see the module docstring), one program
    per work item.

    work_ptr: int32 [2 + B] = (ticket counter, exit counter, one ready flag per sequence), all 0
    on entry and reset to 0 by the last program to leave.  Tickets [0, B * S) are the scoring
    items (sequence-major), [B * S, B * S + B * G * NQC * NSA) the attention items
    (sequence-major, then group-and-query-chunk, then split)."""
    total = B * S + B * G * NQC * NSA
    t = tl.atomic_add(work_ptr, 1, sem="relaxed", scope="gpu")
    n_score = B * S
    flags = work_ptr + 2  # one ready flag per sequence
    if t < total:  # a scoring split (its final merge raises the sequence's ready flag) or an attention
        # split that first waits for that flag
        if t < n_score:
            b = t // S
            if V2:
                _score_v2(qi_ptr, kidx_ptr, kdesc, kscale_ptr, pt_ptr, pt_stride, sl_ptr, bmax_ptr, cand_ptr, cand2_ptr,
                          cnt1_ptr, cnt2_ptr, bidx_ptr, flags, b, t - b * S, S, NC, W, NQ, G, DI, PS, TOPK, KP, MP, MR,
                          LOCAL, INIT, CODE_IDX, TMA, PCH, CL, NC_PAD, RB1, RB2, NUM_STAGES, True)
            else:
                _score_v1(qi_ptr, kidx_ptr, pt_ptr, pt_stride, sl_ptr, cand_ptr, cand2_ptr, cnt1_ptr, cnt2_ptr, bidx_ptr,
                          flags, b, t - b * S, S, NC, NQ, G, DI, PS, TOPK, KP, MP, MR, LOCAL, INIT, CODE_IDX, CL,
                          NC_PAD, RB1, RB2, NUM_STAGES, True)
        else:
            per_b = G * NQC * NSA
            u = t - n_score
            b = u // per_b
            rem = u - b * per_b
            rc = rem // NSA
            # every scoring ticket precedes this one: the programs that hold them are running and wait
            # on nothing, so the flag rises (in the interpreter this program scored b itself)
            ready = tl.atomic_add(flags + b, 0, sem="acquire", scope="gpu")
            while ready == 0:
                ready = tl.atomic_add(flags + b, 0, sem="acquire", scope="gpu")
            _attend(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, pt_ptr, pt_stride, sl_ptr, bidx_ptr, op_ptr, lp_ptr, o_ptr,
                    lse_ptr, cnt3_ptr, qk_scale, NSA, b, rc, rem - rc * NSA, NQ, G, HPG, D, PS, TOPK, KP, QC, NQC, MA,
                    KV_FP8, CODE_KV, True, NSA_PAD, RETURN_LSE)
    # the last program to leave (all items done) resets the queue for the next call
    left = tl.atomic_add(work_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if left == tl.num_programs(0) - 1:
        tl.store(work_ptr, 0)
        tl.store(work_ptr + 1, 0)
        i = tl.arange(0, 128)
        for b0 in range(0, B, 128):
            tl.store(work_ptr + 2 + b0 + i, 0, mask=b0 + i < B)


def _tma_ok(k_idx: torch.Tensor) -> bool:
    """Whether the index-key pool [P, PS, Di] can be read through one [P * PS, Di] tensor map."""
    return k_idx.is_contiguous() and k_idx.data_ptr() % 16 == 0 and (k_idx.shape[2] * k_idx.element_size()) % 16 == 0


def _index_desc(k_idx: torch.Tensor):
    from triton.tools.tensor_descriptor import TensorDescriptor

    P, PS, DI = k_idx.shape
    return TensorDescriptor(k_idx.view(P * PS, DI), [P * PS, DI], [DI, 1], [PS, DI])


def _rows_per_merge(mr: int, width: int, budget: int = 4096) -> int:
    """Rows merged at once so that a [rows, width] int64 tile stays ~32 registers per thread."""
    return max(1, min(mr, budget // width))


def next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def launch(plan, q, q_idx, pools, page_table, seq_lens, scale: float, return_lse: bool, phases: str = "all"):
    """Runs the phases with the plan's workspace; returns (o, lse or None).
    phases="select" stops after the selection (for benchmarks of the multi-launch path; returns
    (None, None)).  A "ticket" plan runs `_ticket_kernel` (one launch)."""
    B, NQ, HQ, D = q.shape
    G, DI, PS = pools.num_kv_heads, pools.index_dim, pools.page_size
    HPG = HQ // G
    dummy = plan.cnt2  # any int/float tensor for unused pointer args
    code_idx = _dot_code(q_idx.dtype, pools.k_idx.dtype)
    code_kv = _dot_code(q.dtype, pools.k.dtype)
    pt_stride = page_table.stride(0)
    S, NC = plan.score_splits, plan.num_clusters
    NC_PAD = next_pow2(NC)
    RB1 = _rows_per_merge(plan.mr, plan.cluster * plan.kp, plan.merge_budget)
    RB2 = _rows_per_merge(plan.mr, NC_PAD * plan.kp, plan.merge_budget)
    score_kw = dict(NQ=NQ, G=G, DI=DI, PS=PS, TOPK=plan.topk, KP=plan.kp, MP=plan.mp, MR=plan.mr,
                    LOCAL=plan.local_blocks, INIT=plan.init_blocks, CL=plan.cluster, NC_PAD=NC_PAD, RB1=RB1, RB2=RB2,
                    NUM_STAGES=plan.score_stages)
    v2 = plan.score_impl == "v2"
    tma = v2 and _tma_ok(pools.k_idx)
    kdesc = _index_desc(pools.k_idx) if tma else dummy
    if v2 and q_idx.dtype == torch.bfloat16:
        code_idx = 3  # exact fp16 products of the fp8 keys and the power-of-2 pre-scaled query
    NSA, QC, NQC, MA = plan.attn_splits, plan.qc, plan.nqc, plan.ma
    kv_scales = (pools.k_scale, pools.v_scale) if pools.kv_fp8 else (dummy, dummy)
    attn_kw = dict(HPG=HPG, D=D, QC=QC, NQC=NQC, MA=MA, KV_FP8=pools.kv_fp8, NSA_PAD=next_pow2(NSA),
                   RETURN_LSE=return_lse)
    if plan.launch != "split":
        if phases != "all":
            raise ValueError(f"a {plan.launch!r} plan runs every phase in one launch (phases='all')")
        o = torch.empty_like(q)
        lse = torch.empty(B, HQ, NQ, dtype=torch.float32, device=q.device) if return_lse else dummy
        _ticket_kernel[(plan.programs,)](
            q_idx, pools.k_idx, kdesc, pools.k_idx_scale if v2 else dummy, page_table, pt_stride, seq_lens,
            plan.bmax if v2 else dummy, plan.cand, plan.cand2, plan.cnt1, plan.cnt2, plan.block_idx, S, NC,
            page_table.shape[1], q, pools.k, pools.v, *kv_scales, plan.o_part, plan.lse_part, o, lse, plan.cnt3,
            scale * LOG2E, NSA, plan.work, B, CODE_IDX=code_idx, V2=v2, TMA=tma, PCH=plan.pch, CODE_KV=code_kv,
            **score_kw, **attn_kw, num_warps=plan.one_warps, num_stages=plan.score_stages,
        )
        return o, (lse if return_lse else None)
    launch_kw = dict(num_warps=plan.score_warps, num_stages=plan.score_stages)
    if v2:
        _score2_kernel[(S, B)](
            q_idx, pools.k_idx, kdesc, pools.k_idx_scale, page_table, pt_stride, seq_lens, plan.bmax,
            plan.cand, plan.cand2, plan.cnt1, plan.cnt2, plan.block_idx, S, NC, plan.bmax.shape[1],
            CODE=code_idx, TMA=tma, PCH=plan.pch, **score_kw, **launch_kw,
        )
    else:
        _score_kernel[(S, B)](
            q_idx, pools.k_idx, page_table, pt_stride, seq_lens,
            plan.cand, plan.cand2, plan.cnt1, plan.cnt2, plan.block_idx, S, NC, CODE=code_idx, **score_kw,
            **launch_kw,
        )
    if phases == "select":
        return None, None
    o = torch.empty_like(q)
    lse = torch.empty(B, HQ, NQ, dtype=torch.float32, device=q.device) if return_lse else plan.lse_part
    fuse = plan.fuse_combine
    attn_kw.pop("HPG")
    _attn_kernel[(NSA, G * NQC, B)](
        q, pools.k, pools.v, *kv_scales,
        page_table, pt_stride, seq_lens, plan.block_idx, plan.o_part, plan.lse_part,
        o if fuse else dummy, lse if fuse else dummy, plan.cnt3 if fuse else dummy, scale * LOG2E, NSA,
        NQ=NQ, G=G, HPG=HPG, PS=PS, TOPK=plan.topk, KP=plan.kp, CODE=code_kv, FUSE_COMBINE=fuse, **attn_kw,
        num_warps=plan.attn_warps, num_stages=1,
    )
    if fuse:
        return o, (lse if return_lse else None)
    _combine_kernel[(QC * HPG, G * NQC, B)](
        plan.o_part, plan.lse_part, o, lse, NSA, NQ=NQ, G=G, HPG=HPG, D=D, QC=QC, NQC=NQC, MA=MA,
        NSA_PAD=next_pow2(NSA), RETURN_LSE=return_lse,
        num_warps=4 if D * next_pow2(NSA) <= 8192 else 8,
    )
    return o, (lse if return_lse else None)
