"""Chunked `index_kl_loss` on matmuls: the fast path for CPU (and any device without Triton).

The queries are cut into chunks; inside a chunk the (query, selected block) pairs are grouped by
key block into pieces (`..sparse_attention.chunked.block_pieces`), so every score is a dense
matmul over one key block.  Two passes per chunk, never a [T, T] tensor:

1. statistics: per head the log-sum-exp of the main scores over the row's selected tokens (or
   the given `lse`), and the log-sum-exp of the index scores;
2. per piece, P = mean over the group's heads of exp(s - lse) (a constant) and
   log P_idx = z - lse_idx; the KL terms are summed, and the gradients of the loss with respect
   to the index scores, dz = (P_idx - P) * index_softmax_scale / (B * G * T), go straight to
   dq_idx (by rows) and dk_idx (by block).

The loss and both gradients come out of the forward; the backward scales them by the incoming
gradient (the same contract as the Triton path).  With over="all" the selection is every token
j <= i (the dense causal distribution), whatever block_idx holds: that case has no pieces, only
query-row chunks of dense [heads, C, keys] matmuls against the causal prefix (`_kl_all_sum`),
a few large launches per chunk instead of one per key block.
"""

from __future__ import annotations


import torch

from ..sparse_attention.chunked import block_pieces, chunk_rows_for, compute_dtype, default_cap, extend_rows, key_blocks

__all__ = ["index_kl_loss_chunked"]

_NEG = -1e30  # finite "minus infinity" for the index scores: 0 * _NEG stays 0


def _row_max(x: torch.Tensor, at: torch.Tensor, nf: int, K: int) -> torch.Tensor:
    """Per-slot maxima [N, cap, H] -> per-row max over the row's K pairs, [rows + 1, H] (0 on
    rows with no pair and on the padding's extra row)."""
    H = x.shape[-1]
    m_f = torch.full((nf, H), float("-inf"), dtype=x.dtype, device=x.device).index_copy_(0, at, x.reshape(-1, H))
    mx = m_f[:-1].view(-1, K, H).amax(dim=1)
    return torch.cat([torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx)), mx.new_zeros(1, H)])


def _row_sum(x: torch.Tensor, at: torch.Tensor, nf: int, K: int) -> torch.Tensor:
    """Per-slot values [N, cap, F] -> per-row sums over the row's K pairs, [rows + 1, F] (1 on the padding's row)."""
    F = x.shape[-1]
    f = torch.zeros(nf, F, dtype=x.dtype, device=x.device).index_copy_(0, at, x.reshape(-1, F))
    return torch.cat([f[:-1].view(-1, K, F).sum(dim=1), x.new_ones(1, F)])


