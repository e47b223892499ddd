"""Triton kernels for `index_kl_loss` (forward value and gradients in one KV-outer pass) and
`selected_lse` (the main branch's per-head LSE over the selected tokens).

Work list: `k2q.build_k2q` (varlen: `_build_k2q_varlen`, same format) inverts block_idx into
tiles; a tile is one key (b, g, block) and up to QT * TPP (query, slot) entries that selected
it.  One program per tile keeps the block's k [bs, D] and k_idx [bs, Di] in shared memory and
walks its entries QT queries at a time ("sub-tiles"):

  stats pass (`_stats_kernel`):  z^T = k_idx_blk @ q_idx^T  -> per (query, slot) partial LSE
      of the index logits; when no `lse` is given also S^T = k_blk @ Q^T for the QT queries x
      Hq // G heads -> per (query, slot, head) partial LSE.  `_merge_kernel` log-sum-exps the
      slots (plain stores, no atomics: deterministic).
  main pass (`_kl_kernel`):  S^T = k_blk @ Q^T in head chunks of HC heads (HC * QT columns,
      column c = head * QT + query, so the mean over heads is a reduction inside each thread),
      P = mean_h exp(scale * s - lse_h), z = iscale * k_idx . q_idx, log P_idx = z - lse_idx;
      KL partial = sum P (log P - log P_idx) (one value per tile, summed afterwards:
      deterministic);  dz = P_idx - P;  dk_idx_blk += dz @ q_idx (registers, one fp32 atomic
      flush per tile);  dq_idx += dz^T @ k_idx_blk (fp32 atomics, <= topk per (query, group));
      both scaled by iscale / N in fp32 after the products.

Everything is recomputed from q, k and the LSE; P is never stored.  The loss and both
gradients come out of the forward (`index_kl_fwd_triton`); the backward only scales them by
the incoming gradient.  Gradients are summed with fp32 atomics (not bitwise deterministic).

Layouts: q [B, T, Hq, D], k [B, T, G, D], q_idx [B, T, G, Di], k_idx [B, T, Di], block_idx
[B, G, T, K], lse [B, Hq, T] (token-major [B, T, Hq] inside).  Varlen: B = 1, `cu_seqlens`
int32 [ndocs + 1], block ids relative to each document's start.  Token offsets are int64 in
the kernels; the few int32 offset products are bounded by checks in the drivers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import interpret_mode
from ..k2q import build_k2q, k2q_from_keys

__all__ = ["block_lse", "index_kl_fwd_triton", "selected_lse", "selected_lse_triton", "pick_config", "CONFIGS"]

LOG2E = 1.4426950408889634

# QT: queries per sub-tile (>= 16: it is the K dim of the dk dot); TPP: sub-tiles per program
# (the k2q tile holds QT * TPP entries); HC: heads per S chunk (S^T tile is bs x HC * QT);
# ST_HC / ST_STAGES: HC / num_stages of the stats kernel (default: HC / num_stages).  Other
# tilings for GPU sweeps: tools/bench/index_kl.py (SWEEP_CONFIGS).
CONFIGS: dict[str, dict] = {
    "interpret": dict(QT=16, TPP=2, HC=8, num_warps=4, num_stages=1),
    # sm_90 (`tools/bench/index_kl.py`'s ptxas report checks it for spills at the M3 shape)
    "sm90": dict(QT=16, TPP=8, HC=8, num_warps=8, num_stages=2, ST_HC=4, ST_STAGES=3),
    # float32 inputs on the GPU: exact fp32 dots ("ieee", FMA; tf32x3 needs > 227 KB smem) — a
    # correctness path, not a fast one.
    "sm90_fp32": dict(QT=16, TPP=8, HC=2, num_warps=8, num_stages=1),
    "default": dict(QT=16, TPP=8, HC=4, num_warps=8, num_stages=2),
}


def _np2(x: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(int(x)))


def pick_config(device: torch.device, hpg: int, config: dict | str | None = None,
                dtype: torch.dtype = torch.bfloat16) -> dict:
    """The config dict for a call: an explicit dict/name, else by device (interpreter, sm_90, other)
    and dtype (float32 inputs get the small-tile config)."""
    if isinstance(config, dict):
        cfg = dict(config)
    elif isinstance(config, str):
        cfg = dict(CONFIGS[config])
    elif interpret_mode() or device.type != "cuda":
        cfg = dict(CONFIGS["interpret"])
    else:
        major, _ = torch.cuda.get_device_capability(device)
        name = "sm90" if major == 9 else "default"
        cfg = dict(CONFIGS["sm90_fp32" if dtype == torch.float32 else name])
    cfg.setdefault("ST_HC", cfg["HC"])
    cfg.setdefault("ST_STAGES", cfg["num_stages"])
    for key in ("HC", "ST_HC"):  # largest power of two dividing hpg, capped by the config's value
        hc = 1
        while hc * 2 <= cfg[key] and hpg % (hc * 2) == 0:
            hc *= 2
        cfg[key] = hc
    assert cfg["QT"] >= 16 and cfg["QT"] & (cfg["QT"] - 1) == 0
    return cfg


# --------------------------------------------------------------------------------------------
# Work list
# --------------------------------------------------------------------------------------------


def _canonical_rows(block_idx: torch.Tensor, rel: torch.Tensor, block_size: int) -> torch.Tensor:
    """Like `k2q.canonical_selection`, with each row's position given by `rel` ([N])."""
    s = block_idx.long().sort(dim=-1).values
    dup = torch.zeros_like(s, dtype=torch.bool)
    dup[..., 1:] = s[..., 1:] == s[..., :-1]
    s = s.masked_fill(dup | (s * block_size > rel.view(1, -1, 1)), -1)
    big = torch.iinfo(torch.int64).max
    out = torch.where(s < 0, torch.full_like(s, big), s).sort(dim=-1).values
    return out.masked_fill(out == big, -1)


