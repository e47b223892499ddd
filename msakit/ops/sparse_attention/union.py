"""Union-tile query-outer forward of `sparse_attention` (Triton), and the choice between it and
the KV-outer kernels of `triton.py`.

A *tile* is `q_tile` consecutive queries of one (batch row, KV group); its MMA rows are those
queries x the group's Hq/G heads (8 x 16 = 128 at the M3 shape).  The tile walks the *union* of
its rows' selected blocks once, in ascending order: per union block one K / V load (TMA on
Hopper), S = Q K^T over all rows, a per-row mask only where needed (a row that did not select the
block, keys past the tile's first query), an online softmax, O += P V; no partial outputs, no
combine.  Its cost is the union's size: a tile whose union is u blocks and whose rows select v
on average computes u / v (its *union ratio*) times the useful work.

Plan (`union_plan`, one Triton program per tile sorting its q_tile x topk entries in registers,
no host sync): per tile the sorted distinct valid blocks (`ulist` int32 [B, G, nT, cap],
-1 past `ucnt`), and per query row a bitmask of the union slots it selected (`bits` int32
[B, G, nT * q_tile, W], bit s & 31 of word s >> 5).

Choice (`sparse_attention`'s forward): the plan (about 1% of the forward) gives every tile's ratio;
at a mean ratio up to `UNION_MAX_RATIO` the union kernel takes the whole call (on sm_90 with the
CuTe DSL, up to `UNION_MAX_RATIO_SM90`, the kernel of `sm90/` on the same plan), else the KV-outer
kernel does (one host sync; a per-tile mix of the two, measured, gained nothing over the
better of them; sampling tiles in torch cost 0.7-1 ms a call, more than the plan).  The backward is the
KV-outer backward either way (the same o and lse).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import interpret_mode

__all__ = ["union_plan", "union_supports", "union_q_tile", "sparse_attention_fwd_union", "UNION_MAX_RATIO",
           "UNION_MAX_RATIO_SM90"]

UNION_ROWS = 128  # MMA rows per tile (8 queries x 16 heads beat 4 x 16 on every shape measured, docs/kernels.md)
# The union kernel runs ~360 TFLOP/s on the union's work and the KV-outer kernel ~220 on the useful
# work (H100, M3 shape, docs/kernels.md), so the union pays below a mean ratio of ~1.6.
UNION_MAX_RATIO = 1.6
# the same break-even for the sm_90 CuTe DSL kernel (`sm90/`): on an H100 it delivers about
# 480 / ratio useful TFLOP/s (484 at 1.0, 329 at 1.55, 238 at 2.08, 160 at 3.4) against the
# KV-outer kernel's ~220 in the same run, so it wins up to a ratio of about 2.1
UNION_MAX_RATIO_SM90 = 2.1


def union_supports(heads_per_group: int, q_tile: int, head_dim: int, block_size: int) -> bool:
    """Whether the union kernel takes this shape: its rows (q_tile x heads per group) a power of two
    and, like its padded key block and head dim, at least 16 (the tensor-core dot's smallest side)."""
    rows = q_tile * heads_per_group
    return rows >= 16 and rows & (rows - 1) == 0 and block_size >= 16 and head_dim >= 16


@triton.jit
def _union_plan_kernel(bi_ptr, ulist_ptr, ucnt_ptr, bits_ptr, ratio_ptr, T, nT,
                       K: tl.constexpr, QT: tl.constexpr, E: tl.constexpr, W: tl.constexpr):
    """One program per tile: its QT x K entries sorted by (block, entry) in registers."""
    tile = tl.program_id(0)  # flat (b * G + g) * nT + t
    t = tile % nT
    bg = tile // nT
    e = tl.arange(0, E)
    qpos = t * QT + e // K
    ok = (e < QT * K) & (qpos < T)
    x = tl.load(bi_ptr + (bg * T + qpos).to(tl.int64) * K + e % K, mask=ok, other=-1)
    BIG: tl.constexpr = 2147483647
    key = tl.sort(tl.where(x >= 0, x * E + e, BIG))  # int32: blocks * E stays below 2^31 to 16M tokens
    valid = key != BIG
    blk = key // E
    row = (key % E) // K
    prev = tl.gather(key, tl.maximum(e - 1, 0), 0)
    same_blk = (e > 0) & (prev // E == blk)
    new = valid & (same_blk.to(tl.int32) == 0)
    first_row = valid & ((same_blk & ((prev % E) // K == row)).to(tl.int32) == 0)  # a row's repeats are adjacent
    slot = tl.cumsum(new.to(tl.int32), 0) - 1
    count = tl.sum(new.to(tl.int32), 0)
    tl.store(ulist_ptr + tile * E + slot, blk, mask=new)
    tl.store(ulist_ptr + tile * E + e, tl.full([E], -1, tl.int32), mask=e >= count)
    tl.store(ucnt_ptr + tile, count)
    # bits[row, word]: the sum of distinct powers of two (first_row dedupes a row's repeats) is their OR
    c = tl.arange(0, QT * W)
    match = first_row[:, None] & (row[:, None] == (c // W)[None, :]) & ((slot // 32)[:, None] == (c % W)[None, :])
    words = tl.sum(tl.where(match, (1 << (slot % 32))[:, None], 0), 0)
    tl.store(bits_ptr + (bg * nT * QT + t * QT + c // W).to(tl.int64) * W + c % W, words)
    rows = tl.minimum(T - t * QT, QT)
    mean = tl.sum(first_row.to(tl.float32), 0) / rows
    tl.store(ratio_ptr + tile, count.to(tl.float32) / tl.maximum(mean, 1.0))


def union_plan(block_idx: torch.Tensor, q_tile: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """block_idx int [B, G, T, K] (-1 padded; repeats allowed) ->
    (ulist int32 [B, G, nT, cap], ucnt int32 [B, G, nT], bits int32 [B, G, nT * q_tile, W],
    ratio float32 [B, G, nT] = ucnt / the tile's mean count of distinct valid blocks per row).
    A tile's union is ulist[..., :ucnt] ascending (-1 after); row r selected union slot s iff bit
    s & 31 of bits[..., r, s >> 5] is set.  nT = ceil(T / q_tile); cap = the next power of two
    >= q_tile * K (a bound, so the plan needs no host sync); W = max(1, cap / 32)."""
    B, G, T, K = block_idx.shape
    nT = (T + q_tile - 1) // q_tile
    E = max(triton.next_power_of_2(q_tile * K), 16)
    W = max(1, E // 32)
    if E > 256:
        raise ValueError(f"q_tile * topk must be <= 256 for the union plan, got {q_tile} * {K}")
    dev = block_idx.device
    ulist = torch.empty((B, G, nT, E), dtype=torch.int32, device=dev)
    ucnt = torch.empty((B, G, nT), dtype=torch.int32, device=dev)
    bits = torch.empty((B, G, nT * q_tile, W), dtype=torch.int32, device=dev)
    ratio = torch.empty((B, G, nT), dtype=torch.float32, device=dev)
    if B * G * nT:
        _union_plan_kernel[(B * G * nT,)](block_idx.to(torch.int32).contiguous(), ulist, ucnt, bits, ratio, T, nT,
                                          K=K, QT=q_tile, E=E, W=W, num_warps=4)
    return ulist, ucnt, bits, ratio


@triton.jit
def _union_fwd_kernel(
    q_ptr, k_ptr, v_ptr, k_desc, v_desc, ulist_ptr, ucnt_ptr, bits_ptr, o_ptr, lse_ptr,
    T, nT, CAP, W, qk_scale,
    HQ: tl.constexpr, G: tl.constexpr, HPG: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, QT: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
):
    tile = tl.program_id(0)  # flat (b * G + g) * nT + t
    t = tile % nT
    bg = tile // nT
    g = bg % G
    b = bg // G
    R: tl.constexpr = QT * HPG
    r = tl.arange(0, R)
    qpos = t * QT + r // HPG  # rows are query-major: the group's heads of one query are adjacent
    head = g * HPG + r % HPG
    rvalid = qpos < T
    qrow = ((b * T + qpos).to(tl.int64) * HQ + head) * D  # int64: B * T * Hq * D passes 2^31 at 1M tokens
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    n = tl.arange(0, BLOCK_N)
    q = tl.load(q_ptr + qrow[:, None] + d[None, :],
                mask=rvalid[:, None] & dmask[None, :], other=0.0)
    if UPCAST:  # the interpreter's dot does not take 16-bit floats
        q = q.to(tl.float32)
    m_i = tl.full([R], float("-inf"), tl.float32)
    l_i = tl.zeros([R], tl.float32)
    acc = tl.zeros([R, BLOCK_D], tl.float32)
    count = tl.load(ucnt_ptr + tile)
    bit_row = (bg * nT * QT + t * QT + r // HPG) * W
    for j in range(0, count):
        blk = tl.load(ulist_ptr + tile * CAP + j)
        word = tl.load(bits_ptr + bit_row + j // 32)
        hit = ((word >> (j % 32)) & 1) != 0
        pos = blk * BS + n
        kvalid = (n < BS) & (pos < T)
        if USE_TMA:  # whole [BS, D] tiles of k / v viewed as [B * T, G * D]
            k = k_desc.load([b * T + blk * BS, g * D])
            v = v_desc.load([b * T + blk * BS, g * D])
        else:
            kv = ((b * T + pos).to(tl.int64) * G + g)[:, None] * D + d[None, :]
            k = tl.load(k_ptr + kv, mask=kvalid[:, None] & dmask[None, :], other=0.0)
            v = tl.load(v_ptr + kv, mask=kvalid[:, None] & dmask[None, :], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [R, BLOCK_N], log2 units
        # masks only where needed: a row that did not select the block, or keys that may lie past
        # the tile's first query (its own block, the sequence's end, a padded block)
        all_hit = tl.min(hit.to(tl.int32), 0) > 0
        if (not all_hit) or (blk * BS + BLOCK_N > t * QT + 1):
            keep = hit[:, None] & kvalid[None, :] & (pos[None, :] <= qpos[:, None])
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    tl.store(o_ptr + qrow[:, None] + d[None, :], o.to(o_ptr.dtype.element_ty),
             mask=rvalid[:, None] & dmask[None, :])
    m_fin = tl.where(m_i == float("-inf"), 0.0, m_i)
    lse = tl.where(has, (m_fin + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(lse_ptr + (b * HQ + head).to(tl.int64) * T + qpos, lse, mask=rvalid)


def union_q_tile(heads_per_group: int, topk: int) -> int:
    """Queries per tile: 128 MMA rows (8 at the M3 shape's 16 heads per group), fewer where the
    plan's q_tile x topk entries would pass 256."""
    qt = max(1, UNION_ROWS // heads_per_group)
    while qt > 1 and qt * topk > 256:
        qt //= 2
    return qt


def sparse_attention_fwd_union(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_idx: torch.Tensor, block_size: int, scale: float,
    *, q_tile: int | None = None, plan: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """o [B, T, Hq, D] (q.dtype), lse [B, Hq, T] fp32 by the union-tile kernel over every tile.
    Inputs are assumed checked by the caller (no cu_seqlens: one document per batch row) and
    `union_supports` true for them; q_tile defaults to `union_q_tile`; plan: `union_plan(block_idx,
    q_tile)` when the caller has it."""
    B, T, Hq, D = q.shape
    G = k.shape[2]
    qt = q_tile or union_q_tile(Hq // G, block_idx.shape[3])
    ulist, ucnt, bits, _ = plan if plan is not None else union_plan(block_idx, qt)
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, T), dtype=torch.float32, device=q.device)
    kc, vc = k.contiguous(), v.contiguous()
    # TMA loads of K / V on Hopper (1.00-1.17x over pointer loads on every shape measured, docs/kernels.md)
    use_tma = (q.is_cuda and not interpret_mode() and torch.cuda.get_device_capability(q.device)[0] >= 9
               and block_size & (block_size - 1) == 0 and D & (D - 1) == 0)
    kd, vd = kc, vc
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        kd, vd = (TensorDescriptor.from_tensor(x.view(B * T, G * D), [block_size, D]) for x in (kc, vc))
    n_tiles = ucnt.numel()
    if n_tiles:
        _union_fwd_kernel[(n_tiles,)](
            q.contiguous(), kc, vc, kd, vd, ulist, ucnt, bits, o, lse,
            T, ulist.shape[2], ulist.shape[3], bits.shape[3], float(scale) * 1.4426950408889634,
            HQ=Hq, G=G, HPG=Hq // G, D=D, BS=block_size, QT=qt,
            BLOCK_D=triton.next_power_of_2(D), BLOCK_N=triton.next_power_of_2(block_size),
            UPCAST=interpret_mode() and q.dtype != torch.float32, USE_TMA=use_tma,
            num_warps=8 if qt * Hq // G >= 128 else 4, num_stages=3,
        )
    return o, lse
