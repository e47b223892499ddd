"""Block selections for the prefill benchmark, in the layout of `msakit.ops.index_topk`.

A trained indexer does not spread its choices uniformly: every query takes its own block, a few
local blocks and block 0, and then long-range "stripes" that all later queries share.  Popular
blocks are then chosen by every query past them.  `trained_like_block_idx` builds that pattern
directly; `dump_block_idx` records the selections a model's indexer makes (run as a script, it
writes them from a trained checkpoint), and `load_block_idx` reads such a file back.

    python benchmarks/selections.py --model runs/train/final --context 131072 --layer 3 --out sel.pt

Layout (docs/msa.md): int32 [B, G, T, topk]; row (b, r, i) holds distinct block ids <= the
query's own block i // block_size, valid ids first (ascending here), -1 padding only when the row
has fewer than topk valid blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch


def stripe_ids(nblocks: int, groups: int, stripes: int, seed: int = 0) -> torch.Tensor:
    """int64 [groups, min(stripes, nblocks - 1)]: per group, distinct random block ids in
    [1, nblocks), ascending (block 0 is forced anyway).  Deterministic in `seed` (CPU generator)."""
    n = min(stripes, max(0, nblocks - 1))
    g = torch.Generator().manual_seed(seed)
    rows = [(torch.randperm(max(0, nblocks - 1), generator=g)[:n] + 1).sort().values for _ in range(groups)]
    return torch.stack(rows)


def trained_like_rows(nblocks: int, groups: int, topk: int = 16, *, local_blocks: int = 3,
                      stripes: int = 11, seed: int = 0, device=None) -> torch.Tensor:
    """int32 [groups, nblocks, topk]: the selection of any query whose own block is o, per group.

    In priority order: o, the `local_blocks` blocks before it, block 0; the group's stripes s < o
    (each taken by every query past it); then, while slots are left, the blocks before the local
    window from the most recent down (a trained indexer's extra choices are mostly near).  The
    first `topk` distinct valid ids, ascending, then -1 padding (rows with o + 1 < topk)."""
    if topk < 1 or nblocks < 1 or groups < 1:
        raise ValueError(f"topk, nblocks and groups must be >= 1, got {topk}, {nblocks}, {groups}")
    if local_blocks < 0 or stripes < 0:
        raise ValueError(f"local_blocks and stripes must be >= 0, got {local_blocks}, {stripes}")
    own = torch.arange(nblocks, device=device).view(nblocks, 1)  # [nb, 1]
    forced = torch.cat([own - torch.arange(local_blocks + 1, device=device).view(1, -1),
                        torch.zeros_like(own)], dim=1)  # [nb, local + 2]
    s = stripe_ids(nblocks, groups, stripes, seed).to(device)  # [G, S]
    n_fill = topk + s.shape[1]  # enough: at most S of these are stripes
    fill = own - local_blocks - 1 - torch.arange(n_fill, device=device).view(1, -1)  # [nb, n_fill]
    out = torch.empty(groups, nblocks, topk, dtype=torch.int32, device=device)
    for r in range(groups):
        st = s[r].view(1, -1).expand(nblocks, -1)
        # a filler block that is a stripe is left to the stripe (duplicates are dropped below)
        cand = torch.cat([forced, torch.where(st <= own, st, torch.full_like(st, -1)), fill], dim=1)  # [nb, L]
        valid = (cand >= 0) & (cand <= own)
        cand = torch.where(valid, cand, torch.full_like(cand, -1))
        L = cand.shape[1]
        earlier = torch.ones(L, L, dtype=torch.bool, device=device).tril(-1)  # [j, j'] = j' < j
        dup = ((cand.unsqueeze(2) == cand.unsqueeze(1)) & earlier).any(2)  # equals an earlier entry
        keep = valid & ~dup
        keep &= keep.cumsum(1) <= topk
        big = torch.iinfo(torch.int64).max
        chosen = torch.where(keep, cand, torch.full_like(cand, big)).sort(dim=1).values[:, :topk]
        out[r] = torch.where(chosen == big, torch.full_like(chosen, -1), chosen).to(torch.int32)
    return out


def trained_like_block_idx(T: int, *, block_size: int = 128, topk: int = 16, batch: int = 1, groups: int = 4,
                           local_blocks: int = 3, stripes: int = 11, seed: int = 0, device=None) -> torch.Tensor:
    """int32 [batch, groups, T, topk]: `trained_like_rows` for every query (query i takes its own
    block's row); the same stripes in every batch row."""
    if T < 1 or block_size < 1:
        raise ValueError(f"T and block_size must be >= 1, got {T}, {block_size}")
    nb = (T + block_size - 1) // block_size
    rows = trained_like_rows(nb, groups, topk, local_blocks=local_blocks, stripes=stripes, seed=seed, device=device)
    own = torch.arange(T, device=device) // block_size
    return rows[:, own].unsqueeze(0).expand(batch, groups, T, topk).contiguous()


@dataclass(frozen=True)
class RealLike:
    """Parameters of `real_like_block_idx` (defaults: the fit to msakit's trained CPU model, see
    docs/kernels.md "Selections that look real").

    A query's selection: the forced blocks (its own, the `local_blocks - 1` before it, the first
    `init_blocks`), then `topk` *slots* per (batch row, group), each holding one block that
    persists from query to query and is redrawn with probability `churn` per query (so
    neighbouring queries share most of their sets), and all of them together with probability
    `jump` per query (a query that looks elsewhere: the neighbour overlap of measured selections
    is bimodal, most pairs equal or nearly disjoint); a draw takes, with probability `p_hot`, one
    of the group's `hot_blocks` long-range blocks (random positions, weights rank^-hot_zipf;
    shared by every query past them), otherwise a block at distance d = own block - block >=
    local_blocks with P(d) ~ d^-dist_alpha (recency).  Duplicates and blocks not yet visible give
    way to the nearest earlier blocks, so every row holds min(topk, own + 1) distinct ids, as
    index_topk's do."""

    local_blocks: int = 1
    init_blocks: int = 0
    churn: float = 0.35
    jump: float = 0.6
    hot_blocks: int = 4
    hot_zipf: float = 1.0
    p_hot: float = 0.9
    dist_alpha: float = 1.2

    def __post_init__(self) -> None:
        if self.local_blocks < 1 or self.init_blocks < 0 or self.hot_blocks < 0:
            raise ValueError(f"local_blocks >= 1, init_blocks >= 0 and hot_blocks >= 0 required, got {self}")
        if not (0.0 < self.churn <= 1.0) or not (0.0 <= self.p_hot <= 1.0) or not (0.0 <= self.jump <= 1.0):
            raise ValueError(f"churn must be in (0, 1], p_hot and jump in [0, 1], got {self.churn}, {self.p_hot}, "
                             f"{self.jump}")
        if self.hot_zipf < 0 or self.dist_alpha < 0:
            raise ValueError(f"hot_zipf and dist_alpha must be >= 0, got {self.hot_zipf}, {self.dist_alpha}")


def _power_law_distance(u: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, alpha: float) -> torch.Tensor:
    """Integer distances in [lo, hi] with P(d) ~ d^-alpha (inverse CDF of the continuous law on
    [lo, hi + 1), floored); u uniform in [0, 1)."""
    lo_f, hi_f = lo.double(), hi.double() + 1.0
    if abs(alpha - 1.0) < 1e-6:
        x = lo_f * torch.exp(u.double() * torch.log(hi_f / lo_f))
    else:
        e = 1.0 - alpha
        x = (lo_f.pow(e) + u.double() * (hi_f.pow(e) - lo_f.pow(e))).pow(1.0 / e)
    return torch.minimum(x.floor().long(), hi.long()).clamp(min=0)


def _distinct_first(cand: torch.Tensor, own: torch.Tensor, topk: int) -> torch.Tensor:
    """cand int64 [R, C, L] (priority order along L) -> the first `topk` distinct ids in
    [0, own] of each row, ascending, -1 padded: int32 [R, C, topk]."""
    R, C, L = cand.shape
    big = torch.iinfo(torch.int64).max
    prio = torch.arange(L, device=cand.device)
    valid = (cand >= 0) & (cand <= own)
    key = torch.where(valid, cand * L + prio, torch.full_like(cand, big))
    skey, order = key.sort(dim=-1)
    scand = torch.where(skey == big, torch.full_like(skey, -1), skey // L)
    dup = torch.zeros_like(scand, dtype=torch.bool)
    dup[..., 1:] = (scand[..., 1:] == scand[..., :-1]) & (scand[..., 1:] >= 0)
    keep = torch.zeros_like(dup).scatter_(-1, order, (scand >= 0) & ~dup)  # back in priority order
    first = torch.where(keep, prio.expand_as(cand), torch.full_like(cand, big)).sort(dim=-1).values[..., :topk]
    ids = torch.where(first == big, torch.full_like(first, -1), cand.gather(-1, first.clamp(max=L - 1)))
    ids = torch.where(ids < 0, torch.full_like(ids, big), ids).sort(dim=-1).values
    return torch.where(ids == big, torch.full_like(ids, -1), ids).to(torch.int32)


REAL_LIKE_CHUNK = 1 << 14  # queries generated at a time (memory ~ batch x groups x topk x this)


def real_like_block_idx(T: int, *, block_size: int = 128, topk: int = 16, batch: int = 1, groups: int = 4,
                        params: RealLike | None = None, seed: int = 0, device=None) -> torch.Tensor:
    """int32 [batch, groups, T, topk]: the "real-like" selection kind (`RealLike`), deterministic
    in `seed` (random numbers from a CPU generator), generated REAL_LIKE_CHUNK queries at a time
    on `device`."""
    if T < 1 or block_size < 1 or topk < 1 or batch < 1 or groups < 1:
        raise ValueError(f"T, block_size, topk, batch and groups must be >= 1, got {T}, {block_size}, {topk}, "
                         f"{batch}, {groups}")
    p = params or RealLike()
    if topk < p.local_blocks + p.init_blocks:
        raise ValueError(f"topk={topk} must hold the forced blocks ({p.local_blocks} local + {p.init_blocks} init)")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    g = torch.Generator().manual_seed(seed)
    R, S, nb = batch * groups, topk, (T + block_size - 1) // block_size
    hot = w = None
    if p.hot_blocks:
        hot = torch.stack([torch.randperm(nb, generator=g)[:p.hot_blocks] for _ in range(R)]).to(dev)  # [R, H]
        w = torch.arange(1, hot.shape[1] + 1, dtype=torch.float64).pow(-p.hot_zipf)
    forced_off = torch.arange(p.local_blocks, device=dev)
    init = torch.arange(p.init_blocks, device=dev)
    fill_off = p.local_blocks + torch.arange(topk, device=dev)
    first_free = p.local_blocks * block_size  # the first query with a block outside its local window
    out = torch.empty(R, T, topk, dtype=torch.int32, device=dev)
    carry = torch.full((R, S), -1, dtype=torch.int64, device=dev)  # each slot's block (-1: none yet)
    for t0 in range(0, T, REAL_LIKE_CHUNK):
        C = min(T, t0 + REAL_LIKE_CHUNK) - t0
        t = torch.arange(t0, t0 + C, device=dev)
        own = (t // block_size).view(1, 1, C).expand(R, S, C)
        # redraws: at rate churn, and for every slot at the first query that has a free block
        change = (torch.rand(R, S, C, generator=g) < p.churn) | (torch.rand(R, 1, C, generator=g) < p.jump)
        change = change.to(dev) | (t == first_free).view(1, 1, C)
        u_kind = torch.rand(R, S, C, generator=g).to(dev)
        u_dist = torch.rand(R, S, C, generator=g).to(dev)
        dist = _power_law_distance(u_dist, torch.full_like(own, p.local_blocks), own.clamp(min=p.local_blocks),
                                   p.dist_alpha)
        draw = torch.where(own >= p.local_blocks, own - dist, torch.full_like(own, -1))
        if hot is not None:
            pick = torch.multinomial(w, R * S * C, replacement=True, generator=g).view(R, S * C).to(dev)
            hb = hot.gather(1, pick).view(R, S, C)
            draw = torch.where((u_kind < p.p_hot) & (hb <= own), hb, draw)
        # each query's slot holds the draw of the slot's last change up to it (or the carry)
        last = torch.where(change, torch.arange(C, device=dev).view(1, 1, C), torch.full_like(own, -1)).cummax(-1).values
        vals = torch.where(last >= 0, draw.gather(-1, last.clamp(min=0)), carry.unsqueeze(-1))
        carry = vals[..., -1]
        own_r = own[:, 0].unsqueeze(-1)  # [R, C, 1]
        parts = [own_r - forced_off.view(1, 1, -1)]
        if p.init_blocks:
            parts.append(init.view(1, 1, -1).expand(R, C, -1))
        parts += [vals.transpose(1, 2), own_r - fill_off.view(1, 1, -1)]
        out[:, t0:t0 + C] = _distinct_first(torch.cat(parts, dim=-1), own_r, topk)
    return out.view(batch, groups, T, topk)


def fit_real_like(target: dict, *, T: int, block_size: int, topk: int, groups: int, local_blocks: int = 1,
                  init_blocks: int = 0, seed: int = 0, rounds: int = 3, log=None) -> tuple[RealLike, float]:
    """RealLike parameters whose selections at this shape reproduce `target` (a
    `tools.bench.selection_stats.selection_stats` dict of a measured selection): coordinate
    search over churn, jump, p_hot, hot_blocks, hot_zipf and dist_alpha minimising
    `stats_distance`.
    Returns (parameters, distance)."""
    from tools.bench.selection_stats import selection_stats

    grid = {
        "churn": [0.003, 0.006, 0.01, 0.02, 0.035, 0.05, 0.08, 0.12, 0.2, 0.35, 0.5, 0.7, 1.0],
        "jump": [0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.85],
        "p_hot": [0.0, 0.1, 0.2, 0.35, 0.5, 0.7, 0.9],
        "hot_blocks": [0, 2, 4, 8, 16, 32, 64],
        "hot_zipf": [0.0, 0.5, 1.0, 1.5, 2.5],
        "dist_alpha": [0.0, 0.4, 0.8, 1.2, 1.6, 2.0, 3.0],
    }
    cur = RealLike(local_blocks=local_blocks, init_blocks=init_blocks)

    def score(par: RealLike) -> float:
        bi = real_like_block_idx(T, block_size=block_size, topk=topk, groups=groups, params=par, seed=seed)
        return stats_distance(selection_stats(bi, block_size), target)

    best = score(cur)
    for churn in grid["churn"][::2] + [1.0]:  # the persistence pair jointly first: coordinates alone stall
        for jump in grid["jump"][::2]:
            cand = replace(cur, churn=churn, jump=jump)
            d = score(cand)
            if d < best - 1e-9:
                cur, best = cand, d
    if log:
        log(f"fit: churn, jump -> {cur.churn}, {cur.jump} (distance {best:.4f})")
    for _ in range(rounds):
        improved = False
        for name, values in grid.items():
            for v in values:
                cand = replace(cur, **{name: v})
                d = score(cand)
                if d < best - 1e-9:
                    cur, best, improved = cand, d, True
            if log:
                log(f"fit: {name} -> {getattr(cur, name)} (distance {best:.4f})")
        if not improved:
            break
    return cur, best


def stats_distance(a: dict, b: dict) -> float:
    """How far two selection_stats dicts are apart: neighbour Jaccard (mean, p10, p50), union per
    tile over slots (log ratio, per shared tile), distance histogram and popularity histogram (L1
    of the shares), the top block's share."""
    ja, jb = a["jaccard"], b["jaccard"]
    d = 2.0 * abs(ja["mean"] - jb["mean"]) + abs(ja["p10"] - jb["p10"]) + abs(ja["p50"] - jb["p50"])
    tiles = set(a["union"]) & set(b["union"])
    for n in tiles:
        d += abs(math.log(max(a["union"][n]["over_slots"], 1e-9) / max(b["union"][n]["over_slots"], 1e-9))) / len(tiles)
    sa, sb = a["distance"]["share"], b["distance"]["share"]
    m = max(len(sa), len(sb))
    d += sum(abs(x - y) for x, y in zip(sa + [0.0] * (m - len(sa)), sb + [0.0] * (m - len(sb))))
    ha, hb = a["popularity"]["share_hist"], b["popularity"]["share_hist"]
    d += 0.5 * sum(abs(x / max(1, sum(ha)) - y / max(1, sum(hb))) for x, y in zip(ha, hb))
    d += abs(a["popularity"]["top_block_share_mean"] - b["popularity"]["top_block_share_mean"])
    return d


def load_block_idx(path: str | Path, *, B: int, G: int, T: int, topk: int, block_size: int | None = None,
                   device=None) -> torch.Tensor:
    """A dumped selection: a torch file holding an int tensor [B, G, T, topk] (or a dict with key
    "block_idx", and "block_size" checked against `block_size` when both are given), or a
    .safetensors file with tensor "block_idx".  Groups are tiled when the file holds fewer groups
    that divide G (a model with fewer KV groups); raises ValueError when the selection cannot
    serve [B, G, T, topk] at `block_size`."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        bi = load_file(str(path))["block_idx"]
    else:
        obj = torch.load(path, map_location="cpu", weights_only=True)
        bi = obj["block_idx"] if isinstance(obj, dict) else obj
        saved_bs = obj.get("block_size") if isinstance(obj, dict) else None
        if block_size is not None and saved_bs is not None and int(saved_bs) != block_size:
            raise ValueError(f"{path}: a selection over blocks of {saved_bs} tokens cannot serve blocks of {block_size}")
    if not isinstance(bi, torch.Tensor) or bi.dim() != 4 or bi.dtype.is_floating_point:
        raise ValueError(f"{path}: expected an integer block_idx [B, G, T, topk]")
    b, g, t, k = bi.shape
    if t != T or k != topk or b not in (1, B) or G % g:
        raise ValueError(f"{path}: block_idx {tuple(bi.shape)} cannot serve [B={B}, G={G}, T={T}, topk={topk}]")
    bi = bi.expand(B, g, T, topk).repeat_interleave(G // g, dim=1)
    return bi.to(device=device, dtype=torch.int32).contiguous()


def selection_stats(block_idx: torch.Tensor, block_size: int) -> dict:
    """Shape of a selection: mean valid slots per row; the most popular block's row count over T
    (per group, averaged: 1.0 when every query takes it, the length of a KV-outer kernel's longest
    item list in rows); and the mean number of distinct blocks per tile of 128 consecutive
    queries (the union a query-outer tile loads)."""
    B, G, T, K = block_idx.shape
    nb = (T + block_size - 1) // block_size
    bi = block_idx.long()
    valid = bi >= 0
    counts = torch.zeros(B * G, nb + 1, dtype=torch.int64, device=bi.device)
    flat = torch.where(valid, bi, torch.full_like(bi, nb)).view(B * G, -1)
    counts.scatter_add_(1, flat, torch.ones_like(flat))
    share = counts[:, :nb].max(1).values.float().mean() / T
    tile = 128
    nt = T // tile
    distinct = float("nan")
    if nt:
        t = bi[:, :, : nt * tile].reshape(B * G * nt, tile * K)
        s = t.sort(1).values
        distinct = float(((s[:, 1:] != s[:, :-1]) & (s[:, 1:] >= 0)).sum(1).add((s[:, 0] >= 0).long()).float().mean())
    return {"valid_slots_per_row": float(valid.sum(-1).float().mean()), "top_block_rows_over_T": float(share),
            "distinct_blocks_per_128_queries": distinct}


def dump_block_idx(model, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """The block_idx of every `msakit.ops.index_topk` call that model(input_ids) makes (one per MSA
    layer, in call order), in the model's current attention mode ("sparse" to select)."""
    from msakit import ops

    captured: list[torch.Tensor] = []
    orig = ops.index_topk

    def spy(*args, **kwargs):
        out = orig(*args, **kwargs)
        captured.append(out.detach().to("cpu", torch.int32))
        return out

    ops.index_topk = spy
    try:
        with torch.no_grad():
            model(input_ids, compute_kl=False)
    finally:
        ops.index_topk = orig
    return captured


def dump_layers(model, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """Every MSA layer's block_idx int32 [B, G, T, topk] (CPU) of one forward of model(input_ids)
    in its current attention mode (`return_attn_inputs=True`; layers without a selection are
    skipped)."""
    with torch.no_grad():
        out = model(input_ids, compute_kl=False, return_attn_inputs=True)
    return [inp["block_idx"].detach().to("cpu", torch.int32) for inp in (out.attn_inputs or [])
            if inp is not None and inp.get("block_idx") is not None]


def _corpus_tokens(model_dir: Path, T: int, tokenizer: Path | None = None) -> torch.Tensor:
    """T tokens of held-out text (the corpus's validation files) in the tokenizer beside the model
    (or its run folder), or `tokenizer`."""
    from msakit.train.corpus import build_corpus
    from msakit.train.data import encode_files
    from msakit.train.tokenizer import Tokenizer

    near = [model_dir / "tokenizer.json", model_dir.parent / "tokenizer.json", model_dir.parent.parent / "tokenizer.json"]
    tok_path = tokenizer or next((p for p in near if p.is_file()), None)
    if tok_path is None:
        raise FileNotFoundError(f"no tokenizer.json beside {model_dir}: pass --tokens or --tokenizer")
    tok = Tokenizer.load(tok_path)
    corpus = build_corpus(val_fraction=0.02)
    stream = encode_files(tok, corpus.val + corpus.train, max_tokens=T)
    if len(stream) < T:
        raise ValueError(f"the corpus holds {len(stream)} tokens, fewer than --context {T}")
    return torch.from_numpy(stream.tokens[:T].astype("int64")).view(1, T)


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="dump a trained model's selections for prefill.py --selection-file")
    ap.add_argument("--model", required=True, help="a model folder (config.json + safetensors)")
    ap.add_argument("--context", type=int, default=8192, help="tokens of held-out text to run")
    ap.add_argument("--tokens", default=None, help="a torch file with input ids [1, T] instead of the corpus")
    ap.add_argument("--layer", type=int, default=0, help="which MSA layer's selection (in call order)")
    ap.add_argument("--all-layers", action="store_true",
                    help="write every MSA layer's selection, OUT with _L<layer> before the suffix")
    ap.add_argument("--tokenizer", default=None, help="tokenizer.json (default: beside the model or its run)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    from msakit.models import M3ForCausalLM

    model = M3ForCausalLM.from_pretrained(args.model, device=args.device).eval()
    model.set_attention_mode("sparse")
    ids = (torch.load(args.tokens, weights_only=True) if args.tokens else
           _corpus_tokens(Path(args.model), args.context, Path(args.tokenizer) if args.tokenizer else None))
    cfg = model.config
    if args.all_layers:
        out = Path(args.out)
        for layer, bi in enumerate(dump_layers(model, ids.to(args.device))):
            path = out.with_name(f"{out.stem}_L{layer}{out.suffix}")
            torch.save({"block_idx": bi, "block_size": cfg.index_block_size, "layer": layer,
                        "model": str(args.model)}, path)
            print(f"wrote {path}: block_idx {tuple(bi.shape)}, {selection_stats(bi, cfg.index_block_size)}")
        return
    sels = dump_block_idx(model, ids.to(args.device))
    if not sels:
        raise SystemExit("the model made no index_topk call (no MSA layer in sparse mode?)")
    bi = sels[args.layer]
    torch.save({"block_idx": bi, "block_size": cfg.index_block_size, "layer": args.layer, "model": str(args.model)},
               args.out)
    print(f"wrote {args.out}: block_idx {tuple(bi.shape)}, blocks of {cfg.index_block_size}, "
          f"{selection_stats(bi, cfg.index_block_size)}")


if __name__ == "__main__":
    main()
