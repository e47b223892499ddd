"""Chunked `sparse_attention` on matmuls: the fast path for CPU (and any device without Triton).

The queries are cut into chunks of C rows.  Inside a chunk, the (query, selected block) pairs
are grouped by key block into pieces of up to `cap` pairs (`block_pieces`): one piece is one
key block of one (batch, group) and the rows that select it, so scores and the weighted sum of
values are batched matmuls [cap * Hq/G, D] x [D, block_size], and the work is proportional to
the selected tokens whatever the selection looks like (no [T, T] tensor, no gather of K *
block_size keys per query).  Each pair's partial sums share its row's maximum score, so the K
pairs of a query merge by plain sums (split-K).  The backward (a custom autograd function)
recomputes each piece's probabilities from the saved lse and accumulates dq by pairs, dk and dv
by block, so memory stays bounded by one chunk's pairs in both directions.

Same meaning as `reference.py` (docs/msa.md): selection ids form a set, -1 and blocks after the
query's own block add nothing, a row with no token has o = 0 and lse = -inf.  The softmax and
the matmuls run in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["sparse_attention_chunked", "block_pieces", "BlockPieces", "key_blocks", "unkey_blocks", "extend_rows",
           "chunk_rows_for", "compute_dtype", "default_cap"]

# Bytes of one chunk's scores and per-pair buffers; bounds the memory of a call beyond its inputs and outputs.
CHUNK_BYTES = 1 << 26
CUDA_CHUNK_BYTES = 1 << 30


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 stays float64 (gradcheck); everything else computes in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def chunk_rows_for(T: int, pair_bytes_per_row: int, device: torch.device | None = None) -> int:
    """Query rows per chunk so that a chunk's pair buffers stay within CHUNK_BYTES (CPU), or
    CUDA_CHUNK_BYTES on a GPU, where the number of launches rather than the cache sets the cost."""
    budget = CUDA_CHUNK_BYTES if device is not None and device.type == "cuda" else CHUNK_BYTES
    return max(1, min(T, budget // max(1, pair_bytes_per_row)))


@dataclass
class BlockPieces:
    """The valid (query, block) pairs of one query chunk, grouped by key block into pieces.

    A piece is up to `cap` pairs that select the same key block of the same (batch, group).
    Pieces [0, n_plain) hold blocks before each slot's own block (every token visible, no mask);
    pieces [n_plain, N) hold own blocks (causal inside the block, maybe partial).
    key: long [N], (b * G + g) * nblk + blk; b, g, blk: long [N]; row: long [N, cap], the query
    position of each slot (padding = T, an appended zero row); pair: long [N, cap], the slot's
    flat position in [B, G, C, K] (padding = B * G * C * K, a dummy slot); shape = (B, G, C, K).
    """

    key: torch.Tensor
    b: torch.Tensor
    g: torch.Tensor
    blk: torch.Tensor
    row: torch.Tensor
    pair: torch.Tensor
    n_plain: int
    shape: tuple[int, int, int, int]

    def flat_rows(self, T: int, G: int) -> torch.Tensor:
        """long [N, cap]: (b * (T + 1) + row) * G + g, the slot's row in `extend_rows(x).view(-1, F)`."""
        return (self.b.view(-1, 1) * (T + 1) + self.row) * G + self.g.view(-1, 1)

    def valid(self, T: int) -> torch.Tensor:
        return self.row < T

    def diag_mask(self, block_size: int, T: int) -> torch.Tensor:
        """bool [N - n_plain, cap, block_size] for the own-block pieces: token exists and j <= i."""
        blk, row = self.blk[self.n_plain:], self.row[self.n_plain:]
        cols = blk.view(-1, 1, 1) * block_size + torch.arange(block_size, device=row.device)
        return (cols <= row.unsqueeze(-1)) & (cols < T) & (row < T).unsqueeze(-1)


