"""Statistics of block selections: how much neighbouring queries share, what a tile of consecutive
queries loads, how popular blocks are, how far back queries look.

    python tools/bench/selection_stats.py SEL.pt [SEL2.pt ...] --block-size 128 --out stats.json --plot stats.png
    python tools/bench/selection_stats.py SEL.pt --out stats.json --fit   # + benchmarks/selections.py's RealLike fit

Input: block_idx int [B, G, T, topk] (`msakit.ops.index_topk`'s layout: per (batch, group, query)
distinct block ids <= the query's own block, -1 padded), as a tensor, or a torch file holding one
(or a dict with "block_idx" and optionally "block_size"; `benchmarks/selections.py` writes those).

Statistics (`selection_stats`), each over every batch row and group:
- `jaccard`: |S_i & S_i+1| / |S_i | S_i+1| of the block sets of neighbouring queries i, i+1 of one
  group (valid ids only); mean, quantiles, and the mean per group.
- `union`: per tile of n consecutive queries (n = 16, 32, 64, 128; whole tiles only), the number
  of distinct blocks the tile's queries select: mean, quantiles, and the mean over the rows'
  mean valid slots (1.0 = every query of the tile selects the same set).
- `popularity`: per (batch, group, block), the number of queries of later blocks selecting it
  (its own block's queries always do), as a share of those queries; histogram over shares (bins
  0, (0, 1/64], ... doubling, (1/2, 1]), quantiles of the counts, the mean count per block, the
  most popular block's share (mean over rows) and the share of blocks no later query selects.
- `distance`: query block - selected block (0 = the query's own block), histogram over bins
  0, 1, 2-3, 4-7, ... (powers of two), and the share of selections at distance < 4.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

__all__ = ["selection_stats", "load_selection", "plot_stats", "TILES"]

TILES = (16, 32, 64, 128)
QUANTILES = (0.1, 0.5, 0.9, 0.99)
ROW_CHUNK = 1 << 16  # query rows per step (bounds the temporaries at 1M tokens)


def _check(block_idx: torch.Tensor, block_size: int) -> tuple[int, int, int, int]:
    if not isinstance(block_idx, torch.Tensor) or block_idx.dim() != 4 or block_idx.dtype.is_floating_point:
        raise ValueError(f"block_idx must be an integer tensor [B, G, T, topk], got "
                         f"{getattr(block_idx, 'dtype', type(block_idx).__name__)} {tuple(getattr(block_idx, 'shape', ()))}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    B, G, T, K = block_idx.shape
    if min(B, G, T, K) < 1:
        raise ValueError(f"block_idx must have non-empty dimensions, got {tuple(block_idx.shape)}")
    return B, G, T, K


def _canonical(rows: torch.Tensor) -> torch.Tensor:
    """rows int64 [..., K] -> each row's distinct valid ids ascending, then -1 (duplicates dropped)."""
    big = torch.iinfo(torch.int64).max
    s = torch.where(rows >= 0, rows, torch.full_like(rows, big)).sort(dim=-1).values
    dup = torch.zeros_like(s, dtype=torch.bool)
    dup[..., 1:] = s[..., 1:] == s[..., :-1]
    s = torch.where(dup, torch.full_like(s, big), s).sort(dim=-1).values
    return torch.where(s == big, torch.full_like(s, -1), s)


