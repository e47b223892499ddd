"""Plots from a run's metrics.jsonl (matplotlib, Agg backend): loss curves and recall per layer."""

from __future__ import annotations

import math
import os
from pathlib import Path

from msakit.train.jsonl import read_metrics


def _records(path: Path) -> list[dict]:
    return read_metrics(path)


def _save(fig, path: Path) -> None:
    tmp = path.with_name(f".tmp-{path.name}")
    fig.savefig(tmp, dpi=110, bbox_inches="tight", format="png")
    os.replace(tmp, path)


MIN_CURVE_POINTS = 4  # evaluations (distinct steps) a recall curve needs; fewer: the last one's bars per layer


def _num(x) -> float:
    return float(x) if isinstance(x, (int, float)) else math.nan


def _recall_bars(plt, rec: dict, path: Path) -> None:
    """recall.png of a run with too few evaluations for a curve: the last evaluation's recall
    and oracle per layer, side by side (and the same for queries past the top-k blocks)."""
    import numpy as np

    layers = np.arange(len(rec["recall_per_layer"]))
    series = [("recall", rec["recall_per_layer"], "C0", None), ("oracle top-k", rec.get("oracle_per_layer", []), "C1", None),
              ("recall, queries past k blocks", rec.get("recall_far_per_layer", []), "C0", "//"),
              ("oracle, past k blocks", rec.get("oracle_far_per_layer", []), "C1", "//")]
    series = [s for s in series if len(s[1]) == len(layers)]
    w = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for j, (label, ys, color, hatch) in enumerate(series):
        vals = [_num(y) for y in ys]
        bars = ax.bar(layers + (j - (len(series) - 1) / 2) * w, vals, w, label=label, color=color,
                      alpha=0.55 if hatch else 0.9, hatch=hatch, edgecolor="white" if not hatch else color)
        ax.bar_label(bars, labels=[f"{v:.2f}" if math.isfinite(v) else "n/a" for v in vals], fontsize=6)
    ax.set_xticks(layers, [f"layer {i}" for i in layers])
    ax.set_ylabel("dense attention mass in selected blocks")
    ax.set_title(f"indexer recall vs oracle top-k at step {rec.get('step')} "
                 f"(too few evaluations for a curve)", fontsize=9)
    ax.set_ylim(0, 1.1)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, ncol=2, loc="lower right")
    _save(fig, path)
    plt.close(fig)


def write_plots(metrics_path: str | os.PathLike, out_dir: str | os.PathLike, *, switch_step: int | None = None) -> list[Path]:
    """Write ``loss.png`` (train / validation loss, the dense->sparse switch marked) and
    ``recall.png`` (indexer recall per MSA layer over the steps with the oracle dashed; with fewer
    than MIN_CURVE_POINTS evaluations, the last one's recall and oracle per layer as bars).
    Returns the paths written."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    recs = _records(Path(metrics_path))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in recs if r.get("kind") == "train"]
    train = [r for r in recs if r.get("kind") == "train" and r.get("loss") is not None]  # no LM loss: index-only
    evals = [r for r in recs if r.get("kind") == "eval" and r.get("mode") in (None, "dense", "sparse") and "val_loss" in r]
    written = []
    if train or evals:
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        if train:
            ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss", lw=1.2)
        if evals:
            ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", label="validation loss", ms=3)
        for key, mk in (("val_loss_dense", "s-"), ("val_loss_sparse", "^-")):  # evaluations in both modes
            both = [r for r in evals if key in r]
            if both:
                ax.plot([r["step"] for r in both], [r[key] for r in both], mk, label=key.replace("_", " "), ms=3, lw=0.8)
        finals = [r for r in recs if r.get("kind") == "final"]
        for r in finals:
            for key, mk in (("val_loss_dense", "s"), ("val_loss_sparse", "^")):
                if key in r:
                    ax.plot([r["step"]], [r[key]], mk, label=key.replace("_", " "), ms=6)
        if switch_step and steps and switch_step < steps[-1]:
            ax.axvline(switch_step, color="gray", ls=":", lw=1)
            ax.text(switch_step, ax.get_ylim()[1], " sparse ->", va="top", ha="left", fontsize=8, color="gray")
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        _save(fig, out / "loss.png")
        plt.close(fig)
        written.append(out / "loss.png")
    rec_evals = [r for r in recs if r.get("kind") in ("eval", "final") and r.get("recall_per_layer")]
    if 0 < len({r["step"] for r in rec_evals}) < MIN_CURVE_POINTS:
        _recall_bars(plt, rec_evals[-1], out / "recall.png")
        written.append(out / "recall.png")
    elif rec_evals:
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        nl = len(rec_evals[-1]["recall_per_layer"])
        steps = [r["step"] for r in rec_evals]
        cmap = plt.get_cmap("tab10")
        for li in range(nl):
            ys = [r["recall_per_layer"][li] if li < len(r["recall_per_layer"]) else math.nan for r in rec_evals]
            os_ = [r["oracle_per_layer"][li] if li < len(r.get("oracle_per_layer", [])) else math.nan for r in rec_evals]
            ax.plot(steps, ys, "o-", color=cmap(li % 10), ms=3, label=f"layer {li}")
            ax.plot(steps, os_, "--", color=cmap(li % 10), lw=0.8)
        ax.set_xlabel("step")
        ax.set_ylabel("dense attention mass in selected blocks")
        ax.set_title("indexer recall (solid) vs oracle top-k (dashed)", fontsize=9)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        _save(fig, out / "recall.png")
        plt.close(fig)
        written.append(out / "recall.png")
    return written