def _build_k2q_varlen(block_idx: torch.Tensor, cu_seqlens: torch.Tensor, block_size: int, q_tile: int):
    """block_idx [1, G, N, K] (ids relative to each document) -> (K2Q, NB, blk_start, blk_end).

    Keys are g * NB + global block (documents' blocks numbered consecutively); NB =
    ceil(N / block_size) + ndocs bounds the number of global blocks without a host sync.
    q_index holds absolute token positions; blk_start / blk_end (int64 [NB]) each global
    block's token range (empty for the unused tail).
    """
    _, G, N, K = block_idx.shape
    dev = block_idx.device
    bs = block_size
    cu = cu_seqlens.to(device=dev, dtype=torch.int64)
    ndocs = cu.numel() - 1
    lens = cu[1:] - cu[:-1]
    nbd = (lens + bs - 1) // bs
    bend = torch.cumsum(nbd, 0)
    boff = bend - nbd
    NB = (N + bs - 1) // bs + ndocs
    pos = torch.arange(N, device=dev)
    doc = torch.searchsorted(cu[1:].contiguous(), pos, right=True).clamp(max=ndocs - 1)
    rel = pos - cu[doc]
    s = _canonical_rows(block_idx[0], rel, bs)  # [G, N, K]
    nkeys = G * NB
    gv = torch.arange(G, device=dev).view(G, 1, 1)
    key = torch.where(s >= 0, gv * NB + boff[doc].view(1, N, 1) + s, torch.full_like(s, nkeys)).reshape(-1)
    w = k2q_from_keys(key, nkeys, K, N, q_tile, NB)
    gb = torch.arange(NB, device=dev)
    d = torch.searchsorted(bend.contiguous(), gb, right=True)
    ok = d < ndocs
    dc = d.clamp(max=ndocs - 1)
    b0 = cu[dc] + (gb - boff[dc]) * bs
    b1 = torch.minimum(b0 + bs, cu[dc + 1])
    zero = torch.zeros_like(b0)
    return w, NB, torch.where(ok, b0, zero), torch.where(ok, b1, zero)


def _work(block_idx, cu_seqlens, block_size: int, q_tile: int):
    """(K2Q, NB, blk_start, blk_end, varlen)."""
    if cu_seqlens is None:
        w = build_k2q(block_idx, block_size, q_tile)
        return w, w.nblocks, w.tile_key, w.tile_key, False
    w, NB, b0, b1 = _build_k2q_varlen(block_idx, cu_seqlens, block_size, q_tile)
    return w, NB, b0, b1, True


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _tile_count(tile_count_ptr):
    """(this program's tile, its entry count)."""
    pid = tl.program_id(0)
    return pid, tl.load(tile_count_ptr + pid)