def _kl_sum(q, k, q_idx, k_idx, block_idx, lse, block_size, scale, iscale, chunk, coeff, want_grad):
    """Sum over (b, r, i) of the KL on one document; with want_grad also coeff * dL/dq_idx, dL/dk_idx."""
    B, T, Hq, D = q.shape
    G, Di = k.shape[2], q_idx.shape[-1]
    hpg = Hq // G
    cdt = compute_dtype(q_idx)
    cap0 = default_cap(hpg)
    kb_all = key_blocks(k, block_size, cdt)  # [B * G * nblk, bs, D]
    kib_all = key_blocks(k_idx.unsqueeze(2), block_size, cdt)  # [B * nblk, bs, Di]
    nblk = kib_all.shape[0] // B
    qx = extend_rows(q.reshape(B, T, G, hpg * D), cdt)
    qix = extend_rows(q_idx, cdt)
    lsex = None
    if lse is not None:  # the given main-branch lse [B, Hq, T]; padding rows read 0
        lt = lse.transpose(1, 2).to(cdt)
        lsex = extend_rows(torch.where(torch.isfinite(lt), lt, torch.zeros_like(lt)).reshape(B, T, G, hpg), cdt)
    total = torch.zeros((), dtype=cdt, device=q.device)
    dq_idx = torch.zeros(B, T, G, Di, dtype=cdt, device=q.device) if want_grad else None
    dkib = torch.zeros_like(kib_all) if want_grad else None
    for i0 in range(0, T, chunk):
        C = min(chunk, T - i0)
        bic = None if block_idx is None else block_idx[:, :, i0:i0 + C]
        pc = block_pieces(bic, i0, C, B, G, T, block_size, cap0, q.device)
        N, cap = pc.row.shape
        if N == 0:
            continue
        K = pc.shape[3]
        nf = B * G * C * K + 1  # pair slots + the dummy slot that padding writes to
        at = pc.pair.view(-1)
        row = at // K  # the slot's row in [B, G, C] (+ 1 extra row for the padding)
        fr = pc.flat_rows(T, G).view(-1)
        ikey = pc.b * nblk + pc.blk
        kib = kib_all.index_select(0, ikey)
        qin = qix.index_select(0, fr).view(N, cap, Di)
        s = torch.bmm(qx.index_select(0, fr).view(N, cap * hpg, D), kb_all.index_select(0, pc.key).transpose(1, 2))
        s = s.view(N, cap, hpg, block_size).mul_(scale)
        z = torch.bmm(qin, kib.transpose(1, 2)).mul_(iscale)  # [N, cap, bs]
        if pc.n_plain < N:
            diag = pc.diag_mask(block_size, T)  # [N - n_plain, cap, bs]
            s[pc.n_plain:].masked_fill_(~diag.unsqueeze(2), float("-inf"))
            z[pc.n_plain:].masked_fill_(~diag, _NEG)
        valid = (pc.row < T).to(cdt).unsqueeze(-1)  # [N, cap, 1]
        # P: per head exp(s - row max) / row sum (or exp(s - lse) with the given lse), mean over heads
        if lsex is None:
            mx = _row_max(s.amax(dim=-1), at, nf, K)
            e = s.sub_(mx.index_select(0, row).view(N, cap, hpg, 1)).exp_()
            den = _row_sum(e.sum(dim=-1), at, nf, K)  # >= 1 on rows with a token
            P = e.div_(den.index_select(0, row).view(N, cap, hpg, 1)).mean(dim=2)
        else:
            P = s.sub_(lsex.index_select(0, fr).view(N, cap, hpg, 1)).exp_().mean(dim=2)
        P = P.mul_(valid)  # [N, cap, bs]; 0 off the selection and on padding
        # log P_idx = z - row max - log(row sum of exp)
        mz = _row_max(z.amax(dim=-1, keepdim=True), at, nf, K)
        z = z.sub_(mz.index_select(0, row).view(N, cap, 1))
        ez = torch.exp(z)
        dz_ = _row_sum(ez.sum(dim=-1, keepdim=True), at, nf, K).index_select(0, row).view(N, cap, 1)
        logq = z.sub_(torch.log(dz_))  # finite (_NEG where masked)
        total = total + (torch.xlogy(P, P) - P * logq).sum()
        if want_grad:
            dz = ez.div_(dz_).mul_(valid).sub_(P).mul_(iscale * coeff)  # (P_idx - P) * iscale * coeff
            # dq_idx: one row per (query, block) pair, then the sum over the row's K pairs
            dq_f = torch.zeros(nf, Di, dtype=cdt, device=q.device).index_copy_(0, at, torch.bmm(dz, kib).view(N * cap, Di))
            dq_idx[:, i0:i0 + C] = dq_f[:-1].view(B, G, C, K, Di).sum(dim=3).transpose(1, 2)
            dkib.index_add_(0, ikey, torch.bmm(dz.transpose(1, 2), qin))
    if not want_grad:
        return total, None, None
    dk_idx = dkib.view(B, nblk * block_size, Di)[:, :T]
    return total, dq_idx, dk_idx


def _kl_all_sum(q, k, q_idx, k_idx, scale, iscale, chunk, coeff, want_grad):
    """`_kl_sum` with every token j <= i selected (over="all"), on one document: per chunk of C
    query rows, the main scores [B, Hq, C, i0 + C] and the index scores [B, G, C, i0 + C] against
    the causal prefix, both as dense batched matmuls."""
    B, T, Hq, D = q.shape
    G, Di = k.shape[2], q_idx.shape[-1]
    hpg = Hq // G
    cdt = compute_dtype(q_idx)
    qg = q.to(cdt).view(B, T, G, hpg, D).permute(0, 2, 3, 1, 4)  # [B, G, hpg, T, D]
    kg = k.to(cdt).permute(0, 2, 1, 3)  # [B, G, T, D]
    qi = q_idx.to(cdt).transpose(1, 2)  # [B, G, T, Di]
    ki = k_idx.to(cdt)  # [B, T, Di]
    total = torch.zeros((), dtype=cdt, device=q.device)
    dq_idx = torch.zeros(B, G, T, Di, dtype=cdt, device=q.device) if want_grad else None
    dk_idx = torch.zeros(B, T, Di, dtype=cdt, device=q.device) if want_grad else None
    for i0 in range(0, T, chunk):
        C = min(chunk, T - i0)
        L = i0 + C  # keys 0 .. L - 1 (the causal prefix of the chunk's last row)
        causal = torch.arange(L, device=q.device)[None, :] <= torch.arange(i0, L, device=q.device)[:, None]  # [C, L]
        s = torch.matmul(qg[:, :, :, i0:L], kg[:, :, None, :L].transpose(-1, -2)).mul_(scale)  # [B, G, hpg, C, L]
        P = torch.softmax(s.masked_fill_(~causal, float("-inf")), dim=-1).mean(dim=2)  # [B, G, C, L]
        z = torch.matmul(qi[:, :, i0:L], ki[:, None, :L].transpose(-1, -2)).mul_(iscale)  # [B, G, C, L]
        logq = torch.log_softmax(z.masked_fill_(~causal, _NEG), dim=-1)  # finite: P is 0 where masked
        total = total + (torch.xlogy(P, P) - P * logq).sum()
        if want_grad:
            dz = logq.exp_().sub_(P).mul_(iscale * coeff)  # (P_idx - P) * iscale * coeff, 0 where masked
            dq_idx[:, :, i0:L] = torch.matmul(dz, ki[:, None, :L])
            dk_idx[:, :L] += torch.matmul(dz.transpose(-1, -2), qi[:, :, i0:L]).sum(dim=1)
    if not want_grad:
        return total, None, None
    return total, dq_idx.transpose(1, 2), dk_idx


