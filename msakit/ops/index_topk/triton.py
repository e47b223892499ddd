"""Fused Triton `index_topk`: scoring, causal mask, per-block max and a running top-k in one pass.

The [B, G, T, T / block_size] block-score tensor is never written: every program keeps its
rows' top-k in registers while it streams over the key blocks.

Work decomposition
------------------
q_idx [B, T, G, Di] is read as a [T * G, Di] matrix per batch (row = token * G + group, which
is its memory order), so one tile of BLOCK_M rows holds BLOCK_M / G tokens with all their
groups, and every group shares the k_idx block the tile loads.  Row i of the tile scores key
block kb as

    M(row, kb) = max_{j in block kb, j <= token(row)} q_idx[token, group] . k_idx[j]

with one tl.dot [BLOCK_M, Di] x [Di, BLOCK_N] (bf16/fp16/fp8 operands, fp32 accumulation) per
sub-tile of BLOCK_N keys (block_size = NSUB * BLOCK_N, the last sub-tile column-masked when
block_size is not a multiple of BLOCK_N).  The key blocks run in three ascending loops: the
init blocks before the tile (forced for every row), the blocks before the tile that no row
forces (no mask, no forcing, no load predicates: almost all the work at long T), then the
last ones (local blocks and the diagonal) with the causal mask and the per-row forcing.
Key tiles come by per-thread cp.async (pipelined by Triton) or, with TMA, by tensor-map copies
of a [B * T, Di] descriptor (no per-thread address arithmetic; rows past the sequence are
masked by the causal mask, zeros past the tensor).

The grid is 1-D over (tile, batch), heaviest (last) tiles first so the long programs start
early and the short ones fill the tail.  Packed documents (cu_seqlens) use a device-built
table of (document, tile) pairs, sorted by the tile's work, in a single launch and no host
synchronisation.

Running top-k
-------------
Each row keeps `topk` slots (split over the 4 lanes of a quad, below: no layout conversion
and no cross-thread reduction beyond the quad's shuffles is involved) sorted ascending by
(score, -id): slot 0 is the entry to evict next.  Forced blocks (own block, the
local_blocks - 1 before it, the first init_blocks) score +inf, blocks past the row's own block
-inf.  Blocks arrive in ascending id order; block kb with score x enters a row through a
branch-free shift network (c_s = slot_s < x, true on a prefix of the slots):

    slot_s <- slot_{s+1}  if c_{s+1};   x  if c_s and not c_{s+1};   slot_s  otherwise

so x replaces the minimum only when x > minimum strictly: an equal score never displaces an
earlier (lower) id, and among equal scores the newest (highest id) sits lowest, i.e. is
evicted first.  The kept set is exactly the topk largest (score, -id) keys, the reference's
ranking.  Empty slots hold (-inf, -1), so the row written out as slots topk-1 .. 0 is the
reference's order: forced ids ascending, then by score (ties to the lower id), then -1.

Where the state lives.  In the wgmma accumulator the 4 lanes of a quad hold the same rows
(lane t: the columns c with (c // 2) % 4 == t).  The kernel keeps the per-lane partial maxima
[BLOCK_M, 4] (a reshape of the score tile, reduced inside each thread), takes the row max with 2
quad shuffles, and splits the KP = 4 * ceil(topk / 4) slots over the quad: lane t holds slots
KL*t .. KL*t + KL - 1 (KL = KP / 4), so each lane runs a KL-slot network whose top slot's upper
neighbour is lane t + 1's slot 0 (one shfl.down of the value and of the id; +inf above lane 3).
The top topk of the KP slots are written out.  Against every lane keeping a row's whole top-k
(the 4 lanes then run the same network 4 times) that is ~3x fewer ALU-pipe instructions per key
block (the row max, 64 FMNMX per thread, is then the largest part) and 4x less state.  The
shuffle assumes the quad is the tensor's axis 1 (lane bits 0, 1), which `shfl_layouts_ok`
checks on the compiled TTGIR (at the first launch of each configuration, and in the tests);
where it fails, and under the interpreter (no inline asm), the same network takes the lane
neighbour by a gather.

FP8 scoring (score_dtype="fp8")
-------------------------------
q_idx and k_idx are quantized per row to float8_e4m3fn with float32 scales (reference.py,
`msakit.ops.fp8.quantize_fp8`: `quantize_fp8_triton`, one Triton pass each); the fp8 x fp8 dot
runs at twice the bf16 rate on Hopper.  The q scale
is positive per row and cannot change the row's ranking, so it is dropped; the k scale varies
along the row and multiplies each score column before the block max.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import interpret_mode, warn_once
from ..fp8_triton import quantize_fp8_triton
from .settings import Selection

NEG_INF = tl.constexpr(float("-inf"))
POS_INF = tl.constexpr(float("inf"))


@triton.jit
def _next_lane(v, lt, SHFL_ASM: tl.constexpr):
    """[r, t] <- v[r, t + 1] along the 4-wide lane axis (the value left at t = 3 is unspecified).

    On the GPU the axis is the 4 lanes of a quad (lane bits 0 and 1 are t: the layout the score
    tile's reshape gives, checked by `compile_report`), so one shfl.down per register does it;
    the interpreter (no inline asm) uses a gather.
    """
    if SHFL_ASM:
        # not is_pure: a pure asm may be sunk into a branch that only some lanes take, and a
        # shfl.sync whose member mask names lanes that never arrive waits forever
        bits = v.to(tl.int32, bitcast=True)
        bits = tl.inline_asm_elementwise(
            "shfl.sync.down.b32 $0, $1, 1, 0x1c1f, 0xffffffff;", "=r,r", [bits],
            dtype=tl.int32, is_pure=False, pack=1,
        )
        return bits.to(v.dtype, bitcast=True)
    else:
        idx = tl.minimum(lt + 1, 3) + tl.zeros(v.shape, tl.int32)
        return tl.gather(v, idx, 1)


@triton.jit
def _score_block(
    q, k_base, k_desc, ks_base, stride_kt, stride_kd, stride_kst, kb, seq_len, tok, k_row0,
    BS: tl.constexpr, DI: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, NSUB: tl.constexpr, HAS_PAD: tl.constexpr, CAUSAL: tl.constexpr,
    USE_KSCALE: tl.constexpr, DOT_F32: tl.constexpr, TF32X3: tl.constexpr, TMA: tl.constexpr,
):
    """Max over key block kb's tokens (j <= tok when CAUSAL) of each row's scores, as [BLOCK_M, 4]:
    column t the max over the key columns c with (c // 2) % 4 == t -- the columns lane t of a
    quad holds in the MMA accumulator, so the reduction stays inside each thread; the row max is
    then the max over the 4 lanes.
    Without CAUSAL the block lies entirely before the tile's first token: no mask at all
    (except the padding columns of a block that is not a multiple of BLOCK_N).
    """
    rn = tl.arange(0, BLOCK_N)
    rd = tl.arange(0, BLOCK_D)
    mb = tl.full([BLOCK_M, 4], NEG_INF, tl.float32)
    for sub in tl.static_range(NSUB):
        n_in = sub * BLOCK_N + rn  # position inside the block
        col = kb * BS + n_in  # key position inside the sequence
        if TMA:  # rows past the sequence are another sequence's keys or zeros: masked below
            k = k_desc.load([k_row0 + kb * BS + sub * BLOCK_N, 0])
        else:
            # one 64-bit scalar block pointer + loop-invariant 32-bit offsets (cheap addressing)
            k_blk = k_base + tl.cast(kb * BS + sub * BLOCK_N, tl.int64) * stride_kt
            kp = k_blk + (rn[:, None] * stride_kt + rd[None, :] * stride_kd)
            if CAUSAL or HAS_PAD:
                cmask = col < seq_len
                if HAS_PAD:
                    cmask = cmask & (n_in < BS)
                if DI == BLOCK_D:
                    k = tl.load(kp, mask=cmask[:, None], other=0.0)
                else:
                    k = tl.load(kp, mask=cmask[:, None] & (rd[None, :] < DI), other=0.0)
            else:
                if DI == BLOCK_D:
                    k = tl.load(kp)
                else:
                    k = tl.load(kp, mask=(rd[None, :] < DI), other=0.0)
        if DOT_F32:  # interpreter only: its bf16 dot multiplies the raw bits
            k = k.to(tl.float32)
        if TF32X3:  # float32 inputs: 3-pass tf32, near-fp32 accuracy on tensor cores
            s = tl.dot(q, tl.trans(k), input_precision="tf32x3")
        else:
            s = tl.dot(q, tl.trans(k))
        if USE_KSCALE:
            if CAUSAL or HAS_PAD:
                ks = tl.load(ks_base + col.to(tl.int64) * stride_kst, mask=col < seq_len, other=1.0)
            else:
                ks = tl.load(ks_base + col.to(tl.int64) * stride_kst)
            s = s * ks[None, :]
        if CAUSAL:
            ok = col[None, :] <= tok[:, None]
            if HAS_PAD:
                ok = ok & (n_in < BS)[None, :]
            s = tl.where(ok, s, NEG_INF)
        elif HAS_PAD:
            s = tl.where((n_in < BS)[None, :], s, NEG_INF)
        # NaN scores count as -inf (never selected): the reductions ignore NaN on the GPU
        # (max.f32), so a partial max is NaN only when all its scores are; it is mapped to -inf
        # here, once per (row, lane) and sub-tile, so the interpreter (whose elementwise maximum
        # propagates NaN) ranks exactly as the GPU does
        part = tl.max(tl.max(tl.reshape(s, [BLOCK_M, BLOCK_N // 8, 4, 2]), 3), 1)
        mb = tl.maximum(mb, tl.where(part == part, part, NEG_INF))
    return mb


@triton.jit
def _topk_insert_lanes(vals, ids, x, kb, lt, KL: tl.constexpr, SHFL_ASM: tl.constexpr):
    """Insert block kb with row scores x [BLOCK_M, 1] into each row's sorted top-K, held
    lane-split (see the module docstring): vals/ids are KL tensors [BLOCK_M, 4], slot KL * t + j
    in vals[j][:, t], ascending by (value, -id) over the slots.  With c_s = slot_s < x (true on a
    prefix), slot s takes slot s + 1 where c_{s+1} (shift down, dropping slot 0), x where c_s and
    not c_{s+1}, and keeps its entry otherwise; x <= slot 0 changes nothing, so an equal score
    never displaces an earlier (lower) id.  The upper neighbour of lane t's top slot is lane
    t + 1's slot 0 (one shuffle), +inf above the top slot (lane 3).
    """
    up_v = tl.where(lt == 3, POS_INF, _next_lane(vals[0], lt, SHFL_ASM))
    up_i = _next_lane(ids[0], lt, SHFL_ASM)
    nv = ()
    ni = ()
    c_s = vals[0] < x
    for j in tl.static_range(KL):
        if j + 1 < KL:
            v_n = vals[j + 1]
            i_n = ids[j + 1]
        else:
            v_n = up_v
            i_n = up_i
        c_n = v_n < x
        nv = nv + (tl.where(c_n, v_n, tl.where(c_s, x, vals[j])),)
        ni = ni + (tl.where(c_n, i_n, tl.where(c_s, kb, ids[j])),)
        c_s = c_n
    return nv, ni


@triton.jit
def _step(vals, ids, mb, kb, forced, lt, KL: tl.constexpr, SHFL_ASM: tl.constexpr, FORCED: tl.constexpr):
    """Reduce block kb's partial maxima to a row score, force, insert."""
    x = tl.max(mb, 1)
    if FORCED == 1:  # every row forces this block (an init block before the tile)
        x = tl.full(x.shape, POS_INF, tl.float32)
    elif FORCED == 2:
        x = tl.where(forced, POS_INF, x)
    return _topk_insert_lanes(vals, ids, x[:, None], kb, lt, KL, SHFL_ASM)


@triton.jit
def _index_topk_kernel(
    q_ptr, k_ptr, k_desc, ks_ptr, out_ptr, tile_ptr, cu_ptr,
    T, B, n_tiles,
    stride_qb, stride_qt, stride_qg, stride_qd,
    stride_kb, stride_kt, stride_kd,
    stride_ksb, stride_kst,
    stride_ob, stride_og, stride_ot, stride_os,
    local_blocks, init_blocks,
    G: tl.constexpr, DI: tl.constexpr, BS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, NSUB: tl.constexpr,
    HAS_PAD: tl.constexpr, TOPK: tl.constexpr, VARLEN: tl.constexpr,
    USE_KSCALE: tl.constexpr, DOT_F32: tl.constexpr, TF32X3: tl.constexpr,
    SHFL_ASM: tl.constexpr, TMA: tl.constexpr,
):
    pid = tl.program_id(0)
    if VARLEN:
        # table of (document, tile inside the document), heaviest first; document -1 = padding
        doc = tl.load(tile_ptr + 2 * pid)
        tile = tl.load(tile_ptr + 2 * pid + 1)
        doc_ok = doc >= 0
        doc = tl.maximum(doc, 0)
        seq_start = tl.load(cu_ptr + doc)
        seq_len = tl.load(cu_ptr + doc + 1) - seq_start
        seq_len = tl.where(doc_ok, seq_len, 0)
        b = pid * 0
    else:
        b = pid % B
        tile = n_tiles - 1 - pid // B
        seq_start = pid * 0
        seq_len = T + pid * 0

    rm = tl.arange(0, BLOCK_M)
    rd = tl.arange(0, BLOCK_D)
    flat = tile * BLOCK_M + rm  # (token, group) row inside the sequence
    tok = flat // G
    grp = flat % G
    row_ok = tok < seq_len

    b64 = b.to(tl.int64)
    start64 = seq_start.to(tl.int64)
    q_rows = q_ptr + b64 * stride_qb + (start64 + tok.to(tl.int64)) * stride_qt + grp.to(tl.int64) * stride_qg
    qp = q_rows[:, None] + rd[None, :] * stride_qd
    if DI == BLOCK_D:
        q = tl.load(qp, mask=row_ok[:, None], other=0.0)
    else:
        q = tl.load(qp, mask=row_ok[:, None] & (rd[None, :] < DI), other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    k_base = k_ptr + b64 * stride_kb + start64 * stride_kt
    ks_base = ks_ptr + b64 * stride_ksb + start64 * stride_kst
    k_row0 = b * T + seq_start  # the sequence's first row in the [B * T, Di] descriptor

    # key blocks, ascending: [0, n_init) forced init blocks before the tile's first token,
    # [n_init, n_plain) before it and forced for no row (no mask, no forcing), then
    # [n_plain, n_blk) with the causal mask and the per-row forcing (the last local_blocks + 1
    # blocks or so, and the diagonal)
    tok_lo = (tile * BLOCK_M) // G
    tok_hi = tl.maximum(tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // G, seq_len - 1), 0)
    n_blk = tl.where(seq_len > 0, tok_hi // BS + 1, 0)
    n_full = tl.minimum(tok_lo // BS, n_blk)
    n_init = tl.minimum(init_blocks, n_full)
    n_plain = tl.maximum(tl.minimum(n_full, tok_lo // BS - local_blocks + 1), n_init)
    own = tok // BS

    KL: tl.constexpr = (TOPK + 3) // 4  # slots per lane
    vals = ()
    ids = ()
    lt = tl.arange(0, 4)[None, :]
    for _s in tl.static_range(KL):
        vals = vals + (tl.full([BLOCK_M, 4], NEG_INF, tl.float32),)
        ids = ids + (tl.full([BLOCK_M, 4], -1, tl.int32),)

    for kb in range(0, n_init):
        mb = _score_block(q, k_base, k_desc, ks_base, stride_kt, stride_kd, stride_kst, kb, seq_len, tok, k_row0,
                          BS, DI, BLOCK_M, BLOCK_N, BLOCK_D, NSUB, HAS_PAD, False, USE_KSCALE, DOT_F32, TF32X3, TMA)
        vals, ids = _step(vals, ids, mb, kb, None, lt, KL, SHFL_ASM, 1)
    for kb in range(n_init, n_plain):
        mb = _score_block(q, k_base, k_desc, ks_base, stride_kt, stride_kd, stride_kst, kb, seq_len, tok, k_row0,
                          BS, DI, BLOCK_M, BLOCK_N, BLOCK_D, NSUB, HAS_PAD, False, USE_KSCALE, DOT_F32, TF32X3, TMA)
        vals, ids = _step(vals, ids, mb, kb, None, lt, KL, SHFL_ASM, 0)
    for kb in range(n_plain, n_blk):
        mb = _score_block(q, k_base, k_desc, ks_base, stride_kt, stride_kd, stride_kst, kb, seq_len, tok, k_row0,
                          BS, DI, BLOCK_M, BLOCK_N, BLOCK_D, NSUB, HAS_PAD, True, USE_KSCALE, DOT_F32, TF32X3, TMA)
        forced = ((kb <= own) & (kb > own - local_blocks)) | ((kb < init_blocks) & (kb <= own))
        vals, ids = _step(vals, ids, mb, kb, forced, lt, KL, SHFL_ASM, 2)

    # slots ascend by (score, -id); the reference lists them descending (forced ids ascending,
    # then by score, ties to the lower id), then -1 for the empty slots, which hold id -1
    o_rows = out_ptr + b64 * stride_ob + grp.to(tl.int64) * stride_og + (start64 + tok.to(tl.int64)) * stride_ot
    # slot KL * t + j of KP = 4 * KL goes to column KP - 1 - (KL * t + j) when that is < TOPK
    for j in tl.static_range(KL):
        pos = 4 * KL - 1 - (KL * lt + j)
        tl.store(o_rows[:, None] + pos * stride_os, ids[j], mask=row_ok[:, None] & (pos < TOPK))


# ----------------------------------------------------------------------------- host side

def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def block_n_for(block_size: int, cap: int = 128) -> int:
    """Keys per dot: the largest power of two in [16, cap] dividing block_size, else the padded block."""
    bn = cap
    while bn >= 16:
        if block_size % bn == 0:
            return bn
        bn //= 2
    return min(cap, max(16, _next_pow2(block_size)))


# GPU configurations (H100/H200, sm_90), keyed by the scoring dtype class and head dim.
# BLOCK_M rows = BLOCK_M / G tokens with all their groups.  Keys (all optional but BLOCK_M,
# num_warps, num_stages): TMA (key tiles by tensor-memory-accelerator copies instead of
# per-thread cp.async), BLOCK_N_MAX (keys per dot), maxnreg (register cap), SHFL (False takes
# the lane neighbour by tl.gather, which moves the row max through shared memory, instead of the
# inline shfl.down; the fallback when `shfl_layouts_ok` rejects a layout).  The 16-bit default
# fits 2 CTAs per SM (128 registers x 8 warps, 97 KiB shared memory with 2 key stages): one
# CTA's reductions and top-k run while the other's wgmma runs -- a single warpgroup cannot
# overlap them itself (Triton waits for each dot before its first use, and a dot left in flight
# across iterations makes ptxas serialise the wgmma, C7514).  fp8 (fewer shared-memory bytes,
# more registers for the key scales) gets there with 4 warps x 128 rows.  Other configurations
# for GPU sweeps: tools/bench/index_topk.py (CANDIDATE_CONFIGS).
GPU_CONFIGS = {
    ("16bit", 128): dict(BLOCK_M=128, num_warps=8, num_stages=2, TMA=True, maxnreg=128),
    ("16bit", 256): dict(BLOCK_M=128, num_warps=8, num_stages=2, TMA=True),
    ("fp8", 128): dict(BLOCK_M=128, num_warps=4, num_stages=4, TMA=True),
    ("fp8", 256): dict(BLOCK_M=128, num_warps=4, num_stages=2, TMA=True),
    # float32 inputs: 3-pass tf32 (near-fp32 accuracy); 64-key tiles to fit shared memory
    ("fp32", 128): dict(BLOCK_M=64, BLOCK_N_MAX=64, num_warps=4, num_stages=2, TMA=False),
    ("fp32", 256): dict(BLOCK_M=64, BLOCK_N_MAX=32, num_warps=4, num_stages=2, TMA=False),
}
# Under the interpreter: the GPU configuration of the same kind (the same code branches: TMA
# key loads for 16-bit and fp8, cp.async for fp32) with smaller tiles and one stage.
INTERPRET_OVERRIDES = dict(BLOCK_M=64, num_warps=4, num_stages=1)


def default_config(kind: str, head_dim: int) -> dict:
    cfg = dict(GPU_CONFIGS[(kind, 128 if head_dim <= 128 else 256)])
    if interpret_mode():
        cfg.update(INTERPRET_OVERRIDES)
        cfg.pop("maxnreg", None)
    return cfg


def build_varlen_tiles(cu_seqlens: torch.Tensor, total: int, G: int, block_m: int) -> torch.Tensor:
    """Device-side (document, tile) table, int32 [max_tiles, 2], heaviest tiles first.

    Document d has ceil(len_d * G / block_m) tiles; the table length is the bound
    ceil(total * G / block_m) + ndocs (no host sync), padded with document -1.
    """
    dev = cu_seqlens.device
    cu = cu_seqlens.long()
    ndocs = cu.numel() - 1
    lens = (cu[1:] - cu[:-1]).clamp(min=0)
    nt = (lens * G + block_m - 1) // block_m
    cum = torch.cumsum(nt, 0)
    max_tiles = (total * G + block_m - 1) // block_m + ndocs
    t = torch.arange(max_tiles, device=dev)
    doc = torch.searchsorted(cum, t, right=True)
    valid = doc < ndocs
    docc = doc.clamp(max=ndocs - 1)
    local = t - (cum[docc] - nt[docc])
    last_row = torch.minimum((local + 1) * block_m, lens[docc] * G) - 1
    work = torch.where(valid, last_row // G + 1, torch.full_like(last_row, -1))
    order = torch.sort(work, descending=True, stable=True).indices
    table = torch.stack(
        [torch.where(valid, docc, torch.full_like(docc, -1))[order], torch.where(valid, local, 0)[order]], dim=1
    )
    return table.to(torch.int32).contiguous()


def index_topk_triton(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    sel: Selection,
    *,
    cu_seqlens: torch.Tensor | None = None,
    score_dtype: str | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """Kernel entry (arguments already checked by `index_topk`; `sel` is checked on construction).
    Returns int32 [B, G, T, sel.topk].

    config: overrides of the default configuration (`GPU_CONFIGS`); one with num_warps is a whole
    configuration, whose omitted keys mean TMA off, no register cap, the shuffle on.
    """
    kw = dict(block_size=sel.block_size, topk=sel.topk, local_blocks=sel.local_blocks,
              init_blocks=sel.init_blocks, cu_seqlens=cu_seqlens, config=config)
    if score_dtype == "fp8":
        q8, _ = quantize_fp8_triton(q_idx)
        k8, ks = quantize_fp8_triton(k_idx)
        return launch(q8, k8, ks, **kw)
    if q_idx.dtype == torch.float64:  # the kernel scores in float32
        q_idx, k_idx = q_idx.float(), k_idx.float()
    return launch(q_idx, k_idx, None, **kw)


def _tma_ok(k: torch.Tensor, B: int, T: int) -> bool:
    """Whether k [B, T, Di] can be read as one [B * T, Di] tensor-map (16-byte aligned rows)."""
    e = k.element_size()
    return (
        k.stride(2) == 1 and (B == 1 or k.stride(0) == T * k.stride(1)) and (k.stride(1) * e) % 16 == 0
        and k.data_ptr() % 16 == 0 and k.shape[2] * e >= 16
    )


def _prepare(q, k, k_scale, *, block_size, topk, local_blocks, init_blocks, cu_seqlens=None, config=None):
    """Everything one launch needs: (out, grid, runtime args, constexprs, launch options)."""
    B, T, G, Di = q.shape
    dev = q.device
    fp8 = q.dtype == torch.float8_e4m3fn
    kind = "fp8" if fp8 else ("fp32" if q.dtype == torch.float32 else "16bit")
    cfg = default_config(kind, Di)
    if config:
        if "num_warps" in config:  # a whole configuration: variant keys it omits take their base values
            for key in ("TMA", "maxnreg", "SHFL"):  # TMA off, no register cap, shuffle on
                cfg.pop(key, None)
        cfg.update(config)
    block_m = int(cfg["BLOCK_M"])
    block_m = max(16, min(block_m, _next_pow2(T * G)))  # tiny sequences: smaller tiles
    # topk > 16 slots need the registers of a 128-wide score tile: use 64-key sub-tiles
    block_n = block_n_for(block_size, int(cfg.get("BLOCK_N_MAX", 128 if topk <= 16 else 64)))
    nsub = (block_size + block_n - 1) // block_n
    block_d = max(16, _next_pow2(Di))
    num_stages = int(cfg["num_stages"])
    if not interpret_mode():  # keep q + the pipelined key tiles within Hopper's 227 KiB
        esize = q.element_size()
        while num_stages > 1 and (block_m + num_stages * nsub * block_n) * block_d * esize > 200 * 1024:
            num_stages -= 1
    if T * G >= 2**31 - block_m:
        raise ValueError(f"index_topk: T * G = {T * G} rows exceed the kernel's int32 row index")

    unknown = set(cfg) - {"BLOCK_M", "num_warps", "num_stages", "TMA", "BLOCK_N_MAX", "maxnreg", "SHFL"}
    if unknown:
        raise ValueError(f"index_topk config: unknown keys {sorted(unknown)}")
    use_tma = bool(cfg.get("TMA", False)) and _tma_ok(k, B, T)
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        k2 = k.as_strided((B * T, Di), (k.stride(1), 1))
        k_desc = TensorDescriptor(k2, [B * T, Di], [k.stride(1), 1], [block_n, block_d])
    else:
        k_desc = k  # unused
    if fp8:
        ks = k_scale.float()
        stride_ksb, stride_kst = ks.stride(0), ks.stride(1)
    else:
        ks = k  # unused
        stride_ksb, stride_kst = 0, 0
    if cu_seqlens is None:
        out = torch.empty((B, G, T, topk), dtype=torch.int32, device=dev)
        n_tiles = (T * G + block_m - 1) // block_m
        grid = (B * n_tiles,)
        tiles = cu = out  # unused
    else:
        out = torch.full((B, G, T, topk), -1, dtype=torch.int32, device=dev)
        cu = cu_seqlens.to(device=dev, dtype=torch.int32).contiguous()
        tiles = build_varlen_tiles(cu, T, G, block_m)
        n_tiles = tiles.shape[0]
        grid = (n_tiles,)
    args = [
        q, k, k_desc, ks, out, tiles, cu,
        T, B, n_tiles,
        q.stride(0), q.stride(1), q.stride(2), q.stride(3),
        k.stride(0), k.stride(1), k.stride(2),
        stride_ksb, stride_kst,
        out.stride(0), out.stride(1), out.stride(2), out.stride(3),
        local_blocks, init_blocks,
    ]
    constexprs = dict(
        G=G, DI=Di, BS=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, NSUB=nsub,
        HAS_PAD=nsub * block_n != block_size, TOPK=topk,
        VARLEN=cu_seqlens is not None, USE_KSCALE=fp8,
        DOT_F32=interpret_mode() and q.dtype == torch.bfloat16,
        TF32X3=q.dtype == torch.float32,
        SHFL_ASM=bool(cfg.get("SHFL", True)) and not interpret_mode(), TMA=use_tma,
    )
    options = dict(num_warps=int(cfg["num_warps"]), num_stages=num_stages)
    if cfg.get("maxnreg") and not interpret_mode():  # register cap (e.g. 128: 2 CTAs of 8 warps per SM)
        options["maxnreg"] = int(cfg["maxnreg"])
    return out, grid, args, constexprs, options


def launch(
    q: torch.Tensor,
    k: torch.Tensor,
    k_scale: torch.Tensor | None,
    *,
    block_size: int,
    topk: int,
    local_blocks: int,
    init_blocks: int,
    cu_seqlens: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """q [B, T, G, Di], k [B, T, Di] (bf16/fp16/fp32, or float8_e4m3fn with k_scale [B, T])."""
    out, grid, args, constexprs, options = _prepare(
        q, k, k_scale, block_size=block_size, topk=topk, local_blocks=local_blocks,
        init_blocks=init_blocks, cu_seqlens=cu_seqlens, config=config,
    )
    if grid[0] > 0:
        if constexprs["SHFL_ASM"] and not _shfl_checked(args, grid, constexprs, options):
            constexprs["SHFL_ASM"] = False  # an unexpected layout: the gather (correct, slower)
        _index_topk_kernel[grid](*args, **constexprs, **options)
    return out


_SHFL_OK: dict = {}


def _shfl_checked(args, grid, constexprs, options) -> bool:
    """Compile (once per configuration, no launch) and check the quad shuffles' layouts."""
    key = (tuple(sorted(constexprs.items())), tuple(sorted(options.items())))
    ok = _SHFL_OK.get(key)
    if ok is None:
        ck = _index_topk_kernel.warmup(*args, grid=grid, **constexprs, **options)
        if hasattr(ck, "result"):
            ck = ck.result()
        ok = ck is not None and shfl_layouts_ok(ck.asm["ttgir"])
        _SHFL_OK[key] = ok
        if not ok:
            warn_once(f"index_topk_shfl_{key}", "msakit: index_topk's lane-split top-k got an unexpected register "
                      "layout; using the slower gather for this configuration")
    return ok


# ----------------------------------------------------------------------------- layout check

def _split_top(text: str, sep: str = ",") -> list[str]:
    """Split at `sep` outside <>, [], {} and ()."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "<[{(":
            depth += 1
        elif ch in ">]})":
            depth -= 1
        if ch == sep and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def _layout_bases(layout: str, defs: dict, shape: list[int]):
    """(register, lane, warp) bases of a TTGIR distributed layout over `shape`, or None."""
    import json

    layout = layout.strip()
    if layout.startswith("#") and not layout.startswith("#ttg."):
        return _layout_bases(defs[layout], defs, shape) if layout in defs else None
    body = layout[layout.index("<{") + 2: layout.rindex("}>")] if "<{" in layout else ""
    fields = {}
    for item in _split_top(body):
        if "=" in item:
            key, val = item.split("=", 1)
            fields[key.strip()] = val.strip()
    if layout.startswith("#ttg.linear"):
        return tuple(json.loads(fields[k]) for k in ("register", "lane", "warp"))
    if layout.startswith("#ttg.slice"):
        d = int(fields["dim"])
        parent = _layout_bases(fields["parent"], defs, shape[:d] + [1] + shape[d:])
        if parent is None:
            return None
        return tuple([b[:d] + b[d + 1:] for b in bases] for bases in parent)
    if layout.startswith("#ttg.blocked"):
        keys = ("sizePerThread", "threadsPerWarp", "warpsPerCTA", "order")
        spt, tpw, wpc, order = (json.loads(fields[k]) for k in keys)
        rank = len(shape)

        def unit(d, v):
            e = [0] * rank
            e[d] = v if v < shape[d] else 0  # past the tensor: broadcast
            return e

        reg, lane, warp = [], [], []
        for d in order:
            reg += [unit(d, 1 << i) for i in range(spt[d].bit_length() - 1)]
        for d in order:
            lane += [unit(d, spt[d] << i) for i in range(tpw[d].bit_length() - 1)]
        for d in order:
            warp += [unit(d, spt[d] * tpw[d] << i) for i in range(wpc[d].bit_length() - 1)]
        for d in order:
            k = spt[d] * tpw[d] * wpc[d]
            while k < shape[d]:
                reg.append(unit(d, k))
                k *= 2
        return reg, lane, warp
    return None  # other encodings (mma, dot operands): not expected here


def shfl_layouts_ok(ttgir: str) -> bool:
    """Whether every quad shuffle (`_next_lane`'s inline asm) runs on a [M, 4] tensor whose axis 1
    is exactly lane bits 0 and 1 (so shfl.down by 1 in 4-lane segments reads t + 1 of the same
    row): lane bases 0, 1 are [0, 1], [0, 2] and no other register/lane/warp base moves axis 1."""
    import re

    defs = {}
    for line in ttgir.splitlines():
        m = re.match(r"^(#[A-Za-z_0-9]+) = (#ttg\..*)$", line.strip())
        if m:
            defs[m.group(1)] = m.group(2)
    for m in re.finditer(r'tt\.elementwise_inline_asm "shfl\.sync\.down[^\n]*?: (tensor<.*)$', ttgir, re.M):
        ty = m.group(1)
        inner = ty[len("tensor<"):]
        parts = _split_top(inner[: inner.rindex(">")] if "->" not in inner else inner.split("->")[0].rstrip()[:-1])
        dims = parts[0].split("x")[:-1]
        shape = [int(v) for v in dims]
        bases = _layout_bases(parts[1], defs, shape) if len(parts) > 1 else None
        if bases is None or len(shape) != 2 or shape[1] != 4:
            return False
        reg, lane, warp = bases
        if len(lane) < 2 or lane[0] != [0, 1] or lane[1] != [0, 2]:
            return False
        if any(b[1] != 0 for b in reg + lane[2:] + warp):
            return False
    return True