@triton.jit
def _tile_geometry(pid, tile_key_ptr, tile_start_ptr, blk_start_ptr, blk_end_ptr, NB, T, bsz,
                   G: tl.constexpr, VARLEN: tl.constexpr, BS: tl.constexpr):
    """Tile pid -> (first entry, batch b, group g, first token t0 of its block, token count nj,
    the block's columns offs_j = 0 .. BS-1, their tokens t0 + offs_j and mask offs_j < nj)."""
    key = tl.load(tile_key_ptr + pid).to(tl.int64)
    e0 = tl.load(tile_start_ptr + pid).to(tl.int64)
    bg = key // NB
    blk = key - bg * NB
    g = bg % G
    b = bg // G
    if VARLEN:
        t0 = tl.load(blk_start_ptr + blk).to(tl.int64)
        t1 = tl.load(blk_end_ptr + blk).to(tl.int64)
    else:
        t0 = blk * bsz
        t1 = tl.minimum(t0 + bsz, T)
    nj = (t1 - t0).to(tl.int32)
    offs_j = tl.arange(0, BS)
    return e0, b, g, t0, nj, offs_j, t0 + offs_j, offs_j < nj


@triton.jit
def _stats_idx_subtile(s, count, kib, offs_j, offs_q, offs_di, dimask, nj, t0i, q_index_ptr, q_slot_ptr, e0,
                       qi_base, sqi_t, part_i_base, iscale_log2, K, QT: tl.constexpr, PREC_IDX: tl.constexpr):
    """Partial LSE (over this block) of the index logits of sub-tile s's queries -> part_i."""
    eq = s * QT + offs_q
    emask = eq < count
    qa = tl.load(q_index_ptr + e0 + eq, mask=emask, other=0)
    slot = tl.load(q_slot_ptr + e0 + eq, mask=emask, other=0)
    lim = tl.where(emask, tl.minimum(qa - t0i, nj - 1), -1)
    qib = tl.load(qi_base + qa.to(tl.int64)[:, None] * sqi_t + offs_di[None, :],
                  mask=emask[:, None] & dimask[None, :], other=0.0)
    z = tl.dot(kib, tl.trans(qib), input_precision=PREC_IDX) * iscale_log2  # [BS, QT], log2 units
    z = tl.where(offs_j[:, None] <= lim[None, :], z, float("-inf"))
    m = tl.max(z, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    l = tl.sum(tl.exp2(z - m[None, :]), axis=0)
    lse_i = tl.where(l > 0.0, (m + tl.log2(tl.where(l > 0.0, l, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(part_i_base + qa.to(tl.int64) * K + slot, lse_i, mask=emask)


@triton.jit
def _stats_kernel(
    q_ptr, k_ptr, qi_ptr, ki_ptr,
    q_index_ptr, q_slot_ptr, tile_key_ptr, tile_start_ptr, tile_count_ptr, blk_start_ptr, blk_end_ptr,
    part_h_ptr, part_i_ptr,
    T, NB, bsz, K,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_g,
    sqi_b, sqi_t, sqi_g, ski_b, ski_t,
    scale_log2, iscale_log2,
    G: tl.constexpr, HPG: tl.constexpr, HC: tl.constexpr, QT: tl.constexpr,
    D: tl.constexpr, DI: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr, BDI: tl.constexpr,
    HEADS: tl.constexpr, IDX: tl.constexpr, VARLEN: tl.constexpr,
    PREC_QK: tl.constexpr, PREC_IDX: tl.constexpr,
):
    """Per (query, slot) partial LSE of the index logits (IDX) and of each head's logits (HEADS).

    part_i [B, G, T, K] and part_h [B, G, T, K, HPG] (natural log; each (query, slot) entry
    belongs to exactly one tile, so plain stores).  With HEADS one loop runs over (sub-tile,
    head chunk) pairs (the Q-chunk loads stay pipelined across sub-tiles).
    """
    pid, count = _tile_count(tile_count_ptr)
    if count == 0:
        return
    e0, b, g, t0, nj, offs_j, tok, jmask = _tile_geometry(pid, tile_key_ptr, tile_start_ptr, blk_start_ptr,
                                                          blk_end_ptr, NB, T, bsz, G, VARLEN, BS)
    t0i = t0.to(tl.int32)
    offs_q = tl.arange(0, QT)
    offs_di = tl.arange(0, BDI)
    dimask = offs_di < DI
    n_sub = tl.cdiv(count, QT)
    if IDX:
        kib = tl.load(ki_ptr + b * ski_b + tok[:, None] * ski_t + offs_di[None, :],
                      mask=jmask[:, None] & dimask[None, :], other=0.0)
    else:
        kib = tl.zeros([BS, BDI], dtype=tl.float32)
    qi_base = qi_ptr + b * sqi_b + g * sqi_g
    part_i_base = part_i_ptr + (b * G + g) * T * K
    if HEADS:
        offs_d = tl.arange(0, BD)
        dmask = offs_d < D
        kb = tl.load(k_ptr + b * sk_b + tok[:, None] * sk_t + g * sk_g + offs_d[None, :],
                     mask=jmask[:, None] & dmask[None, :], other=0.0)
        offs_c = tl.arange(0, HC * QT)
        c_q = offs_c % QT
        c_h = offs_c // QT
        q_base = q_ptr + b * sq_b + (g * HPG) * sq_h
        part_h_base = part_h_ptr + (b * G + g) * T * K * HPG
        NCH: tl.constexpr = HPG // HC
        for it in range(0, n_sub * NCH):
            s = it // NCH
            hc = it - s * NCH
            ec = s * QT + c_q
            cmask = ec < count
            qc = tl.load(q_index_ptr + e0 + ec, mask=cmask, other=0)
            slot_c = tl.load(q_slot_ptr + e0 + ec, mask=cmask, other=0)
            lim_c = tl.where(cmask, tl.minimum(qc - t0i, nj - 1), -1)
            qr = tl.load(q_base + qc.to(tl.int64)[:, None] * sq_t + (hc * HC + c_h)[:, None] * sq_h
                         + offs_d[None, :], mask=cmask[:, None] & dmask[None, :], other=0.0)  # [HC*QT, BD]
            sc = tl.dot(kb, tl.trans(qr), input_precision=PREC_QK) * scale_log2  # [BS, HC*QT]
            sc = tl.where(offs_j[:, None] <= lim_c[None, :], sc, float("-inf"))
            m2 = tl.max(sc, axis=0)
            m2 = tl.where(m2 == float("-inf"), 0.0, m2)
            l2 = tl.sum(tl.exp2(sc - m2[None, :]), axis=0)
            lse_h = tl.where(l2 > 0.0, (m2 + tl.log2(tl.where(l2 > 0.0, l2, 1.0))) * 0.6931471805599453,
                             float("-inf"))
            # int32 offsets: T * K * HPG < 2**31 (checked by the driver)
            tl.store(part_h_base + (qc * K + slot_c) * HPG + hc * HC + c_h, lse_h, mask=cmask)
            if IDX:
                if hc == 0:
                    _stats_idx_subtile(s, count, kib, offs_j, offs_q, offs_di, dimask, nj, t0i, q_index_ptr,
                                       q_slot_ptr, e0, qi_base, sqi_t, part_i_base, iscale_log2, K, QT, PREC_IDX)
    else:
        for s in range(0, n_sub):
            _stats_idx_subtile(s, count, kib, offs_j, offs_q, offs_di, dimask, nj, t0i, q_index_ptr, q_slot_ptr,
                               e0, qi_base, sqi_t, part_i_base, iscale_log2, K, QT, PREC_IDX)


@triton.jit
def _merge_kernel(part_ptr, out_ptr, n_items, T, K, H: tl.constexpr, G: tl.constexpr, RB: tl.constexpr,
                  BK: tl.constexpr, TOKEN_MAJOR: tl.constexpr):
    """part [B, G, T, K, H] -> LSE over the K slots, out [B, G*H, T] (TOKEN_MAJOR: [B, T, G*H])."""
    pid = tl.program_id(0)
    idx = pid.to(tl.int64) * RB + tl.arange(0, RB)
    imask = idx < n_items
    r = idx // H
    h = idx - r * H
    bg = r // T
    t = r - bg * T
    kk = tl.arange(0, BK)
    x = tl.load(part_ptr + (r[:, None] * K + kk[None, :]) * H + h[:, None],
                mask=imask[:, None] & (kk[None, :] < K), other=float("-inf"))
    m = tl.max(x, axis=1)
    m = tl.where(m == float("-inf"), 0.0, m)
    l = tl.sum(tl.exp(x - m[:, None]), axis=1)
    out = tl.where(l > 0.0, m + tl.log(tl.where(l > 0.0, l, 1.0)), float("-inf"))
    if TOKEN_MAJOR:
        b = bg // G
        g = bg - b * G
        off = (b * T + t) * (G * H) + g * H + h
    else:
        off = (bg * H + h) * T + t
    tl.store(out_ptr + off, out, mask=imask)


@triton.jit
def _kl_subtile_epilogue(
    s, count, psum, kl_acc, dk_acc, kib, offs_j, offs_q, offs_di, dimask, nj, t0i,
    q_index_ptr, e0, qi_base, sqi_t, lsei_base, dq_base, iscale, grad_scale,
    G: tl.constexpr, HPG: tl.constexpr, QT: tl.constexpr, DI: tl.constexpr,
    GRAD: tl.constexpr, PREC_IDX: tl.constexpr,
):
    """Sub-tile s (QT queries) given psum = sum over the group's heads of exp(s_h - lse_h) [BS, QT]:
    KL terms into kl_acc, dloss/dk_idx (unscaled) into dk_acc, dloss/dq_idx atomically into dq."""
    eq = s * QT + offs_q
    emask = eq < count
    qa = tl.load(q_index_ptr + e0 + eq, mask=emask, other=0)
    # last key row of the block each query sees (-1: padding entry)
    lim = tl.where(emask, tl.minimum(qa - t0i, nj - 1), -1)
    qib = tl.load(qi_base + qa.to(tl.int64)[:, None] * sqi_t + offs_di[None, :],
                  mask=emask[:, None] & dimask[None, :], other=0.0)  # [QT, BDI]
    lsei = tl.load(lsei_base + qa, mask=emask, other=0.0)
    z = tl.dot(kib, tl.trans(qib), input_precision=PREC_IDX) * iscale  # [BS, QT]
    valid = offs_j[:, None] <= lim[None, :]
    P = tl.where(valid, psum * (1.0 / HPG), 0.0)
    lpi = z - lsei[None, :]  # log P_idx on valid entries
    pos = valid & (P > 0.0)
    kl_acc += tl.where(pos, P * (tl.log(tl.where(pos, P, 1.0)) - lpi), 0.0)
    if GRAD:
        # dloss/dz = (P_idx - P) * grad_scale; the scale (iscale / N, tiny) is applied in fp32
        # after the products so that fp16 operands never underflow
        dz = tl.where(valid, tl.exp(tl.where(valid, lpi, 0.0)) - P, 0.0)  # [BS, QT]
        dzc = dz.to(qib.dtype)
        dk_acc += tl.dot(dzc, qib, input_precision=PREC_IDX)  # [BS, BDI]
        dqt = tl.dot(tl.trans(kib), dzc, input_precision=PREC_IDX) * grad_scale  # [BDI, QT] = dq^T
        tl.atomic_add(dq_base + qa.to(tl.int64)[None, :] * (G * DI) + offs_di[:, None], dqt,
                      mask=emask[None, :] & dimask[:, None], sem="relaxed")
    return kl_acc, dk_acc


@triton.jit
def _head_chunk(kb, q_index_ptr, e0, s, hc, count, c_q, c_h, offs_d, dmask, q_base, sq_t, sq_h, lse_base,
                scale_log2, G: tl.constexpr, HPG: tl.constexpr, HC: tl.constexpr, QT: tl.constexpr,
                BS: tl.constexpr, PREC_QK: tl.constexpr):
    """sum over heads hc*HC .. hc*HC+HC-1 of exp(scale * S - lse) for sub-tile s, [BS, QT] (unmasked:
    entries past a query's causal limit may be inf; the epilogue drops them per (j, query))."""
    # column c = head * QT + query
    ec = s * QT + c_q
    cmask = ec < count
    qc = tl.load(q_index_ptr + e0 + ec, mask=cmask, other=0)
    qr = tl.load(q_base + qc.to(tl.int64)[:, None] * sq_t + (hc * HC + c_h)[:, None] * sq_h + offs_d[None, :],
                 mask=cmask[:, None] & dmask[None, :], other=0.0)  # [HC*QT, BD]
    # int32 offsets: T * Hq < 2**31 (checked by the driver)
    lse_c = tl.load(lse_base + qc * (G * HPG) + hc * HC + c_h, mask=cmask, other=0.0)
    sc = tl.dot(kb, tl.trans(qr), input_precision=PREC_QK)  # [BS, HC*QT]
    p = tl.exp2(sc * scale_log2 - (lse_c * 1.4426950408889634)[None, :])
    return tl.sum(tl.reshape(p, (BS, HC, QT)), axis=1)


@triton.jit
def _kl_kernel(
    q_ptr, k_ptr, qi_ptr, ki_ptr, lse_ptr, lsei_ptr,
    q_index_ptr, tile_key_ptr, tile_start_ptr, tile_count_ptr, blk_start_ptr, blk_end_ptr,
    kl_part_ptr, dq_ptr, dk_ptr,
    T, NB, bsz,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_g,
    sqi_b, sqi_t, sqi_g, ski_b, ski_t,
    scale_log2, iscale, grad_scale,
    G: tl.constexpr, HPG: tl.constexpr, HC: tl.constexpr, QT: tl.constexpr,
    D: tl.constexpr, DI: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr, BDI: tl.constexpr,
    VARLEN: tl.constexpr, GRAD: tl.constexpr,
    PREC_QK: tl.constexpr, PREC_IDX: tl.constexpr,
):
    """KL partial of the tile (kl_part[pid]) and, with GRAD, the fp32 gradients (atomics).

    lse is token-major [B, T, G*HPG] (natural log), lse_idx [B, G, T]; dq [B, T, G, DI] and
    dk [B, T, DI] fp32 accumulators.  One loop over (sub-tile, head chunk) pairs, so that the
    Q-chunk loads stay software-pipelined across sub-tiles.
    """
    pid, count = _tile_count(tile_count_ptr)
    if count == 0:
        return
    e0, b, g, t0, nj, offs_j, tok, jmask = _tile_geometry(pid, tile_key_ptr, tile_start_ptr, blk_start_ptr,
                                                          blk_end_ptr, NB, T, bsz, G, VARLEN, BS)
    offs_d = tl.arange(0, BD)
    dmask = offs_d < D
    offs_di = tl.arange(0, BDI)
    dimask = offs_di < DI
    kb = tl.load(k_ptr + b * sk_b + tok[:, None] * sk_t + g * sk_g + offs_d[None, :],
                 mask=jmask[:, None] & dmask[None, :], other=0.0)
    kib = tl.load(ki_ptr + b * ski_b + tok[:, None] * ski_t + offs_di[None, :],
                  mask=jmask[:, None] & dimask[None, :], other=0.0)
    offs_q = tl.arange(0, QT)
    offs_c = tl.arange(0, HC * QT)
    c_q = offs_c % QT
    c_h = offs_c // QT
    t0i = t0.to(tl.int32)
    q_base = q_ptr + b * sq_b + (g * HPG) * sq_h
    lse_base = lse_ptr + b * T * (G * HPG) + g * HPG
    lsei_base = lsei_ptr + (b * G + g) * T
    qi_base = qi_ptr + b * sqi_b + g * sqi_g
    dq_base = dq_ptr + (b * T * G + g) * DI
    kl_acc = tl.zeros([BS, QT], dtype=tl.float32)
    dk_acc = tl.zeros([BS, BDI], dtype=tl.float32)
    n_sub = tl.cdiv(count, QT)
    NCH: tl.constexpr = HPG // HC
    # one loop over (sub-tile, head chunk) pairs: the Q-chunk cp.async pipeline keeps running
    # across sub-tiles
    psum = tl.zeros([BS, QT], dtype=tl.float32)
    for it in range(0, n_sub * NCH):
        s = it // NCH
        hc = it - s * NCH
        psum += _head_chunk(kb, q_index_ptr, e0, s, hc, count, c_q, c_h, offs_d, dmask, q_base, sq_t, sq_h,
                            lse_base, scale_log2, G, HPG, HC, QT, BS, PREC_QK)
        if hc == NCH - 1:
            kl_acc, dk_acc = _kl_subtile_epilogue(
                s, count, psum, kl_acc, dk_acc, kib, offs_j, offs_q, offs_di, dimask, nj, t0i,
                q_index_ptr, e0, qi_base, sqi_t, lsei_base, dq_base, iscale, grad_scale,
                G, HPG, QT, DI, GRAD, PREC_IDX)
            psum = tl.zeros([BS, QT], dtype=tl.float32)
    tl.store(kl_part_ptr + pid, tl.sum(tl.sum(kl_acc, axis=1), axis=0))
    if GRAD:
        tl.atomic_add(dk_ptr + (b * T + tok[:, None]) * DI + offs_di[None, :], dk_acc * grad_scale,
                      mask=jmask[:, None] & dimask[None, :], sem="relaxed")


# --------------------------------------------------------------------------------------------
# Drivers
# --------------------------------------------------------------------------------------------


def _prec(dtype: torch.dtype) -> str:
    # fp16/bf16 ignore it; float32 inputs get exact fp32 products (never tf32)
    return "ieee" if dtype == torch.float32 else "tf32"


def _last_dim_contig(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _merge(part: torch.Tensor, B: int, G: int, T: int, K: int, H: int, token_major: bool = False) -> torch.Tensor:
    """LSE over the slots of part [B, G, T, K, H] -> [B, G*H, T] (token_major: [B, T, G*H]) fp32."""
    shape = (B, T, G * H) if token_major else (B, G * H, T)
    out = torch.empty(shape, device=part.device, dtype=torch.float32)
    n = B * G * T * H
    RB = 128
    _merge_kernel[(triton.cdiv(n, RB),)](part, out, n, T, K, H=H, G=G, RB=RB, BK=triton.next_power_of_2(K),
                                         TOKEN_MAJOR=token_major, num_warps=4)
    return out


def _run_stats(q, k, q_idx, k_idx, w, NB, b0, b1, varlen, B, T, G, K, block_size, scale, iscale, cfg,
               heads: bool, idx: bool):
    """Partial LSE buffers (None where not asked) filled by `_stats_kernel`."""
    dev = w.tile_key.device
    hpg = q.shape[2] // G if heads else 1
    D = q.shape[3] if heads else 16
    Di = q_idx.shape[3] if idx else 16
    if heads and T * K * hpg >= 2**31:
        raise ValueError("selected_lse: T * topk * (Hq // G) must stay below 2**31")
    part_h = torch.full((B, G, T, K, hpg), float("-inf"), device=dev, dtype=torch.float32) if heads else None
    part_i = torch.full((B, G, T, K), float("-inf"), device=dev, dtype=torch.float32) if idx else None
    dummy = part_h if part_h is not None else part_i
    qq = q if heads else dummy.view(1, 1, 1, -1)
    kk = k if heads else dummy.view(1, 1, 1, -1)
    qi = q_idx if idx else dummy.view(1, 1, 1, -1)
    ki = k_idx if idx else dummy.view(1, 1, -1)
    _stats_kernel[(w.max_tiles,)](
        qq, kk, qi, ki,
        w.q_index, w.q_slot, w.tile_key, w.tile_start, w.tile_count, b0, b1,
        part_h if heads else dummy, part_i if idx else dummy,
        T, NB, block_size, K,
        qq.stride(0), qq.stride(1), qq.stride(2), kk.stride(0), kk.stride(1), kk.stride(2),
        qi.stride(0), qi.stride(1), qi.stride(2), ki.stride(0), ki.stride(1),
        scale * LOG2E, iscale * LOG2E,
        G=G, HPG=hpg, HC=cfg["ST_HC"] if heads else 1, QT=cfg["QT"],
        D=D, DI=Di, BS=_np2(block_size), BD=_np2(D), BDI=_np2(Di),
        HEADS=heads, IDX=idx, VARLEN=varlen,
        PREC_QK=_prec(qq.dtype), PREC_IDX=_prec(qi.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["ST_STAGES"],
    )
    return part_h, part_i


def _geometry(q, block_idx, cu_seqlens):
    B, T, Hq, D = q.shape
    if cu_seqlens is not None:
        assert B == 1, "varlen inputs have B == 1"
    return B, T, Hq, D, block_idx.shape[1], block_idx.shape[3]


def selected_lse(q, k, block_idx, block_size: int, scale: float, *, cu_seqlens=None, config=None):
    """The Triton selected-token LSE: lse [B, Hq, T] fp32 (-inf for a row selecting nothing).

    lse[b, h, i] = log sum_{j in T_sel(r, i)} exp(scale * q_h(i) . k_r(j)), r = h // (Hq // G):
    what `sparse_attention(..., return_lse=True)` returns, without the values.  No argument
    checks (the public `msakit.ops.index_kl.selected_lse` checks and dispatches); reference
    twin: `reference.selected_lse_reference`.  One KV-outer pass writes per (query, slot, head)
    partial LSEs (fp32, B*T*Hq*topk*4 bytes), then `_merge_kernel` combines the slots.
    """
    B, T, Hq, D, G, K = _geometry(q, block_idx, cu_seqlens)
    return _merge(block_lse(q, k, block_idx, block_size, scale, cu_seqlens=cu_seqlens, config=config),
                  B, G, T, K, Hq // G)


selected_lse_triton = selected_lse


def block_lse(q, k, block_idx, block_size: int, scale: float, *, cu_seqlens=None, config=None):
    """The statistics pass alone: part [B, G, T, K, Hq // G] fp32, part[b, r, i, s, h] = log sum
    over the tokens j <= i of block block_idx[b, r, i, s] of exp(scale * q_{r*hpg+h}(i) . k_r(j))
    (-inf for a -1 slot); `selected_lse` is its log-sum-exp over the slots.  No argument checks."""
    B, T, Hq, D, G, K = _geometry(q, block_idx, cu_seqlens)
    q, k = _last_dim_contig(q.detach()), _last_dim_contig(k.detach())
    cfg = pick_config(q.device, Hq // G, config, q.dtype)
    w, NB, b0, b1, varlen = _work(block_idx, cu_seqlens, block_size, cfg["QT"] * cfg["TPP"])
    part_h, _ = _run_stats(q, k, None, None, w, NB, b0, b1, varlen, B, T, G, K, block_size, scale, 1.0, cfg,
                           heads=True, idx=False)
    return part_h


def index_kl_fwd_triton(q, k, q_idx, k_idx, block_idx, lse, cu_seqlens, block_size: int, scale: float,
                        iscale: float, compute_grad: bool, config=None):
    """(loss fp32 scalar, dloss/dq_idx, dloss/dk_idx), or empty gradients when compute_grad is
    False.  The gradients come in `grad_save_dtype` of the inputs' dtype (float32 for fp16,
    whose range would flush the 1 / (B*G*T)-scaled values, else the input dtype)."""
    B, T, Hq, D, G, K = _geometry(q, block_idx, cu_seqlens)
    Di = q_idx.shape[3]
    hpg = Hq // G
    dev = q.device
    if T * Hq >= 2**31:
        raise ValueError("index_kl_loss (triton): T * Hq must stay below 2**31")
    q, k = _last_dim_contig(q.detach()), _last_dim_contig(k.detach())
    q_idx, k_idx = _last_dim_contig(q_idx.detach()), _last_dim_contig(k_idx.detach())
    cfg = pick_config(dev, hpg, config, torch.float32 if torch.float32 in (q.dtype, q_idx.dtype) else q.dtype)
    w, NB, b0, b1, varlen = _work(block_idx, cu_seqlens, block_size, cfg["QT"] * cfg["TPP"])
    part_h, part_i = _run_stats(q, k, q_idx, k_idx, w, NB, b0, b1, varlen, B, T, G, K, block_size, scale, iscale,
                                cfg, heads=lse is None, idx=True)
    lse_idx = _merge(part_i, B, G, T, K, 1)  # [B, G, T]
    del part_i
    if lse is None:
        lse_t = _merge(part_h, B, G, T, K, hpg, token_major=True)  # [B, T, Hq]
        del part_h
    else:
        lse_t = lse.detach().to(torch.float32).transpose(1, 2).contiguous()  # [B, T, Hq]
    N = B * G * T
    kl_part = torch.zeros(w.max_tiles, device=dev, dtype=torch.float32)
    if compute_grad:
        dq = torch.zeros((B, T, G, Di), device=dev, dtype=torch.float32)
        dk = torch.zeros((B, T, Di), device=dev, dtype=torch.float32)
    else:
        dq = dk = kl_part
    _kl_kernel[(w.max_tiles,)](
        q, k, q_idx, k_idx, lse_t, lse_idx,
        w.q_index, w.tile_key, w.tile_start, w.tile_count, b0, b1,
        kl_part, dq, dk,
        T, NB, block_size,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        q_idx.stride(0), q_idx.stride(1), q_idx.stride(2), k_idx.stride(0), k_idx.stride(1),
        scale * LOG2E, iscale, iscale / N,
        G=G, HPG=hpg, HC=cfg["HC"], QT=cfg["QT"],
        D=D, DI=Di, BS=_np2(block_size), BD=_np2(D), BDI=_np2(Di),
        VARLEN=varlen, GRAD=compute_grad,
        PREC_QK=_prec(q.dtype), PREC_IDX=_prec(q_idx.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    loss = kl_part.sum() / N
    if not compute_grad:
        e = q_idx.new_empty(0)
        return loss, e, k_idx.new_empty(0)
    return loss, dq.to(grad_save_dtype(q_idx.dtype)), dk.to(grad_save_dtype(k_idx.dtype))


def grad_save_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of the gradients index_kl_fwd returns and autograd keeps until backward."""
    return torch.float32 if dtype == torch.float16 else dtype
