"""KV-outer block-sparse attention in Triton: forward and backward (also runs under
TRITON_INTERPRET=1 on the CPU, which is how the tests run it).

Meaning: `reference.py`.  Everything below works on *flat tokens*: q [N, Hq, D], k/v [N, G, D]
with N = B*T (a batch is B packed documents of length T; a varlen batch gives its documents
through cu_seqlens).  Selected block b of the document holding query n is the key (one
(group g, block) pair) whose tokens start at doc_start(n) + b*block_size; the key is named by
the integer g*N + that start token, so unaligned document starts need nothing special, and
the causal rule "key token j <= query token n" (flat indices) also keeps every token inside
its document and below N.

Work list (`_build_items`: three Triton kernels around one torch sort on the device, no host
sync; it generalises `k2q.build_k2q` to query chunks, documents and bounded items).  Per chunk
of C query rows:
canonicalise each (group, row) selection (drop -1, duplicates and blocks past the row's own
block; ascending, valid first; slot = position) -> entries (query n, slot s) stably sorted by
key -> *items*: runs of at most `item_queries` entries of one key.  One program takes one item:
it loads the key's K and V [block_size, D] once (they stay in shared memory) and loops over
sub-tiles of q_tile entries x Hq/G heads; the next sub-tile's Q rows are loaded into registers
while the current one computes (an indirect gather, which Triton's pipeliner does not overlap).
Items of one key are adjacent in the grid (K/V reuse in L2), every item is at most the same
work (hot keys are simply more items), and the grid is an upper bound (`max_items`; padding
items do nothing).

Forward combine:
  every (query, head, slot) gets a partial output normalised by its own softmax sum, in
  q.dtype, plus its own lse_s = m_s + log l_s in fp32.  The partial buffers hold ONE KV group
  and are *entry-major* (`OP` [M_g entries x Hq/G heads, D], `LP` [M_g x Hq/G]; entry = position
  in the key-sorted work list less the group's first entry), so a sub-tile's rows are
  contiguous (one store, no per-row slot load); `inv` maps (group, row, slot) to its entry.  A
  merge kernel forms lse = logsumexp_s lse_s and o = sum_s exp(lse_s - lse) O_s over the row's
  valid slots (slot s is valid iff s < nvalid(g, n): nothing is pre-filled).
  Groups one after another: keys g * N + start sort group by group, so group g's valid entries
  E_g .. E_{g+1}-1 and its items are contiguous (`_Items.grp_ent`, `grp_item`: device cumsums,
  no host sync); the main kernel and the merge are launched once per group over them (grid: a
  host-side bound on the group's items) over one partial buffer.  The buffer is sized by a
  host-side bound on one group's valid entries in a chunk (`_entry_bound`: a row at position p
  has at most min(KS, p // bs + 1) valid slots) and allocated after the first chunk's work list
  is built (the sort's temporaries are freed by then).  Query chunks of C rows keep one group's
  partials plus the chunk's work list (48 B per (group, slot) entry) within CHUNK_BYTES, C
  balanced over the chunks by `chunk_rows_for`; the backward's chunks keep one group's dq
  partials within BWD_CHUNK_BYTES.

Backward (dq, dk, dv), over the same kind of items (longer: BWD_CONFIG.item_queries):
  a small kernel writes delta = rowsum(dO * O) - dlse and lse * log2(e) token-major [N, Hq];
  per item, K and V stay on chip and dK, dV accumulate in fp32 registers over all sub-tiles,
  then go to fp32 [N, G, D] buffers with one atomic add per element per item (the summation
  order, hence dK/dV's last bits, is not deterministic); dQ of each (query, head, slot) is
  written to a per-slot buffer (bf16 for bf16 inputs, fp32 otherwise) and a reduce kernel sums
  the valid slots.  Per sub-tile:
  S^T = K Q^T, P^T = exp2(S^T scale log2(e) - lse2), dV += P^T dO, dP^T = V dO^T,
  dS^T = P^T (dP^T - delta), dK += dS^T Q, dQ_slot = dS K (5 MMAs).

Inputs: fp16/bf16 on the GPU (fp32 too under the interpreter), block_size and head dim <= 128
(`kernel_supports`).  Kernel configurations: FWD_CONFIG / BWD_CONFIG; `tools/bench/
sparse_attention.py` times them and compiles them without a GPU.  docs/kernels.md gives the
design's cost and memory arithmetic and the measurements; benchmarks/NOTES.md ("Variants
removed") the variants these configurations were chosen over.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..dispatch import interpret_mode

__all__ = [
    "KernelConfig",
    "FWD_CONFIG",
    "BWD_CONFIG",
    "CHUNK_BYTES",
    "BWD_CHUNK_BYTES",
    "chunk_rows_for",
    "kernel_supports",
    "sparse_attention_fwd_triton",
    "sparse_attention_bwd_triton",
]

# Bytes one query chunk may take: ONE KV group's partials (the launchers run the groups one
# after another over one buffer) plus the chunk's work list, as `chunk_rows_for` counts them:
# the forward's o + lse partials (3.25 GiB) and the backward's dq partials (8 GiB; the backward
# also holds fp32 dK/dV accumulators, 8 B per key token and dim).  `chunk_rows=` of the
# launchers overrides them.
CHUNK_BYTES = 13 << 28
BWD_CHUNK_BYTES = 8 << 30
REDUCE_WARPS = 8  # forward slot merge / backward prologue: 64 rows x D per program
MAX_BLOCK = 128  # largest block_size and head dim the kernels take (K, V resident in shared memory)


@dataclass(frozen=True)
class KernelConfig:
    """rows: target rows of one MMA sub-tile (q_tile = rows // (Hq/G) queries, >= 1);
    item_queries: most entries (queries of one key) per program; num_warps, num_stages."""

    rows: int
    item_queries: int
    num_warps: int
    num_stages: int


# The GPU defaults.  Forward: 64-row sub-tiles (4 queries x 16 heads at M3's 16 heads per
# group), items of 128 queries, 4 warps.  Backward: 32-row sub-tiles, items of 512 queries,
# 8 warps.
FWD_CONFIG = KernelConfig(64, 128, 4, 1)
BWD_CONFIG = KernelConfig(32, 512, 8, 1)
# The backward's dq reduce (`_sa_dq_reduce_kernel`): one row x the heads of one group per
# program, the slot loop software-pipelined over 3 stages (cp.async of the next slots'
# partials into shared memory), 4 warps.
DQ_REDUCE_STAGES = 3
DQ_REDUCE_WARPS = 4
# Under the interpreter: the same kernels and code branches with small tiles and short items,
# so that tests exercise the sub-tile loop, several items per key and the atomics.
INTERPRET_FWD = KernelConfig(16, 16, 4, 1)
INTERPRET_BWD = KernelConfig(16, 32, 4, 1)


def _next_pow2(x: int) -> int:
    return 1 << (max(1, int(x)) - 1).bit_length()


def kernel_supports(dtype: torch.dtype, head_dim: int, block_size: int, device: torch.device | None = None) -> str | None:
    """None when the kernels take these arguments, else the reason they do not.

    16-bit inputs only on the GPU (fp32 CUDA tensors take the chunked PyTorch path: the kernels'
    tiles are sized for 16-bit tensor-core dots); under the interpreter fp32 runs too (the CPU
    tests).  K and V of a block stay in shared memory for a whole item, so block_size and the
    head dim are at most 128 (M3: 128 / 128).
    """
    ok = (torch.float16, torch.bfloat16) if (device is None or device.type == "cuda") else (torch.float16, torch.bfloat16, torch.float32)
    if dtype not in ok:
        return f"dtype {dtype} (the kernels take {', '.join(str(d) for d in ok)})"
    if head_dim > MAX_BLOCK:
        return f"head dim {head_dim} > {MAX_BLOCK}"
    if block_size > MAX_BLOCK:
        return f"block_size {block_size} > {MAX_BLOCK}"
    return None


# ------------------------------------------------------------------------------ work list
@dataclass
class _Items:
    ent_q: torch.Tensor  # int32 [M]: flat query token of each entry, sorted by key
    it_key: torch.Tensor  # int64 [max_items]: g * N + first token of the key's block
    it_start: torch.Tensor  # int64 [max_items]: first entry of the item
    it_count: torch.Tensor  # int32 [max_items]: entries in the item (0 = padding)
    nvalid: torch.Tensor  # int32 [G, C]: valid slots of each (group, row)
    inv: torch.Tensor  # int32 [G * C * K]: entry index of (group, row, slot) (valid slots only)
    grp_ent: torch.Tensor  # int32 [G + 1]: group g's entries are grp_ent[g] .. grp_ent[g+1]-1
    grp_item: torch.Tensor  # int32 [G + 1]: group g's items are grp_item[g] .. grp_item[g+1]-1
    max_items: int


def _row_docs(n0: int, C: int, T: int, cu_seqlens: torch.Tensor | None, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(doc_start, position in document) of flat rows n0 .. n0+C-1, int64."""
    n = torch.arange(n0, n0 + C, device=device, dtype=torch.int64)
    if cu_seqlens is None:
        start = n - n % T
    else:
        cu = cu_seqlens.to(device=device, dtype=torch.int64)
        d = torch.searchsorted(cu, n, right=True) - 1
        start = cu[d]
    return start, n - start


# The work list: three Triton kernels around torch's one global sort (~10 launches per chunk).
@triton.jit
def _wl_canon_kernel(
    SEL, s_g, s_t, s_k, DOC, KEY, NV,
    n0, C, N, T, kspace,
    K: tl.constexpr, BS: tl.constexpr, HAS_DOC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Canonical selection of rows n0 + t (t < C) of group program_id(1): the valid distinct
    blocks (id >= 0 with a token <= the row's position) in ascending order at slots
    0 .. nv-1 (slot = the block's rank among them: no sort), the sentinel key after them.
    KEY [G, C, K] = g * N + doc_start + block * BS (kspace for empty slots), NV [G, C] = nv."""
    t = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    g = tl.program_id(1).to(tl.int64)
    okr = t < C
    kk = tl.arange(0, BLOCK_K)
    m2 = okr[:, None] & (kk < K)[None, :]
    x = tl.load(SEL + g * s_g + t[:, None].to(tl.int64) * s_t + kk[None, :] * s_k, mask=m2, other=-1).to(tl.int64)
    n = n0 + t.to(tl.int64)
    if HAS_DOC:
        start = tl.load(DOC + t, mask=okr, other=0)
    else:
        start = n - n % T
    pos = n - start
    v0 = m2 & (x >= 0) & (x * BS <= pos[:, None])
    xs = tl.where(v0, x, -1).to(tl.int32)  # valid ids are < 2^31 (<= pos / BS)
    xi = xs[:, :, None]
    xj = xs[:, None, :]
    # a valid id equal to a valid id at a lower position is a duplicate (xj valid => xi valid)
    dup = tl.max(((xi == xj) & v0[:, None, :] & (kk[None, None, :] < kk[None, :, None])).to(tl.int32), axis=2) > 0
    u = v0 & (dup == 0)
    rank = tl.sum(((xj < xi) & u[:, None, :]).to(tl.int32), axis=2)
    nv = tl.sum(u.to(tl.int32), axis=1)
    row = (g * C + t) * K
    key = g * N + start[:, None] + x * BS
    tl.store(KEY + row[:, None] + rank, key.to(KEY.dtype.element_ty), mask=u)
    sent = tl.full([BLOCK_R, BLOCK_K], kspace, tl.int64).to(KEY.dtype.element_ty)
    tl.store(KEY + row[:, None] + kk[None, :], sent, mask=m2 & (kk[None, :] >= nv[:, None]))
    tl.store(NV + g * C + t, nv, mask=okr)


@triton.jit
def _wl_entry_kernel(SKEY, ORDER, ENT_Q, INV, FIRST, M, n0, C, kspace, item_q, NSTEPS, K: tl.constexpr, BLOCK: tl.constexpr):
    """Per entry e of the key-sorted list: its query (ENT_Q), INV[ORDER[e]] = e, and FIRST[e] =
    whether an item starts at e (a valid key and e - (first entry of its key) a multiple of
    item_q; that first entry by binary search in SKEY[0 : e])."""
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = e < M
    kv = tl.load(SKEY + e, mask=ok, other=kspace)
    o = tl.load(ORDER + e, mask=ok, other=0)
    tl.store(ENT_Q + e, (n0 + (o // K) % C).to(tl.int32), mask=ok)
    tl.store(INV + o, e, mask=ok)
    lo = tl.zeros([BLOCK], tl.int32)
    hi = e
    for _ in range(NSTEPS):
        act = ok & (lo < hi)
        mid = (lo + hi) // 2
        v = tl.load(SKEY + mid, mask=act, other=kspace)
        go = v < kv
        lo = tl.where(act & go, mid + 1, lo)
        hi = tl.where(act & (go == 0), mid, hi)
    first = ok & (kv < kspace) & ((e - lo) % item_q == 0)
    tl.store(FIRST + e, first.to(tl.int32), mask=ok)


@triton.jit
def _wl_item_kernel(SKEY, FIRST, CSUM, IT_KEY, IT_START, IT_COUNT, M, item_q, NSTEPS, BLOCK: tl.constexpr):
    """Item CSUM[e] - 1 starts at each FIRST entry e: its key, start, and count = entries of
    the key from e on, at most item_q (binary search in SKEY[e + 1 : e + item_q])."""
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = e < M
    f = tl.load(FIRST + e, mask=ok, other=0) != 0
    it = tl.load(CSUM + e, mask=f, other=1) - 1
    kv = tl.load(SKEY + e, mask=f, other=0)
    lo = e + 1
    hi = tl.minimum(e + item_q, M)
    for _ in range(NSTEPS):
        act = f & (lo < hi)
        mid = (lo + hi) // 2
        v = tl.load(SKEY + mid, mask=act, other=0)
        go = v <= kv
        lo = tl.where(act & go, mid + 1, lo)
        hi = tl.where(act & (go == 0), mid, hi)
    tl.store(IT_KEY + it, kv.to(tl.int64), mask=f)
    tl.store(IT_START + it, e.to(tl.int64), mask=f)
    tl.store(IT_COUNT + it, lo - e, mask=f)


def _build_items(
    sel: torch.Tensor,
    doc_start: torch.Tensor | None,
    pos: torch.Tensor | None,
    n0: int,
    N: int,
    block_size: int,
    item_queries: int,
    nkeys_bound: int,
    T: int = 0,
) -> _Items:
    """Block->query work list of rows n0 .. n0+C-1 (sel = their selections, int [G, C, K]; see
    `_wl_canon_kernel`).  doc_start = None: documents are the B rows of length T (no cu_seqlens;
    `pos` is then unused, computed in the kernel)."""
    G, C, K = sel.shape
    dev = sel.device
    M = G * C * K
    if M >= 2**30:
        raise ValueError(f"work list of {M} entries: use smaller query chunks")
    kspace = G * N
    kdt = torch.int32 if kspace < 2**31 - 1 else torch.int64
    key = torch.empty(M, dtype=kdt, device=dev)
    nvalid = torch.empty((G, C), dtype=torch.int32, device=dev)
    bk = _next_pow2(K)
    br = max(1, min(64 if interpret_mode() else 32, 4096 // (bk * bk)))
    has_doc = doc_start is not None
    _wl_canon_kernel[(triton.cdiv(C, br), G)](
        sel, sel.stride(0), sel.stride(1), sel.stride(2), doc_start if has_doc else nvalid, key, nvalid,
        n0, C, N, max(1, T), kspace,
        K=K, BS=block_size, HAS_DOC=has_doc, BLOCK_R=br, BLOCK_K=bk, num_warps=4,
    )
    skey, order = torch.sort(key, stable=True)
    ent_q = torch.empty(M, dtype=torch.int32, device=dev)
    inv = torch.empty(M, dtype=torch.int32, device=dev)
    first = torch.empty(M, dtype=torch.int32, device=dev)
    be = 1024
    grid = (triton.cdiv(M, be),)
    _wl_entry_kernel[grid](skey, order, ent_q, inv, first, M, n0, C, kspace, item_queries, int(M).bit_length(), K=K, BLOCK=be, num_warps=4)
    csum = torch.cumsum(first, 0, dtype=torch.int32)
    max_items = (M + item_queries - 1) // item_queries + min(M, nkeys_bound)
    ks = torch.zeros((2, max_items), dtype=torch.int64, device=dev)
    it_count = torch.zeros(max_items, dtype=torch.int32, device=dev)
    _wl_item_kernel[grid](skey, first, csum, ks[0], ks[1], it_count, M, item_queries, int(item_queries).bit_length(), BLOCK=be, num_warps=4)
    # keys g * N + start sort group by group (the sentinel kspace after all), so group g's valid
    # entries are E_g .. E_{g+1}-1 with E = the exclusive cumsum of its valid slots, and its
    # items are those starting at entries E_g .. E_{g+1}-1: the items before E_g = csum[E_g - 1]
    grp_ent = torch.zeros(G + 1, dtype=torch.int32, device=dev)
    grp_ent[1:] = torch.cumsum(nvalid.sum(1), 0)
    before = (grp_ent.long() - 1).clamp(min=0)
    grp_item = torch.where(grp_ent > 0, csum[before], torch.zeros_like(grp_ent))
    return _Items(ent_q, ks[0], ks[1], it_count, nvalid, inv, grp_ent, grp_item, max_items)


# ------------------------------------------------------------------------------ kernels
@triton.jit
def _mm(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    # UPCAST: the interpreter's 16-bit dot is unreliable, so it multiplies in fp32 there
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _item_kv(K, V, IT_KEY, IT_START, pid, count, N, G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Item pid's first entry, group, key-block start token, and the block's K and V
    [BLOCK_N, BLOCK_D] (zeros past the block, the batch or for a padding item), with their
    flat row offsets and mask (for the backward's dK / dV flush), the column offsets
    offs_n [BLOCK_N] and offs_d [BLOCK_D] and the head-dim mask d_ok."""
    key = tl.load(IT_KEY + pid).to(tl.int64)
    start = tl.load(IT_START + pid).to(tl.int64)
    g = key // N
    tok0 = key - g * N
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    kv_tok = tok0 + offs_n
    kv_ok = (offs_n < BS) & (kv_tok < N) & (count > 0)
    kv_row = (kv_tok * G + g) * D
    kv_mask = kv_ok[:, None] & (offs_d < D)[None, :]
    kb = tl.load(K + kv_row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    vb = tl.load(V + kv_row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    return start, g, tok0, kb, vb, kv_row, kv_mask, offs_n, offs_d, offs_d < D


@triton.jit
def _group_item(IT_COUNT, GRP_ENT, GRP_ITEM, grp, max_items):
    """(item, entries, first entry of the group) of program program_id(0) of group grp's launch.
    The grid is a host-known bound on the group's items: programs past them are padding (count
    0; the item index is clamped so that nothing is read past the work list's arrays)."""
    pid0 = tl.program_id(0)
    ib = tl.load(GRP_ITEM + grp)
    ie = tl.load(GRP_ITEM + grp + 1)
    e0 = tl.load(GRP_ENT + grp).to(tl.int64)
    pid = tl.minimum(ib + pid0, max_items - 1)
    count = tl.load(IT_COUNT + pid)
    count = tl.where(pid0 < ie - ib, count, 0)
    return pid, count, e0


@triton.jit
def _subtile_rows(ENT_Q, start, count, g, HPG: tl.constexpr, Q_TILE: tl.constexpr, BLOCK_M: tl.constexpr):
    """The rows of a sub-tile (row m: entry m // HPG of the sub-tile, head g * HPG + m % HPG; rows
    past Q_TILE * HPG unused) and the flat query tokens of the item's first two sub-tiles (the
    kernels' loops keep the next sub-tile's rows in flight).  Returns (offs_m, r_q, head, m_ok,
    ok0 (rows of sub-tile 0 holding an entry), n_cur, n_nxt)."""
    offs_m = tl.arange(0, BLOCK_M)
    r_q = offs_m // HPG
    head = g * HPG + offs_m % HPG
    m_ok = offs_m < Q_TILE * HPG
    ok0 = m_ok & (r_q < count)
    n_cur = tl.load(ENT_Q + start + r_q, mask=ok0, other=0).to(tl.int64)
    n_nxt = tl.load(ENT_Q + start + Q_TILE + r_q, mask=m_ok & (Q_TILE + r_q < count), other=0).to(tl.int64)
    return offs_m, r_q, head, m_ok, ok0, n_cur, n_nxt


@triton.jit
def _visible_keys(row_ok, n, tok0, BS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Per row, the last visible column of the key block starting at token tok0: key token
    tok0 + c is visible to the row's query n iff c <= n - tok0 (causal; this also keeps the key
    inside n's document and below N) and c < BS; rows that are not valid see nothing (-1).
    int32."""
    rel = tl.where(row_ok, (n - tok0).to(tl.int32), -1)
    if BS < BLOCK_N:
        rel = tl.minimum(rel, BS - 1)
    return rel


@triton.jit
def _needs_causal_mask(row_ok, rel, BLOCK_N: tl.constexpr):
    """Whether a valid row sits inside the key's block (its own, diagonal block) or the block
    is partial: elsewhere every key of the block is visible and the mask can be skipped (~130
    instructions per thread; rows that are not valid compute on zero Q rows, never stored)."""
    return tl.min(tl.where(row_ok, rel, BLOCK_N)) < BLOCK_N - 1


@triton.jit(do_not_specialize=["grp", "max_items"])
def _sa_fwd_kernel(
    Q, K, V, OP, LP,
    ENT_Q, IT_KEY, IT_START, IT_COUNT, GRP_ENT, GRP_ITEM,
    N, n0, qk_scale, grp, max_items,
    HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, KS: tl.constexpr, BS: tl.constexpr,
    HPG: tl.constexpr, Q_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, SKIP_EMPTY: tl.constexpr,
):
    """Program i takes item i of group grp (`_group_item`); its partials go to OP / LP, the
    buffers of that one group (row (entry - first entry of the group) * HPG + head in group)."""
    pid, count, e0 = _group_item(IT_COUNT, GRP_ENT, GRP_ITEM, grp, max_items)
    if SKIP_EMPTY:  # interpreter only: on the GPU the masks below make padding items free
        if count == 0:
            return
    start, g, tok0, kb, vb, kv_row, kv_mask, offs_n, offs_d, d_ok = _item_kv(K, V, IT_KEY, IT_START, pid, count, N, G,
                                                                            D, BS, BLOCK_N, BLOCK_D)

    # software pipeline by hand: the Q rows of sub-tile i+1 and the entries of sub-tile i+2
    # are in flight while sub-tile i computes (an indirect load defeats Triton's pipeliner)
    offs_m, r_q, head, m_ok, ok0, n_cur, n_nxt = _subtile_rows(ENT_Q, start, count, g, HPG, Q_TILE, BLOCK_M)
    q_cur = tl.load(Q + ((n_cur * HQ + head) * D)[:, None] + offs_d[None, :], mask=ok0[:, None] & d_ok[None, :], other=0.0)
    for sub in range(0, count, Q_TILE):
        qi = sub + r_q
        row_ok = m_ok & (qi < count)
        e = start + qi
        n = n_cur
        qb = q_cur
        ok1 = m_ok & (qi + Q_TILE < count)
        q_cur = tl.load(Q + ((n_nxt * HQ + head) * D)[:, None] + offs_d[None, :], mask=ok1[:, None] & d_ok[None, :], other=0.0)
        n_cur = n_nxt
        n_nxt = tl.load(ENT_Q + e + 2 * Q_TILE, mask=m_ok & (qi + 2 * Q_TILE < count), other=0).to(tl.int64)
        s = _mm(qb, tl.trans(kb), PREC, UPCAST) * qk_scale
        rel = _visible_keys(row_ok, n, tok0, BS, BLOCK_N)
        if _needs_causal_mask(row_ok, rel, BLOCK_N):
            s = tl.where(offs_n[None, :] <= rel[:, None], s, float("-inf"))
        m = tl.max(s, axis=1)
        m = tl.where(m == float("-inf"), 0.0, m)
        p = tl.exp2(s - m[:, None])
        l = tl.sum(p, axis=1)
        acc = _mm(p.to(vb.dtype), vb, PREC, UPCAST)
        l_safe = tl.where(l > 0.0, l, 1.0)
        ob = acc * (1.0 / l_safe)[:, None]
        lse = (m + tl.log2(l_safe)) * 0.6931471805599453
        # partials are entry-major (row e * HPG + head in group): a sub-tile's rows are contiguous
        prow = (start - e0 + sub) * HPG + offs_m
        tl.store(OP + prow[:, None] * D + offs_d[None, :], ob.to(OP.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        tl.store(LP + prow, lse, mask=row_ok)


@triton.jit
def _slot_rows(NV, GRP_ENT, t, hh, C, grp, HPG: tl.constexpr, KS: tl.constexpr, D: tl.constexpr,
               BLOCK_D: tl.constexpr):
    """For rows t of a chunk of C rows and heads hh of group grp (a merge or reduce program's
    (row, head) pairs): (ok, head h, valid slots nv, t int64, the (grp, t, slot 0) offset in
    INV [G, C, KS], the group's first entry, offs_d [BLOCK_D], its mask d_ok)."""
    ok = (t < C) & (hh < HPG)
    nv = tl.load(NV + grp * C + t, mask=ok, other=0)
    t64 = t.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    return ok, grp * HPG + hh, nv, t64, (grp * C + t64) * KS, tl.load(GRP_ENT + grp).to(tl.int64), offs_d, offs_d < D


@triton.jit(do_not_specialize=["grp"])
def _sa_fwd_merge_kernel(
    P, LP, NV, INV, GRP_ENT, OUT, LSE,
    n0, C, T, grp,
    HQ: tl.constexpr, D: tl.constexpr, KS: tl.constexpr, HPG: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """The forward's slot merge for the heads h = grp * HPG + hh of group grp: OUT[n0 + t, h] =
    sum over the valid slots s < NV[grp, t] of exp(LP[r] - lse) P[r] with r = (INV[grp, t, s] -
    GRP_ENT[grp]) * HPG + hh (P, LP: that group's partials, entry-major), and lse =
    logsumexp_s LP[r] into LSE [B, HQ, T].  One program: BLOCK_T rows x BLOCK_H heads of the
    group; the max pass walks the slots (INV, then LP), the sum takes two slots per step."""
    offs_r = tl.arange(0, BLOCK_T * BLOCK_H)
    t = tl.program_id(0) * BLOCK_T + offs_r // BLOCK_H
    hh = tl.program_id(1) * BLOCK_H + offs_r % BLOCK_H
    ok, h, nv, t64, ibase, e0, offs_d, d_ok = _slot_rows(NV, GRP_ENT, t, hh, C, grp, HPG, KS, D, BLOCK_D)
    sw = tl.zeros([BLOCK_T * BLOCK_H], tl.float32)
    mx = tl.full([BLOCK_T * BLOCK_H], float("-inf"), tl.float32)
    for s in range(0, KS):
        e = tl.load(INV + ibase + s, mask=ok & (s < nv), other=0).to(tl.int64) - e0
        ls = tl.load(LP + e * HPG + hh, mask=ok & (s < nv), other=float("-inf"))
        mx = tl.maximum(mx, ls)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    acc = tl.zeros([BLOCK_T * BLOCK_H, BLOCK_D], tl.float32)
    for s in range(0, KS, 2):  # two slots per step: both loads in flight together
        ok0 = ok & (s < nv)
        ok1 = ok & (s + 1 < nv)  # nv <= KS, so an odd KS never reads slot KS
        r0 = (tl.load(INV + ibase + s, mask=ok0, other=0).to(tl.int64) - e0) * HPG + hh
        r1 = (tl.load(INV + ibase + s + 1, mask=ok1, other=0).to(tl.int64) - e0) * HPG + hh
        x0 = tl.load(P + r0[:, None] * D + offs_d[None, :], mask=ok0[:, None] & d_ok[None, :], other=0.0)
        x1 = tl.load(P + r1[:, None] * D + offs_d[None, :], mask=ok1[:, None] & d_ok[None, :], other=0.0)
        w0 = tl.exp(tl.load(LP + r0, mask=ok0, other=float("-inf")) - mx)
        w1 = tl.exp(tl.load(LP + r1, mask=ok1, other=float("-inf")) - mx)
        sw += w0 + w1
        acc += x0.to(tl.float32) * w0[:, None] + x1.to(tl.float32) * w1[:, None]
    n = n0 + t64
    acc = acc * (1.0 / tl.where(sw > 0.0, sw, 1.0))[:, None]
    tl.store(OUT + ((n * HQ + h) * D)[:, None] + offs_d[None, :], acc.to(OUT.dtype.element_ty), mask=ok[:, None] & d_ok[None, :])
    lse = tl.where(sw > 0.0, mx + tl.log(tl.where(sw > 0.0, sw, 1.0)), float("-inf"))
    b = n // T
    tl.store(LSE + (b * HQ + h) * T + (n - b * T), lse, mask=ok)


@triton.jit(do_not_specialize=["grp"])
def _sa_dq_reduce_kernel(
    P, NV, INV, GRP_ENT, OUT,
    n0, C, grp,
    HQ: tl.constexpr, D: tl.constexpr, KS: tl.constexpr, HPG: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_HP: tl.constexpr, BLOCK_D: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """The backward's dq reduce for group grp: OUT[n0 + t, grp * HPG + hh] = sum over the valid
    slots s < NV[grp, t] of P[(INV[grp, t, s] - GRP_ENT[grp]) * HPG + hh] (P: that group's
    partials).  One program = BLOCK_T rows of the chunk x the HPG heads of the group, so each
    (row, slot)'s partial is one contiguous run of HPG * D elements (4 KB at M3's shape).  The slot loop is software-pipelined by Triton over
    NUM_STAGES (cp.async of the next steps' partials into shared memory: bytes in flight cost
    no registers); each partial is read exactly once (evict_first)."""
    offs_r = tl.arange(0, BLOCK_T * BLOCK_HP)
    t = tl.program_id(0) * BLOCK_T + offs_r // BLOCK_HP
    hh = offs_r % BLOCK_HP
    ok, h, nv, t64, ibase, e0, offs_d, d_ok = _slot_rows(NV, GRP_ENT, t, hh, C, grp, HPG, KS, D, BLOCK_D)
    acc = tl.zeros([BLOCK_T * BLOCK_HP, BLOCK_D], tl.float32)
    for s in tl.range(0, KS, 2, num_stages=NUM_STAGES):
        ok0 = ok & (s < nv)
        ok1 = ok & (s + 1 < nv)  # nv <= KS, so an odd KS never reads slot KS
        r0 = (tl.load(INV + ibase + s, mask=ok0, other=0).to(tl.int64) - e0) * HPG + hh
        r1 = (tl.load(INV + ibase + s + 1, mask=ok1, other=0).to(tl.int64) - e0) * HPG + hh
        x0 = tl.load(P + r0[:, None] * D + offs_d[None, :], mask=ok0[:, None] & d_ok[None, :], other=0.0, eviction_policy="evict_first")
        x1 = tl.load(P + r1[:, None] * D + offs_d[None, :], mask=ok1[:, None] & d_ok[None, :], other=0.0, eviction_policy="evict_first")
        acc += x0.to(tl.float32) + x1.to(tl.float32)
    n = n0 + t64
    tl.store(OUT + ((n * HQ + h) * D)[:, None] + offs_d[None, :], acc.to(OUT.dtype.element_ty), mask=ok[:, None] & d_ok[None, :])


@triton.jit
def _sa_bwd_pre_kernel(
    O, DO, LSE, DLSE, LSE2, DELTA,
    N, T,
    HQ: tl.constexpr, D: tl.constexpr, HAS_DLSE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Token-major [N, HQ] fp32: DELTA = rowsum(dO * O) - dlse and LSE2 = lse * log2(e)."""
    offs_r = tl.arange(0, BLOCK_T * BLOCK_H)
    t = tl.program_id(0) * BLOCK_T + offs_r // BLOCK_H
    h = tl.program_id(1) * BLOCK_H + offs_r % BLOCK_H
    ok = (t < N) & (h < HQ)
    n = t.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    msk = ok[:, None] & (offs_d < D)[None, :]
    row = ((n * HQ + h) * D)[:, None] + offs_d[None, :]
    o = tl.load(O + row, mask=msk, other=0.0).to(tl.float32)
    do = tl.load(DO + row, mask=msk, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, axis=1)
    b = n // T
    li = (b * HQ + h) * T + (n - b * T)
    lse = tl.load(LSE + li, mask=ok, other=0.0)
    if HAS_DLSE:
        delta -= tl.load(DLSE + li, mask=ok, other=0.0)
    tl.store(LSE2 + n * HQ + h, lse * 1.4426950408889634, mask=ok)
    tl.store(DELTA + n * HQ + h, delta, mask=ok)


@triton.jit(do_not_specialize=["grp", "max_items"])
def _sa_bwd_kernel(
    Q, K, V, DO, LSE2, DELTA, DQP, DKA, DVA,
    ENT_Q, IT_KEY, IT_START, IT_COUNT, GRP_ENT, GRP_ITEM,
    N, n0, qk_scale, sm_scale, grp, max_items,
    HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, KS: tl.constexpr, BS: tl.constexpr,
    HPG: tl.constexpr, Q_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PREC: tl.constexpr, UPCAST: tl.constexpr, SKIP_EMPTY: tl.constexpr,
):
    # (Deferring each dQ store by one sub-tile does not take it past a proxy fence: this loop
    # has four, one per MMA with an operand written to shared memory in the loop.)  Items and
    # dq partials of group grp only, as in the forward.
    pid, count, e0 = _group_item(IT_COUNT, GRP_ENT, GRP_ITEM, grp, max_items)
    if SKIP_EMPTY:  # interpreter only: on the GPU the masks below make padding items free
        if count == 0:
            return
    start, g, tok0, kb, vb, kv_row, kv_mask, offs_n, offs_d, d_ok = _item_kv(K, V, IT_KEY, IT_START, pid, count, N, G,
                                                                            D, BS, BLOCK_N, BLOCK_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)

    # the next sub-tile's Q, dO, lse and delta rows are prefetched by hand, as in the forward
    offs_m, r_q, head, m_ok, ok0, n_cur, n_nxt = _subtile_rows(ENT_Q, start, count, g, HPG, Q_TILE, BLOCK_M)
    r0 = ((n_cur * HQ + head) * D)[:, None] + offs_d[None, :]
    q_cur = tl.load(Q + r0, mask=ok0[:, None] & d_ok[None, :], other=0.0)
    do_cur = tl.load(DO + r0, mask=ok0[:, None] & d_ok[None, :], other=0.0)
    lse2_cur = tl.load(LSE2 + n_cur * HQ + head, mask=ok0, other=0.0)
    dl_cur = tl.load(DELTA + n_cur * HQ + head, mask=ok0, other=0.0)
    for sub in range(0, count, Q_TILE):
        qi = sub + r_q
        row_ok = m_ok & (qi < count)
        e = start + qi
        n = n_cur
        qb = q_cur
        dob = do_cur
        lse2 = lse2_cur
        dl = dl_cur
        ok1 = m_ok & (qi + Q_TILE < count)
        r1 = ((n_nxt * HQ + head) * D)[:, None] + offs_d[None, :]
        q_cur = tl.load(Q + r1, mask=ok1[:, None] & d_ok[None, :], other=0.0)
        do_cur = tl.load(DO + r1, mask=ok1[:, None] & d_ok[None, :], other=0.0)
        lse2_cur = tl.load(LSE2 + n_nxt * HQ + head, mask=ok1, other=0.0)
        dl_cur = tl.load(DELTA + n_nxt * HQ + head, mask=ok1, other=0.0)
        n_cur = n_nxt
        n_nxt = tl.load(ENT_Q + e + 2 * Q_TILE, mask=m_ok & (qi + 2 * Q_TILE < count), other=0).to(tl.int64)
        sT = _mm(kb, tl.trans(qb), PREC, UPCAST) * qk_scale  # [BLOCK_N, BLOCK_M]
        rel = _visible_keys(row_ok, n, tok0, BS, BLOCK_N)
        pT = tl.exp2(sT - lse2[None, :])
        if _needs_causal_mask(row_ok, rel, BLOCK_N):
            pT = tl.where(offs_n[:, None] <= rel[None, :], pT, 0.0)
        dv += _mm(pT.to(dob.dtype), dob, PREC, UPCAST)
        dpT = _mm(vb, tl.trans(dob), PREC, UPCAST)
        dsT = (pT * (dpT - dl[None, :])).to(qb.dtype)
        dk += _mm(dsT, qb, PREC, UPCAST)
        dqb = _mm(tl.trans(dsT), kb, PREC, UPCAST) * sm_scale  # [BLOCK_M, BLOCK_D]
        prow = (start - e0 + sub) * HPG + offs_m  # entry-major within the group, as in the forward
        tl.store(DQP + prow[:, None] * D + offs_d[None, :], dqb.to(DQP.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    dst = kv_row[:, None] + offs_d[None, :]
    tl.atomic_add(DKA + dst, dk * sm_scale, mask=kv_mask, sem="relaxed")
    tl.atomic_add(DVA + dst, dv, mask=kv_mask, sem="relaxed")


# ------------------------------------------------------------------------------ launchers
@dataclass
class _Geom:
    B: int
    T: int
    N: int
    Hq: int
    G: int
    D: int
    KS: int
    hpg: int
    bs: int
    nkeys_bound: int


def _geom(q, k, block_idx, block_size, cu_seqlens) -> _Geom:
    B, T, Hq, D = q.shape
    G = k.shape[2]
    KS = block_idx.shape[-1]
    N = B * T
    if N >= 2**31 - 1:
        raise ValueError(f"sparse_attention kernels take fewer than 2^31 tokens in a batch, got {N}")
    ndocs = B if cu_seqlens is None else cu_seqlens.numel() - 1
    nkeys_bound = G * (N // block_size + ndocs + 1)
    return _Geom(B, T, N, Hq, G, D, KS, Hq // G, block_size, nkeys_bound)


def _tile(cfg: KernelConfig, geo: _Geom) -> tuple[int, int, int, int, int]:
    """(q_tile, BLOCK_M, BLOCK_N, BLOCK_D, item_queries) for a config and a shape."""
    bn, bd = max(16, _next_pow2(geo.bs)), max(16, _next_pow2(geo.D))
    rows = max(16, cfg.rows * 128 // max(128, bn, bd))  # keep the register tiles ~128x128
    q_tile = max(1, rows // geo.hpg)
    bm = max(16, _next_pow2(q_tile * geo.hpg))
    item_q = max(q_tile, (cfg.item_queries + q_tile - 1) // q_tile * q_tile)
    return q_tile, bm, bn, bd, item_q


def chunk_rows_for(budget: int, *, tokens: int, heads: int, groups: int, head_dim: int, topk: int,
                   elt_bytes: int, lse_bytes: int = 0) -> int:
    """Query rows per chunk that the launchers take for a budget of `budget` bytes (CHUNK_BYTES
    for the forward: elt_bytes = q's element size, lse_bytes = 4; BWD_CHUNK_BYTES for the
    backward: elt_bytes = the dq partials' element size, lse_bytes = 0).

    A row costs the partials of ONE KV group (the launchers run the groups one after another
    over one buffer): topk slots x heads/groups heads x (head_dim * elt_bytes + lse_bytes),
    plus its share of the chunk's work list, 48 B per (group, slot) entry.  Below `tokens`, the
    rows are a multiple of 256, balanced over the chunks they give (no short last chunk).
    """
    for name, x in (("tokens", tokens), ("heads", heads), ("groups", groups), ("head_dim", head_dim), ("topk", topk),
                    ("elt_bytes", elt_bytes)):
        if not isinstance(x, int) or x < 1:
            raise ValueError(f"{name} must be a positive int, got {x!r}")
    if heads % groups:
        raise ValueError(f"heads ({heads}) must be a multiple of groups ({groups})")
    if not isinstance(lse_bytes, int) or lse_bytes < 0:
        raise ValueError(f"lse_bytes must be an int >= 0, got {lse_bytes!r}")
    per_row = topk * (heads // groups) * (head_dim * elt_bytes + lse_bytes) + groups * topk * 48
    rows = max(1, int(budget) // per_row)
    if rows >= tokens:
        return tokens
    if rows > 256:
        rows = rows // 256 * 256
    per = -(-tokens // -(-tokens // rows))  # the same number of chunks, balanced
    if rows >= 256:
        per = -(-per // 256) * 256  # <= rows: rows is a multiple of 256
    return per


def _chunk_rows(geo: _Geom, elt_bytes: int, lse_bytes: int, chunk_rows: int | None, budget: int) -> int:
    if chunk_rows is None:
        chunk_rows = chunk_rows_for(budget, tokens=geo.N, heads=geo.Hq, groups=geo.G, head_dim=geo.D, topk=geo.KS,
                                    elt_bytes=elt_bytes, lse_bytes=lse_bytes)
    return max(1, min(geo.N, int(chunk_rows)))


def _entries_before(n: int, T: int, KS: int, bs: int) -> int:
    """sum over flat rows m < n of min(KS, (m % T) // bs + 1): the most valid slots of one group
    in those rows (rows of B documents of length T; a row at position p selects at most the
    p // bs + 1 blocks up to its own)."""

    def doc(p: int) -> int:  # positions 0 .. p-1 of one document
        x = min(p, (KS - 1) * bs)  # below x a row has < KS blocks: pos // bs + 1 of them
        qb, r = divmod(x, bs)
        return bs * qb * (qb + 1) // 2 + r * (qb + 1) + KS * (p - x)

    if KS < 1 or n <= 0:
        return 0
    return (n // T) * doc(T) + doc(n % T)


def _entry_bound(n0: int, c: int, geo: _Geom, cu_seqlens: torch.Tensor | None) -> int:
    """Host-side bound on one group's valid entries (valid (row, slot) pairs) in rows n0 ..
    n0+c-1: exact for a full selection without cu_seqlens, c * KS with them."""
    if cu_seqlens is not None:
        return c * geo.KS
    return _entries_before(n0 + c, geo.T, geo.KS, geo.bs) - _entries_before(n0, geo.T, geo.KS, geo.bs)


def _group_grid(entries: int, item_q: int, geo: _Geom) -> int:
    """Programs of one group's launch: a bound on its items given a bound on its entries (a key
    of e entries makes ceil(e / item_q) <= e / item_q + 1 items; a group has at most
    nkeys_bound / G keys, each with an entry)."""
    return max(1, triton.cdiv(entries, item_q) + min(entries, geo.nkeys_bound // geo.G))


def _partial_buffers(entries: int, geo: _Geom, dtype: torch.dtype, with_lse: bool, device, poison: bool) -> list[torch.Tensor]:
    """One group's partial buffers for `entries` entries, entry-major: [entries * HPG, D] of
    dtype, and with_lse: fp32 [entries * HPG]; NaN-filled when poison."""
    rows = max(1, entries) * geo.hpg
    shapes = [((rows, geo.D), dtype)] + ([((rows,), torch.float32)] if with_lse else [])
    if poison:
        return [torch.full(sh, float("nan"), dtype=dt, device=device) for sh, dt in shapes]
    return [torch.empty(sh, dtype=dt, device=device) for sh, dt in shapes]


def _reduce_tile(Hq: int, D: int) -> tuple[int, int, int]:
    """(rows, heads, dims) of a merge / prologue program over Hq heads."""
    bd = max(16, _next_pow2(D))
    bh = min(_next_pow2(Hq), 16)
    bt = max(1, (64 if not interpret_mode() else 256) // bh)  # the interpreter pays per op, not per element
    return bt, bh, bd


def _selection_rows(block_idx: torch.Tensor, geo: _Geom) -> torch.Tensor:
    """block_idx [B, G, T, K] -> [G, N, K] (a view for B == 1)."""
    if geo.B == 1:
        return block_idx[0]
    return block_idx.permute(1, 0, 2, 3).reshape(geo.G, geo.N, geo.KS)


def _prec(dtype: torch.dtype) -> tuple[str, bool]:
    return ("ieee" if dtype == torch.float32 else "tf32"), (interpret_mode() and dtype != torch.float32)


class _DeviceGuard:
    def __init__(self, t: torch.Tensor):
        self.ctx = torch.cuda.device(t.device) if t.is_cuda else None

    def __enter__(self):
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *a):
        if self.ctx is not None:
            self.ctx.__exit__(*a)


def _pick(cfg: KernelConfig | None, gpu_cfg: KernelConfig, interp_cfg: KernelConfig) -> KernelConfig:
    if cfg is None:
        return interp_cfg if interpret_mode() else gpu_cfg
    if not isinstance(cfg, KernelConfig):
        raise ValueError(f"config must be a KernelConfig or None, got {type(cfg).__name__}")
    return cfg


def _items(sel, n0: int, c: int, geo: _Geom, cu_seqlens, block_size: int, item_q: int, dev) -> _Items:
    """The work list of rows n0 .. n0+c-1."""
    rows = sel[:, n0 : n0 + c]
    if cu_seqlens is None:
        return _build_items(rows, None, None, n0, geo.N, block_size, item_q, geo.nkeys_bound, geo.T)
    doc_start, pos = _row_docs(n0, c, geo.T, cu_seqlens, dev)
    return _build_items(rows, doc_start, pos, n0, geo.N, block_size, item_q, geo.nkeys_bound)


def _fwd_merge(P, LP, it: _Items, OUT, LSE, n0: int, c: int, geo: _Geom, g: int) -> None:
    """OUT and LSE of rows n0 .. n0+c-1, heads of group g, from that group's partials
    (`_sa_fwd_merge_kernel`)."""
    rbt, rbh, rbd = _reduce_tile(geo.hpg, geo.D)
    _sa_fwd_merge_kernel[(triton.cdiv(c, rbt), triton.cdiv(geo.hpg, rbh))](
        P, LP, it.nvalid, it.inv, it.grp_ent, OUT, LSE,
        n0, c, geo.T, g,
        HQ=geo.Hq, D=geo.D, KS=geo.KS, HPG=geo.hpg,
        BLOCK_T=rbt, BLOCK_H=rbh, BLOCK_D=rbd, num_warps=REDUCE_WARPS, num_stages=1,
    )


def _dq_reduce(P, it: _Items, OUT, n0: int, c: int, geo: _Geom, g: int) -> None:
    """dq of rows n0 .. n0+c-1, heads of group g, from that group's per-slot partials
    (`_sa_dq_reduce_kernel`)."""
    bhp = _next_pow2(geo.hpg)
    bt = max(1, 16 // bhp)  # ~16 (row, head) pairs per program
    _sa_dq_reduce_kernel[(triton.cdiv(c, bt), 1)](
        P, it.nvalid, it.inv, it.grp_ent, OUT,
        n0, c, g,
        HQ=geo.Hq, D=geo.D, KS=geo.KS, HPG=geo.hpg,
        BLOCK_T=bt, BLOCK_HP=bhp, BLOCK_D=max(16, _next_pow2(geo.D)),
        NUM_STAGES=DQ_REDUCE_STAGES, num_warps=DQ_REDUCE_WARPS, num_stages=DQ_REDUCE_STAGES,
    )


def _chunks(geo: _Geom, C: int, cu_seqlens) -> list[tuple[int, int, int]]:
    """(first row, rows, bound on one group's valid entries) of each query chunk."""
    return [(n0, min(C, geo.N - n0), _entry_bound(n0, min(C, geo.N - n0), geo, cu_seqlens)) for n0 in range(0, geo.N, C)]


@dataclass
class _Launch:
    """What a forward or backward launcher derives from its inputs: the geometry, the kernel
    config and its tiles, the partials' dtype, the query chunks and the selection rows."""

    geo: _Geom
    cfg: KernelConfig
    q_tile: int
    bm: int
    bn: int
    bd: int
    item_q: int
    pdt: torch.dtype
    chunks: list[tuple[int, int, int]]
    sel: torch.Tensor
    prec: str
    upcast: bool


def _launch(q, k, block_idx, cu_seqlens, block_size: int, cfg: KernelConfig, pdt: torch.dtype, lse_bytes: int,
            chunk_rows: int | None, budget: int) -> _Launch:
    geo = _geom(q, k, block_idx, block_size, cu_seqlens)
    q_tile, bm, bn, bd, item_q = _tile(cfg, geo)
    C = _chunk_rows(geo, pdt.itemsize, lse_bytes, chunk_rows, budget)
    prec, upcast = _prec(q.dtype)
    return _Launch(geo, cfg, q_tile, bm, bn, bd, item_q, pdt, _chunks(geo, C, cu_seqlens),
                   _selection_rows(block_idx, geo), prec, upcast)


def _run_groups(lp: _Launch, cu_seqlens, with_lse: bool, device, poison: bool, launch_group) -> None:
    """For each query chunk: its work list (the previous chunk's is released first), then
    launch_group(items, partial buffers, grid, n0, rows, g) for each KV group g over one set of
    partial buffers, allocated after the first work list (its sort's temporaries are freed by
    then); poison: the buffers are NaN-filled before every group but the first (no slot of
    another group or chunk may be read)."""
    bufs = it = None
    for n0, c, ent in lp.chunks:
        it = None
        it = _items(lp.sel, n0, c, lp.geo, cu_seqlens, lp.geo.bs, lp.item_q, device)
        if bufs is None:
            bufs = _partial_buffers(max(e for _, _, e in lp.chunks), lp.geo, lp.pdt, with_lse, device, poison)
        grid = (_group_grid(ent, lp.item_q, lp.geo),)
        for g in range(lp.geo.G):
            if poison and (g or n0):
                for buf in bufs:
                    buf.fill_(float("nan"))
            launch_group(it, bufs, grid, n0, c, g)


def sparse_attention_fwd_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_idx: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    block_size: int,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    config: KernelConfig | None = None,
    chunk_rows: int | None = None,
    poison: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """o [B, T, Hq, D] (q.dtype), lse [B, Hq, T] fp32.  Inputs are assumed checked by the caller.

    out / lse_out: preallocated outputs (every element is written); config: a KernelConfig
    (default FWD_CONFIG, INTERPRET_FWD under the interpreter); chunk_rows: query rows per chunk
    (default: CHUNK_BYTES of partials); poison: fill the internal partial buffers with NaN
    (tests that unwritten slots are masked).
    """
    lp = _launch(q, k, block_idx, cu_seqlens, block_size, _pick(config, FWD_CONFIG, INTERPRET_FWD), q.dtype, 4,
                 chunk_rows, CHUNK_BYTES)
    geo, cfg = lp.geo, lp.cfg
    qf, kf, vf = q.contiguous(), k.contiguous(), v.contiguous()
    o = out if out is not None else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = lse_out if lse_out is not None else torch.empty((geo.B, geo.Hq, geo.T), dtype=torch.float32, device=q.device)
    assert o.is_contiguous() and lse.is_contiguous()
    qk_scale = float(scale) * 1.4426950408889634

    def launch_group(it: _Items, bufs, grid, n0: int, c: int, g: int) -> None:
        OP, LP = bufs
        _sa_fwd_kernel[grid](
            qf, kf, vf, OP, LP,
            it.ent_q, it.it_key, it.it_start, it.it_count, it.grp_ent, it.grp_item,
            geo.N, n0, qk_scale, g, it.max_items,
            HQ=geo.Hq, G=geo.G, D=geo.D, KS=geo.KS, BS=geo.bs, HPG=geo.hpg, Q_TILE=lp.q_tile,
            BLOCK_M=lp.bm, BLOCK_N=lp.bn, BLOCK_D=lp.bd, PREC=lp.prec, UPCAST=lp.upcast, SKIP_EMPTY=interpret_mode(),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        _fwd_merge(OP, LP, it, o, lse, n0, c, geo, g)

    with _DeviceGuard(q):
        _run_groups(lp, cu_seqlens, True, q.device, poison, launch_group)
    return o, lse


def sparse_attention_bwd_triton(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    block_idx: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    block_size: int,
    scale: float,
    *,
    dq_out: torch.Tensor | None = None,
    dk_out: torch.Tensor | None = None,
    dv_out: torch.Tensor | None = None,
    config: KernelConfig | None = None,
    chunk_rows: int | None = None,
    poison: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of `sparse_attention_fwd_triton`'s outputs given do (and dlse, or None).

    config: a KernelConfig (default BWD_CONFIG, INTERPRET_BWD under the interpreter);
    chunk_rows / poison: as in the forward (default chunk: BWD_CHUNK_BYTES of dq partials).
    """
    pdt = torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32
    lp = _launch(q, k, block_idx, cu_seqlens, block_size, _pick(config, BWD_CONFIG, INTERPRET_BWD), pdt, 0,
                 chunk_rows, BWD_CHUNK_BYTES)
    geo, cfg = lp.geo, lp.cfg
    dev = q.device
    qf, kf, vf = q.contiguous(), k.contiguous(), v.contiguous()
    of, dof = o.contiguous(), do.contiguous()
    lsef = lse.contiguous().float()
    dq = dq_out if dq_out is not None else torch.empty(q.shape, dtype=q.dtype, device=dev)
    assert dq.is_contiguous()
    lse2 = torch.empty((geo.N, geo.Hq), dtype=torch.float32, device=dev)
    delta = torch.empty((geo.N, geo.Hq), dtype=torch.float32, device=dev)
    dka = torch.zeros((geo.N, geo.G, geo.D), dtype=torch.float32, device=dev)
    dva = torch.zeros((geo.N, geo.G, geo.D), dtype=torch.float32, device=dev)
    rbt, rbh, rbd = _reduce_tile(geo.Hq, geo.D)
    dlse_f = dlse.contiguous().float() if dlse is not None else lse2  # dummy pointer when absent

    def launch_group(it: _Items, bufs, grid, n0: int, c: int, g: int) -> None:
        (DQP,) = bufs
        _sa_bwd_kernel[grid](
            qf, kf, vf, dof, lse2, delta, DQP, dka, dva,
            it.ent_q, it.it_key, it.it_start, it.it_count, it.grp_ent, it.grp_item,
            geo.N, n0, float(scale) * 1.4426950408889634, float(scale), g, it.max_items,
            HQ=geo.Hq, G=geo.G, D=geo.D, KS=geo.KS, BS=block_size, HPG=geo.hpg, Q_TILE=lp.q_tile,
            BLOCK_M=lp.bm, BLOCK_N=lp.bn, BLOCK_D=lp.bd, PREC=lp.prec, UPCAST=lp.upcast, SKIP_EMPTY=interpret_mode(),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        _dq_reduce(DQP, it, dq, n0, c, geo, g)

    with _DeviceGuard(q):
        _sa_bwd_pre_kernel[(triton.cdiv(geo.N, rbt), triton.cdiv(geo.Hq, rbh))](
            of, dof, lsef, dlse_f, lse2, delta,
            geo.N, geo.T,
            HQ=geo.Hq, D=geo.D, HAS_DLSE=dlse is not None,
            BLOCK_T=rbt, BLOCK_H=rbh, BLOCK_D=rbd, num_warps=4,
        )
        _run_groups(lp, cu_seqlens, False, dev, poison, launch_group)
    dk = dka.view(k.shape).to(k.dtype)
    dv = dva.view(v.shape).to(v.dtype)
    if dk_out is not None:
        dk_out.copy_(dk)
        dk = dk_out
    if dv_out is not None:
        dv_out.copy_(dv)
        dv = dv_out
    return dq, dk, dv