class _ChunkedIndexKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_idx, k_idx, value, dq_idx, dk_idx):
        ctx.save_for_backward(dq_idx, dk_idx)
        ctx.dtypes = (q_idx.dtype, k_idx.dtype)
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        dq, dk = ctx.saved_tensors
        g = grad.to(dq.dtype)
        return (g * dq).to(ctx.dtypes[0]), (g * dk).to(ctx.dtypes[1]), None, None, None


def index_kl_loss_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    block_idx: torch.Tensor | None,
    block_size: int,
    scale: float,
    iscale: float,
    *,
    lse: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    over: str = "selected",
    chunk: int | None = None,
) -> torch.Tensor:
    """Mean over (b, r, i) of KL(P || P_idx); layouts and meaning as `index_kl_loss_reference`.

    q [B, T, Hq, D], k [B, T, G, D] (constants), q_idx [B, T, G, Di], k_idx [B, T, Di] (receive
    gradients), block_idx int [B, G, T, topk] (ignored, may be None, with over="all").  scale,
    iscale: softmax_scale and index_softmax_scale (resolved by the public op: no defaults here).
    lse: optional [B, Hq, T], the main branch's log-sum-exp over the same tokens (skips its
    statistics pass; it must match the selection).  cu_seqlens: int [ndocs + 1] for documents
    packed along T (B = 1, block ids relative to each document's start).  over: "selected" (the
    tokens j <= i of the selected blocks) or "all" (every token j <= i).  chunk: query rows per
    chunk.  Returns a scalar in float32 (float64 for float64 q_idx).  Arguments are not
    validated here (the public op does it).
    """
    if over not in ("selected", "all"):
        raise ValueError(f"over must be 'selected' or 'all', got {over!r}")
    B, T, Hq, _ = q.shape
    G = k.shape[2]
    scale, iscale = float(scale), float(iscale)
    want_grad = torch.is_grad_enabled() and (q_idx.requires_grad or k_idx.requires_grad)
    q, k = q.detach(), k.detach()
    if cu_seqlens is None:
        spans = [(0, T)]
    else:
        bounds = [int(x) for x in cu_seqlens.tolist()]
        spans = [(s, e) for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
    coeff = 1.0 / (B * G * T)
    cdt = compute_dtype(q_idx)
    total = torch.zeros((), dtype=cdt, device=q.device)
    dq_idx = torch.zeros(q_idx.shape, dtype=cdt, device=q.device) if want_grad else None
    dk_idx = torch.zeros(k_idx.shape, dtype=cdt, device=q.device) if want_grad else None
    with torch.no_grad(), torch.autocast(q.device.type, enabled=False):  # matmuls in the compute dtype
        for s, e in spans:
            bi = None if over == "all" else block_idx[:, :, s:e]
            ls = None if lse is None or over == "all" else lse[:, :, s:e]
            args = (q[:, s:e], k[:, s:e], q_idx[:, s:e].detach(), k_idx[:, s:e].detach())
            if bi is None:  # every token j <= i: dense row chunks ([B, Hq + 3 G, C, keys] floats each)
                n = chunk or chunk_rows_for(e - s, B * (Hq + 3 * G) * (e - s) * 4, q.device)
                part, dq, dk = _kl_all_sum(*args, scale, iscale, int(n), coeff, want_grad)
            else:
                K = bi.shape[-1]
                n = chunk or chunk_rows_for(e - s, B * G * K * (2 * Hq // G + 4) * block_size * 4, q.device)
                part, dq, dk = _kl_sum(*args, bi, ls, int(block_size), scale, iscale, int(n), coeff, want_grad)
            total = total + part
            if want_grad:
                dq_idx[:, s:e] = dq
                dk_idx[:, s:e] = dk
    loss = total * coeff
    if not want_grad:
        return loss
    return _ChunkedIndexKL.apply(q_idx, k_idx, loss, dq_idx, dk_idx)