def block_pieces(block_idx_chunk: torch.Tensor | None, i0: int, C: int, B: int, G: int, T: int,
                 block_size: int, cap: int, device: torch.device) -> BlockPieces:
    """Group the selection of rows i0 .. i0 + C - 1 by key block, in pieces of at most `cap` rows.

    block_idx_chunk: int [B, G, C, K] (ids of selected blocks, -1 = none; a set), or None for
    every block at or before each row's own block (the dense causal selection).  A pair is
    valid when its block id is >= 0, not a repeat within the row, and at or before the row's
    own block (a later block holds no token j <= i).
    """
    rows = torch.arange(i0, i0 + C, device=device).view(1, 1, C, 1)
    own = rows // block_size
    if block_idx_chunk is None:
        nb = (i0 + C - 1) // block_size + 1
        ids = torch.arange(nb, device=device).view(1, 1, 1, nb).expand(B, G, C, nb)
        ok = ids <= own
    else:
        ids = block_idx_chunk.long().sort(dim=-1).values
        ok = (ids >= 0) & (ids <= own)
        ok[..., 1:] &= ids[..., 1:] != ids[..., :-1]
    K = ids.shape[-1]
    nblk = (T + block_size - 1) // block_size
    nseg = B * G * nblk
    # segment key; own-block segments sort after all others
    seg = torch.arange(B * G, device=device).view(B, G, 1, 1) * nblk + ids.clamp_min(0) + (ids == own) * nseg
    pair = ok.reshape(-1).nonzero().squeeze(1)
    key, order = torch.sort(seg.reshape(-1)[pair], stable=True)
    pair = pair[order]
    uniq, inverse, counts = torch.unique_consecutive(key, return_inverse=True, return_counts=True)
    cap = max(1, min(cap, int(counts.max()) if counts.numel() else 1))  # no piece wider than the largest segment
    # rank of each pair inside its segment, then its piece and slot
    seg_start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(pair.numel(), device=device) - seg_start[inverse]
    npieces = (counts + cap - 1) // cap
    piece0 = torch.cumsum(npieces, 0) - npieces
    piece = piece0[inverse] + rank // cap
    slot = rank % cap
    N, n_plain = (int(x) for x in torch.stack([npieces.sum(), npieces[uniq < nseg].sum()]).tolist())
    row_t = torch.full((N, cap), T, dtype=torch.long, device=device)
    pair_t = torch.full((N, cap), B * G * C * K, dtype=torch.long, device=device)
    row_t[piece, slot] = i0 + (pair // K) % C
    pair_t[piece, slot] = pair
    pkey = torch.repeat_interleave(uniq % nseg, npieces, output_size=N)
    bg, blk = pkey // nblk, pkey % nblk
    return BlockPieces(pkey, bg // G, bg % G, blk, row_t, pair_t, n_plain, (B, G, C, K))


def default_cap(hpg: int) -> int:
    """Slots per piece: about 256 query-head rows per matmul."""
    return max(8, -(-256 // hpg))


def key_blocks(x: torch.Tensor, block_size: int, cdt: torch.dtype) -> torch.Tensor:
    """x [B, T, G, D] -> [B * G * nblk, block_size, D] in cdt, zero-padded past T (block key (b*G + g)*nblk + blk)."""
    B, T, G, D = x.shape
    pad = (-T) % block_size
    x = x.to(cdt)
    if pad:
        x = torch.cat([x, x.new_zeros(B, pad, G, D)], dim=1)
    nblk = x.shape[1] // block_size
    return x.view(B, nblk, block_size, G, D).permute(0, 3, 1, 2, 4).reshape(B * G * nblk, block_size, D)


def unkey_blocks(xb: torch.Tensor, B: int, T: int, G: int) -> torch.Tensor:
    """Inverse of key_blocks: [B * G * nblk, block_size, D] -> [B, T, G, D]."""
    _, bs, D = xb.shape
    nblk = xb.shape[0] // (B * G)
    return xb.view(B, G, nblk, bs, D).permute(0, 2, 3, 1, 4).reshape(B, nblk * bs, G, D)[:, :T]


def extend_rows(x: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    """x [B, T, G, F] -> [B * (T + 1) * G, F] in cdt with a zero row T per batch (the pieces' padding)."""
    B, T, G, F = x.shape
    out = x.new_zeros((B, T + 1, G, F), dtype=cdt)
    out[:, :T] = x
    return out.view(B * (T + 1) * G, F)


def _scores(qn, kb, pc, hpg, block_size, T, scale):
    """Scaled scores [N, cap, hpg, bs] of the pieces, -inf where an own block's token is after the row."""
    N, cap = pc.row.shape
    s = torch.bmm(qn.view(N, cap * hpg, kb.shape[-1]), kb.transpose(1, 2)).view(N, cap, hpg, block_size)  # N may be 0
    s.mul_(scale)
    if pc.n_plain < N:
        s[pc.n_plain:].masked_fill_(~pc.diag_mask(block_size, T).unsqueeze(2), float("-inf"))
    return s


def _operands(q, k, v, block_size):
    """What the forward and the backward share: the sizes, the compute dtype, the default piece
    capacity, k and v as key blocks and q's rows extended by the padding row."""
    B, T, Hq, D = q.shape
    G = k.shape[2]
    hpg = Hq // G
    cdt = compute_dtype(q)
    kb_all, vb_all = key_blocks(k, block_size, cdt), key_blocks(v, block_size, cdt)
    qx = extend_rows(q.reshape(B, T, G, hpg * D), cdt)
    return B, T, Hq, D, G, hpg, cdt, default_cap(hpg), kb_all, vb_all, qx


def _forward(q, k, v, block_idx, block_size, scale, chunk):
    B, T, Hq, D, G, hpg, cdt, cap0, kb_all, vb_all, qx = _operands(q, k, v, block_size)
    o = torch.empty(B, T, Hq, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, T, G, hpg, dtype=cdt, device=q.device)
    for i0 in range(0, T, chunk):
        C = min(chunk, T - i0)
        pc = block_pieces(block_idx[:, :, i0:i0 + C], i0, C, B, G, T, block_size, cap0, q.device)
        N, cap = pc.row.shape
        s = _scores(qx.index_select(0, pc.flat_rows(T, G).view(-1)), kb_all.index_select(0, pc.key), pc, hpg,
                    block_size, T, scale)
        # the row max over all the row's pairs first (small buffers), so every pair of a row
        # exponentiates with the same shift and the K partial sums simply add
        K = pc.shape[3]
        nf = B * G * C * K + 1  # + the dummy slot that padding writes to
        at = pc.pair.view(-1)
        m_f = torch.full((nf, hpg), float("-inf"), dtype=cdt, device=q.device).index_copy_(0, at, s.amax(dim=-1).view(-1, hpg))
        mx = m_f[:-1].view(B * G * C, K, hpg).amax(dim=1)
        mx = torch.cat([torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx)), mx.new_zeros(1, hpg)])  # + padding's row
        p = s.sub_(mx.index_select(0, at // K).view(N, cap, hpg, 1)).exp_()  # <= 1; 0 off the selection
        l_f = torch.zeros(nf, hpg, dtype=cdt, device=q.device).index_copy_(0, at, p.sum(dim=-1).view(-1, hpg))
        o_p = torch.bmm(p.view(N, cap * hpg, block_size), vb_all.index_select(0, pc.key))
        o_f = torch.zeros(nf, hpg, D, dtype=cdt, device=q.device).index_copy_(0, at, o_p.view(-1, hpg, D))
        den = l_f[:-1].view(B, G, C, K, hpg).sum(dim=3)  # >= 1 on a row with a token (its max term is 1)
        oc = o_f[:-1].view(B, G, C, K, hpg, D).sum(dim=3) / den.clamp_min(1.0).unsqueeze(-1)
        mx = mx[:-1].view(B, G, C, 1, hpg)
        o[:, i0:i0 + C] = oc.permute(0, 2, 1, 3, 4).reshape(B, C, Hq, D).to(q.dtype)
        lse[:, i0:i0 + C] = (mx.squeeze(3) + torch.log(den)).permute(0, 2, 1, 3)
    return o, lse.view(B, T, Hq).transpose(1, 2).contiguous()


def _backward(do, dlse, q, k, v, o, lse, block_idx, block_size, scale, chunk):
    B, T, Hq, D, G, hpg, cdt, cap0, kb_all, vb_all, qx = _operands(q, k, v, block_size)
    dkb, dvb = torch.zeros_like(kb_all), torch.zeros_like(vb_all)
    dox = extend_rows(do.reshape(B, T, G, hpg * D), cdt)
    dq = torch.empty(B, T, G, hpg * D, dtype=cdt, device=q.device)
    # delta_i = sum_d do * o (the softmax backward's row term); the lse gradient enters as -dlse
    lse_t = lse.transpose(1, 2).to(cdt)  # [B, T, Hq]
    lse_t = torch.where(torch.isfinite(lse_t), lse_t, torch.zeros_like(lse_t))
    delta = (do.to(cdt) * o.to(cdt)).sum(-1)
    if dlse is not None:
        delta = delta - dlse.transpose(1, 2).to(cdt)
    # padding rows read do = 0 and delta = 0, so their ds = p * (0 - 0) = 0
    stats = extend_rows(torch.stack([lse_t, delta], dim=-1).reshape(B, T, G, hpg * 2), cdt)
    for i0 in range(0, T, chunk):
        C = min(chunk, T - i0)
        pc = block_pieces(block_idx[:, :, i0:i0 + C], i0, C, B, G, T, block_size, cap0, q.device)
        N, cap = pc.row.shape
        fr = pc.flat_rows(T, G).view(-1)
        kb, vb = kb_all.index_select(0, pc.key), vb_all.index_select(0, pc.key)
        qn = qx.index_select(0, fr).view(N, cap * hpg, D)
        don = dox.index_select(0, fr).view(N, cap * hpg, D)
        st = stats.index_select(0, fr).view(N, cap, hpg, 2, 1)
        s = _scores(qn, kb, pc, hpg, block_size, T, scale)
        p = s.sub_(st[..., 0, :]).exp_()  # [N, cap, hpg, bs]; 0 off the selection
        pf = p.view(N, cap * hpg, block_size)
        dvb.index_add_(0, pc.key, torch.bmm(pf.transpose(1, 2), don))
        dp = torch.bmm(don, vb.transpose(1, 2)).view(N, cap, hpg, block_size)
        ds = dp.sub_(st[..., 1, :]).mul_(p).mul_(scale).view(N, cap * hpg, block_size)
        dkb.index_add_(0, pc.key, torch.bmm(ds.transpose(1, 2), qn))
        # dq: one row per (query, block) pair, then the sum over the row's K pairs
        K = pc.shape[3]
        dq_f = torch.zeros(B * G * C * K + 1, hpg * D, dtype=cdt, device=q.device)
        dq_f.index_copy_(0, pc.pair.view(-1), torch.bmm(ds, kb).view(N * cap, hpg * D))
        dq[:, i0:i0 + C] = dq_f[:-1].view(B, G, C, K, hpg * D).sum(dim=3).transpose(1, 2)
    dq = dq.view(B, T, Hq, D)
    dk, dv = unkey_blocks(dkb, B, T, G), unkey_blocks(dvb, B, T, G)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _ChunkedSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, block_idx, block_size, scale, chunk):
        with torch.autocast(q.device.type, enabled=False):  # the matmuls run in the compute dtype
            o, lse = _forward(q, k, v, block_idx, block_size, scale, chunk)
        ctx.save_for_backward(q, k, v, o, lse, block_idx)
        ctx.args = (block_size, scale, chunk)
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse, block_idx = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(o)
        with torch.autocast(q.device.type, enabled=False):
            dq, dk, dv = _backward(do, dlse, q, k, v, o, lse, block_idx, *ctx.args)
        return dq, dk, dv, None, None, None, None


def sparse_attention_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_idx: torch.Tensor,
    block_size: int,
    scale: float,
    *,
    cu_seqlens: torch.Tensor | None = None,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sparse_attention` by key-block segments -> (o, lse), as the kernel's forward returns them;
    meaning as `sparse_attention_reference`.

    q [B, T, Hq, D]; k, v [B, T, G, D]; block_idx int [B, G, T, topk].  Returns o [B, T, Hq, D]
    in q's dtype and lse [B, Hq, T] float32.  scale: the softmax scale (resolved by the public
    op: no default here).  cu_seqlens: int [ndocs + 1] for documents packed along T (B = 1,
    block ids relative to each document's start); each document is computed on its own slice.
    chunk: query rows per chunk (default: pair buffers within CHUNK_BYTES).  Differentiable in
    q, k, v and through lse.  Arguments are not validated here (the public op does it).
    """
    B, _, Hq, D = q.shape
    K = block_idx.shape[-1]
    scale = float(scale)
    if cu_seqlens is None:
        spans = [(0, q.shape[1])]
    else:
        bounds = [int(x) for x in cu_seqlens.tolist()]
        spans = [(s, e) for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
    outs, lses = [], []
    for s, e in spans:
        if (s, e) == (0, q.shape[1]):
            qs, ks, vs, bis = q, k, v, block_idx
        else:
            qs, ks, vs, bis = q[:, s:e], k[:, s:e], v[:, s:e], block_idx[:, :, s:e]
        n = chunk or chunk_rows_for(e - s, B * K * Hq * (D + block_size + 3) * 4, q.device)
        o, lse = _ChunkedSparseAttention.apply(qs, ks, vs, bis, int(block_size), scale, int(n))
        outs.append(o)
        lses.append(lse)
    o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    lse = lses[0] if len(lses) == 1 else torch.cat(lses, dim=2)
    return o, lse.float()  # float32, as the reference returns it
