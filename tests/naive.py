"""Row-by-row Python re-statements of the MSA semantics, written independently of
msakit/ops/*/reference.py (loops over queries and blocks; no chunking, no gathers), so the
tests compare two implementations of docs/msa.md rather than one with itself."""

from __future__ import annotations

import math

import torch


def naive_index_topk(q_idx, k_idx, block_size, topk, local_blocks=1, init_blocks=0, positions=None):
    """positions [B][T] (default: query i at position i): query i of row b sees keys j <= positions[b][i]."""
    B, T, G, _ = q_idx.shape
    out = torch.full((B, G, T, topk), -1, dtype=torch.int32)
    for b in range(B):
        for r in range(G):
            for t in range(T):
                i = t if positions is None else int(positions[b][t])
                own = i // block_size
                forced = [x for x in range(own - local_blocks + 1, own + 1) if x >= 0]
                forced += [x for x in range(init_blocks) if x <= own and x not in forced]
                scores = []
                for blk in range(own + 1):
                    if blk in forced:
                        continue
                    js = range(blk * block_size, min(i, blk * block_size + block_size - 1) + 1)
                    m = max(float(q_idx[b, t, r].double() @ k_idx[b, j].double()) for j in js)
                    scores.append((-m, blk))
                rest = [blk for _, blk in sorted(scores)]
                row = (sorted(forced) + rest)[:topk]
                out[b, r, t, : len(row)] = torch.tensor(row, dtype=torch.int32)
    return out


def selected_token_set(block_idx_row, i, block_size):
    toks = set()
    for blk in set(int(x) for x in block_idx_row if int(x) >= 0):
        toks.update(j for j in range(blk * block_size, blk * block_size + block_size) if j <= i)
    return sorted(toks)


def naive_sparse_attention(q, k, v, block_idx, block_size, scale=None):
    B, T, Hq, D = q.shape
    G = k.shape[2]
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    o = torch.zeros(B, T, Hq, D, dtype=torch.float64)
    lse = torch.full((B, Hq, T), float("-inf"), dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            r = h // (Hq // G)
            for i in range(T):
                js = selected_token_set(block_idx[b, r, i], i, block_size)
                if not js:
                    continue
                s = torch.stack([q[b, i, h].double() @ k[b, j, r].double() * scale for j in js])
                p = torch.softmax(s, 0)
                o[b, i, h] = sum(p[n] * v[b, j, r].double() for n, j in enumerate(js))
                lse[b, h, i] = torch.logsumexp(s, 0)
    return o, lse


def naive_index_kl(q, k, q_idx, k_idx, block_idx, block_size, scale=None, iscale=None):
    B, T, Hq, D = q.shape
    G, Di = k.shape[2], q_idx.shape[-1]
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    iscale = iscale if iscale is not None else 1.0 / math.sqrt(Di)
    total = 0.0
    for b in range(B):
        for r in range(G):
            heads = range(r * (Hq // G), (r + 1) * (Hq // G))
            for i in range(T):
                js = selected_token_set(block_idx[b, r, i], i, block_size)
                if not js:
                    continue
                P = torch.stack(
                    [torch.softmax(torch.stack([q[b, i, h].double() @ k[b, j, r].double() * scale for j in js]), 0) for h in heads]
                ).mean(0)
                z = torch.stack([q_idx[b, i, r].double() @ k_idx[b, j].double() * iscale for j in js])
                logq = torch.log_softmax(z, 0)
                total += float((P * (P.log() - logq)).sum())
    return total / (B * G * T)


def naive_routed_experts(x, idx, w, w1, w3, w2, alpha=1.702, limit=7.0):
    """y[n] = sum_j w[n, j] * down(swiglu_oai(gate(x[n]), up(x[n]))) of expert idx[n, j], in float64, one row at a time."""
    N, k = idx.shape
    y = torch.zeros(N, w2.shape[1], dtype=torch.float64)
    for n in range(N):
        xn = x[n].double()
        for j in range(k):
            e = int(idx[n, j])
            g = (w1[e].double() @ xn).clamp(max=limit)
            u = (w3[e].double() @ xn).clamp(min=-limit, max=limit)
            h = g * torch.sigmoid(alpha * g) * (u + 1.0)
            y[n] += float(w[n, j]) * (w2[e].double() @ h)
    return y


def naive_packed_weight(weight, scales, global_scale, fmt):
    """A packed NVFP4 / MXFP8 weight [G, N, ...] -> float64 [G, N, K], one code at a time from
    the format definitions (E2M1 = (-1)^s 2^(e-1) (1 + m/2), 0.5 m for e = 0; E8M0 = 2^(b - 127))."""
    G, N = weight.shape[:2]
    if fmt == "nvfp4":
        K = weight.shape[2] * 2
        out = torch.zeros(G, N, K, dtype=torch.float64)
        for g in range(G):
            for n in range(N):
                for k in range(K):
                    c = (int(weight[g, n, k // 2]) >> (4 * (k % 2))) & 15
                    e, m = (c >> 1) & 3, c & 1
                    mag = 0.5 * m if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
                    v = (-mag if c & 8 else mag) * float(scales[g, n, k // 16].float())
                    out[g, n, k] = float(torch.tensor(v, dtype=torch.float32) * global_scale[g].float())
        return out
    K = weight.shape[2]
    sc = 2.0 ** (scales.double() - 127)
    return weight.double() * sc.repeat_interleave(32, dim=-1)
