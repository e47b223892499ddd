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


def write_plots(metrics_path: str | os.PathLike, out_dir: str | os.PathLike, *, switch_step: int | None = None) -> list[Path]:
    """Write ``loss.png`` (train / validation loss, the dense->sparse switch marked) and
    ``recall.png`` (indexer recall per MSA layer with the oracle dashed).  Returns the paths written."""
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
    if rec_evals:
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