def _quantiles(x: torch.Tensor) -> dict[str, float]:
    x = x.double().flatten()
    if x.numel() == 0:
        return {f"p{int(q * 100)}": float("nan") for q in QUANTILES}
    if x.numel() > 1 << 24:  # torch.quantile's input limit: an even subsample
        x = x[:: -(-x.numel() // (1 << 24))]
    qs = torch.quantile(x, torch.tensor(QUANTILES, dtype=torch.float64, device=x.device))
    return {f"p{int(q * 100)}": float(v) for q, v in zip(QUANTILES, qs)}


def _jaccard(sel: torch.Tensor) -> torch.Tensor:
    """Per neighbouring pair of rows of sel [R, T, K] (canonical): Jaccard, float [R, T - 1]
    (1.0 for two empty rows)."""
    R, T, K = sel.shape
    out = torch.empty(R, max(0, T - 1), dtype=torch.float32, device=sel.device)
    for t0 in range(0, T - 1, ROW_CHUNK):
        t1 = min(T - 1, t0 + ROW_CHUNK)
        a, b = sel[:, t0:t1], sel[:, t0 + 1:t1 + 1]
        inter = ((a.unsqueeze(-1) == b.unsqueeze(-2)) & (a >= 0).unsqueeze(-1)).sum((-1, -2))
        na, nb = (a >= 0).sum(-1), (b >= 0).sum(-1)
        union = na + nb - inter
        out[:, t0:t1] = torch.where(union > 0, inter.float() / union.clamp(min=1).float(), torch.ones_like(union,
                                                                                                   dtype=torch.float32))
    return out


def _tile_unions(sel: torch.Tensor, n: int) -> torch.Tensor:
    """Distinct valid ids per whole tile of n consecutive rows of sel [R, T, K] -> int [R, T // n]."""
    R, T, K = sel.shape
    nt = T // n
    if nt == 0:
        return torch.zeros(R, 0, dtype=torch.int64, device=sel.device)
    out = torch.empty(R, nt, dtype=torch.int64, device=sel.device)
    step = max(1, ROW_CHUNK // n)
    for a in range(0, nt, step):
        b = min(nt, a + step)
        t = sel[:, a * n:b * n].reshape(R, b - a, n * K).sort(dim=-1).values
        new = torch.ones_like(t, dtype=torch.bool)
        new[..., 1:] = t[..., 1:] != t[..., :-1]
        out[:, a:b] = (new & (t >= 0)).sum(-1)
    return out


def _log2_bins(x: torch.Tensor, top: int) -> tuple[list[str], list[int]]:
    """Histogram of non-negative ints over bins 0, 1, 2-3, 4-7, ... up to `top`."""
    edges = [0, 1] + [1 << i for i in range(1, max(1, math.ceil(math.log2(max(2, top + 1)))) + 1)]
    labels, counts = [], []
    for lo, hi in zip(edges[:-1], edges[1:]):
        labels.append(str(lo) if hi - lo == 1 else f"{lo}-{hi - 1}")
        counts.append(int(((x >= lo) & (x < hi)).sum()))
    return labels, counts


def selection_stats(block_idx: torch.Tensor, block_size: int, *, tiles: tuple[int, ...] = TILES) -> dict:
    """The statistics of the module docstring for block_idx int [B, G, T, topk]; a JSON-ready dict
    (also: shape, block_size, mean valid slots per row)."""
    B, G, T, K = _check(block_idx, block_size)
    nb = (T + block_size - 1) // block_size
    sel = _canonical(block_idx.long().reshape(B * G, T, K))
    valid = sel >= 0
    slots = valid.sum(-1)
    out: dict = {"shape": [B, G, T, K], "block_size": block_size, "blocks": nb,
                 "valid_slots_per_row": float(slots.float().mean())}

    jac = _jaccard(sel)
    per_group = jac.view(B, G, -1).mean(dim=(0, 2)) if T > 1 else torch.full((G,), float("nan"))
    out["jaccard"] = {"mean": float(jac.mean()) if jac.numel() else float("nan"), **_quantiles(jac),
                      "per_group": [float(x) for x in per_group]}

    out["union"] = {}
    mean_slots = float(slots.float().mean())
    for n in tiles:
        u = _tile_unions(sel, n)
        if u.numel() == 0:
            continue
        out["union"][str(n)] = {"mean": float(u.float().mean()), **_quantiles(u), "max": int(u.max()),
                                "over_slots": float(u.float().mean()) / max(mean_slots, 1e-9)}

    own = (torch.arange(T, device=sel.device) // block_size).view(1, T, 1)
    later = valid & (sel < own)  # selections by queries of later blocks (a block's own queries always take it)
    flat = torch.where(later, sel, torch.full_like(sel, nb)).view(B * G, -1)
    counts = torch.zeros(B * G, nb + 1, dtype=torch.int64, device=sel.device)
    counts.scatter_add_(1, flat, torch.ones_like(flat))
    eligible = T - (torch.arange(nb, device=sel.device) + 1) * block_size  # queries of the later blocks
    counts = counts[:, :nb][:, eligible > 0]
    share = counts.double() / eligible[eligible > 0].double()
    edges = [0.0] + [2.0 ** -i for i in range(6, -1, -1)]  # 0, 1/64, ..., 1/2, 1
    labels, hist = ["0"], [int((share == 0).sum())]
    for lo, hi in zip(edges[:-1], edges[1:]):
        labels.append(f"({lo:g}, {hi:g}]")
        hist.append(int(((share > lo) & (share <= hi)).sum()))
    top = share.max(dim=1).values
    out["popularity"] = {"share_bins": labels, "share_hist": hist, "count_mean": float(counts.float().mean()),
                         "count_quantiles": _quantiles(counts), "top_block_share_mean": float(top.mean()),
                         "blocks_never_selected": float((counts == 0).double().mean())}

    dist = (own - sel)[valid]
    labels, hist = _log2_bins(dist, nb - 1)
    total = max(1, int(dist.numel()))
    out["distance"] = {"bins": labels, "hist": hist, "share": [h / total for h in hist],
                       "near_share": float((dist < 4).sum()) / total, "mean": float(dist.double().mean()) if
                       dist.numel() else float("nan")}
    return out


def load_selection(path: str | Path) -> tuple[torch.Tensor, int | None]:
    """(block_idx, block_size or None) from a torch file: a tensor, or a dict with "block_idx"
    (and "block_size")."""
    obj = torch.load(Path(path), map_location="cpu", weights_only=True)
    if isinstance(obj, dict):
        bs = obj.get("block_size")
        return obj["block_idx"], None if bs is None else int(bs)
    return obj, None


def plot_stats(stats: dict | list[dict], path: str | Path, labels: list[str] | None = None) -> None:
    """Four panels (neighbour Jaccard quantiles, union per tile over slots, popularity share
    histogram, distance histogram), one series per stats dict."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = stats if isinstance(stats, list) else [stats]
    labels = labels or [f"selection {i}" for i in range(len(runs))]
    fig, ax = plt.subplots(1, 4, figsize=(18, 4))
    for s, lab in zip(runs, labels):
        j = s["jaccard"]
        qs = [k for k in j if k[0] == "p" and k[1:].isdigit()]
        ax[0].plot([int(k[1:]) for k in qs], [j[k] for k in qs], marker="o", label=f"{lab} (mean {j['mean']:.2f})")
        tiles = sorted(s["union"], key=int)
        ax[1].plot([int(t) for t in tiles], [s["union"][t]["over_slots"] for t in tiles], marker="o", label=lab)
        pop = s["popularity"]
        ax[2].plot(range(len(pop["share_hist"])), [h / max(1, sum(pop["share_hist"])) for h in pop["share_hist"]],
                   marker="o", label=lab)
        d = s["distance"]
        ax[3].plot(range(len(d["share"])), d["share"], marker="o", label=lab)
    ax[0].set(title="neighbour Jaccard (quantiles)", xlabel="percentile", ylabel="Jaccard")
    ax[1].set(title="union per tile / slots per row", xlabel="queries per tile", ylabel="x", xscale="log")
    ax[2].set(title="block popularity", ylabel="share of blocks", xlabel="share of eligible queries selecting it")
    ax[2].set_xticks(range(len(runs[0]["popularity"]["share_bins"])))
    ax[2].set_xticklabels(runs[0]["popularity"]["share_bins"], rotation=60, fontsize=7)
    ax[3].set(title="distance (query block - selected block)", ylabel="share of selections")
    longest = max(runs, key=lambda r: len(r["distance"]["bins"]))["distance"]["bins"]
    ax[3].set_xticks(range(len(longest)))
    ax[3].set_xticklabels(longest, rotation=60, fontsize=7)
    for a in ax:
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="statistics of dumped block selections (JSON and a plot)")
    ap.add_argument("files", nargs="+", help="torch files holding block_idx [B, G, T, topk] (or a dict with it)")
    ap.add_argument("--block-size", type=int, default=None, help="block size (default: the file's own)")
    ap.add_argument("--out", required=True, help="JSON output")
    ap.add_argument("--plot", default=None, help="PNG output")
    ap.add_argument("--fit", action="store_true",
                    help="also fit benchmarks/selections.py's real-like parameters to each selection (at its shape)")
    ap.add_argument("--local-blocks", type=int, default=1, help="with --fit: the selection's forced local blocks")
    ap.add_argument("--init-blocks", type=int, default=0, help="with --fit: the selection's forced first blocks")
    args = ap.parse_args(argv)
    res = {}
    for f in args.files:
        bi, bs = load_selection(f)
        bs = args.block_size or bs
        if bs is None:
            raise SystemExit(f"{f}: no block_size in the file: pass --block-size")
        res[f] = selection_stats(bi, bs)
        print(f, json.dumps({k: res[f][k] for k in ("shape", "valid_slots_per_row")}),
              f"jaccard {res[f]['jaccard']['mean']:.3f}", flush=True)
        if args.fit:
            import sys
            from dataclasses import asdict

            sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for benchmarks/
            from benchmarks.selections import fit_real_like

            B, G, T, K = res[f]["shape"]
            par, dist = fit_real_like(res[f], T=T, block_size=bs, topk=K, groups=G, local_blocks=args.local_blocks,
                                      init_blocks=args.init_blocks)
            res[f]["real_like_fit"] = {"params": asdict(par), "distance": dist}
            print(f"  real-like fit: {par} (distance {dist:.4f})", flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    if args.plot:
        plot_stats(list(res.values()), args.plot, labels=[Path(f).stem for f in res])


if __name__ == "__main__":
    main()
