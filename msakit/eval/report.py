"""The report of an evaluation folder: summary.json, table.md and plot.png from its records."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from msakit.eval.ruler import RULER_TASKS
from msakit.eval.ruler_report import ruler_markdown, ruler_plot, summarize_ruler
from msakit.eval.scoring import bucket_start
from msakit.jsonl import dumps_strict

__all__ = ["markdown_table", "plot", "summarize", "write_report"]


def _depth_key(d: Any) -> str:
    return f"{float(d):g}"


def summarize(records: Sequence[dict[str, Any]], cfg: Any) -> dict[str, Any]:
    """Aggregate the records of the grid of `cfg` (an EvalConfig): loss by length and position
    bucket (token-weighted means), retrieval accuracy by task, length and depth."""
    want_pol, want_len = set(cfg.policies), set(cfg.lengths)
    want_depth = {_depth_key(d) for d in cfg.depths}
    loss: dict[str, dict[str, Any]] = {}
    ret: dict[str, dict[str, Any]] = {}
    for r in records:
        if r.get("policy") not in want_pol or r.get("length") not in want_len or r.get("task") not in cfg.tasks:
            continue
        if r["task"] in RULER_TASKS or r.get("index", 0) >= cfg.samples:  # RULER's: summarize_ruler
            continue
        pol, L = r["policy"], str(r["length"])
        if r["task"] == "loss":
            e = loss.setdefault(pol, {}).setdefault(L, {"nll_sum": 0.0, "tokens": 0, "docs": 0, "buckets": {}})
            e["nll_sum"] += r["nll_sum"]
            e["tokens"] += r["tokens"]
            e["docs"] += 1
            for lab, (s, n) in r["buckets"].items():
                b = e["buckets"].setdefault(lab, [0.0, 0])
                b[0] += s
                b[1] += n
        else:
            d = _depth_key(r["depth"])
            if d not in want_depth:
                continue
            e = ret.setdefault(pol, {}).setdefault(r["task"], {}).setdefault(L, {}).setdefault(d, [0, 0])
            e[0] += int(bool(r["exact"]))
            e[1] += 1
    out_loss = {
        pol: {L: dict(loss=e["nll_sum"] / max(1, e["tokens"]), tokens=e["tokens"], docs=e["docs"],
                      buckets={lab: e["buckets"][lab][0] / e["buckets"][lab][1]
                               for lab in sorted(e["buckets"], key=bucket_start)})
              for L, e in by_len.items()}
        for pol, by_len in loss.items()
    }
    out_ret: dict[str, Any] = {}
    for pol, by_task in ret.items():
        for task, by_len in by_task.items():
            for L, by_depth in by_len.items():
                n = sum(v[1] for v in by_depth.values())
                acc = {d: v[0] / v[1] for d, v in by_depth.items()}
                out_ret.setdefault(pol, {}).setdefault(task, {})[L] = dict(
                    accuracy=sum(v[0] for v in by_depth.values()) / n, n=n, by_depth=acc)
    return dict(settings=dict(cfg.identity(), tasks=list(cfg.tasks), lengths=list(cfg.lengths),
                              depths=list(cfg.depths), policies=list(cfg.policies), samples=cfg.samples),
                loss=out_loss, retrieval=out_ret)


def _fmt(x: Any, pct: bool = False) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.0f}" if pct else f"{x:.4f}"


def markdown_table(summary: dict[str, Any]) -> str:
    """Loss by length and accuracy (percent, mean over depths) by task and length, one row per
    policy; then accuracy by depth."""
    st = summary["settings"]
    lengths = [str(n) for n in st["lengths"]]
    tasks = [t for t in st["tasks"] if t != "loss" and t not in RULER_TASKS]
    has_loss = "loss" in st["tasks"]
    head = ["policy"] + ([f"loss {n}" for n in lengths] if has_loss else [])
    for t in tasks:
        head += [f"{t} {n}" for n in lengths]
    if not tasks and not has_loss:
        return ruler_markdown(summary["ruler"], st["policies"]) if summary.get("ruler") else ""
    lines = [f"Budget {st['budget']}; seed {st['seed']}; {st['samples']} samples per cell; "
             f"accuracy in percent (exact match, mean over depths {', '.join(_depth_key(d) for d in st['depths'])}).",
             "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for pol in st["policies"]:
        row = [pol]
        if has_loss:
            row += [_fmt(summary["loss"].get(pol, {}).get(n, {}).get("loss")) for n in lengths]
        for t in tasks:
            row += [_fmt(summary["retrieval"].get(pol, {}).get(t, {}).get(n, {}).get("accuracy"), pct=True)
                    for n in lengths]
        lines.append("| " + " | ".join(row) + " |")
    if tasks:
        depths = [_depth_key(d) for d in st["depths"]]
        lines += ["", "Accuracy (percent) by depth:", "",
                  "| policy | task | length | " + " | ".join(f"depth {d}" for d in depths) + " |",
                  "|" + "---|" * (3 + len(depths))]
        for pol in st["policies"]:
            for t in tasks:
                for n in lengths:
                    e = summary["retrieval"].get(pol, {}).get(t, {}).get(n)
                    if e:
                        lines.append(f"| {pol} | {t} | {n} | " + " | ".join(_fmt(e["by_depth"].get(d), True)
                                                                      for d in depths) + " |")
    if summary.get("ruler"):
        lines += ["", ruler_markdown(summary["ruler"], st["policies"])]
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, Any], path: str | os.PathLike[str]) -> Path | None:
    """Accuracy by length and by depth for each retrieval task, loss by position bucket at the
    longest evaluated length; None when there is nothing to draw."""
    st = summary["settings"]
    tasks = [t for t in st["tasks"] if t not in RULER_TASKS and t != "loss"
             and any(t in v for v in summary["retrieval"].values())]
    has_loss = bool(summary["loss"])
    ncol = len(tasks) + int(has_loss)
    if not ncol:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nrow = 2 if tasks else 1
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 3.4 * nrow), squeeze=False)
    # policies often score the same (0 or 100 %): each gets its own marker, line style and a small
    # vertical offset on the accuracy axes, so that equal curves stay visible side by side
    pols = list(st["policies"])
    style = {pol: dict(marker="osD^vP*X"[i % 8], linestyle=("-", "--", "-.", ":")[i % 4], alpha=0.85,
                       markersize=5, markerfacecolor="none" if i % 2 else None)
             for i, pol in enumerate(pols)}
    lift = {pol: 1.2 * (i - (len(pols) - 1) / 2) for i, pol in enumerate(pols)}  # accuracy points
    for c, t in enumerate(tasks):
        ax_len, ax_d = axes[0][c], axes[1][c]
        for pol in st["policies"]:
            e = summary["retrieval"].get(pol, {}).get(t, {})
            ls = [n for n in st["lengths"] if str(n) in e]
            if not ls:
                continue
            ax_len.plot(ls, [100 * e[str(n)]["accuracy"] + lift[pol] for n in ls], label=pol, **style[pol])
            ds = [d for d in st["depths"] if any(_depth_key(d) in e[str(n)]["by_depth"] for n in ls)]
            acc = []
            for d in ds:
                v = [e[str(n)]["by_depth"][_depth_key(d)] for n in ls if _depth_key(d) in e[str(n)]["by_depth"]]
                acc.append(100 * sum(v) / len(v))
            ax_d.plot(ds, [a + lift[pol] for a in acc], label=pol, **style[pol])
        ax_len.set(title=f"{t}: accuracy by length", xlabel="context (tokens)", ylabel="exact match % (curves offset)", ylim=(-8, 108))
        ax_len.set_xscale("log", base=2)
        ax_d.set(title=f"{t}: accuracy by depth (mean over lengths)", xlabel="needle depth",
                 ylabel="exact match % (curves offset)", ylim=(-8, 108))
        ax_len.legend(fontsize=7)
    if has_loss:
        ax = axes[0][ncol - 1]
        for pol in st["policies"]:
            by_len = summary["loss"].get(pol)
            if not by_len:
                continue
            L = max(by_len, key=int)
            labs = sorted(by_len[L]["buckets"], key=bucket_start)
            ax.plot(range(len(labs)), [by_len[L]["buckets"][b] for b in labs], label=f"{pol} ({L})", **style[pol])
            ax.set_xticks(range(len(labs)), labs, rotation=45, fontsize=7)
        ax.set(title="loss by position", xlabel="position bucket", ylabel="mean NLL (nats)")
        ax.legend(fontsize=7)
        if nrow == 2:
            axes[1][ncol - 1].axis("off")
    fig.suptitle(f"msakit eval, budget {st['budget']}")
    fig.tight_layout()
    p = Path(path)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def write_report(records: Sequence[dict[str, Any]], cfg: Any, out_dir: str | os.PathLike[str], *,
                 model_name: str | None = None) -> dict[str, Any]:
    """summary.json (strict JSON: a non-finite value is null), table.md and plot.png (ruler.png with
    RULER's tasks) in `out_dir`; returns the summary."""
    out = Path(out_dir)
    summary = summarize(records, cfg)
    summary["model"] = model_name
    if getattr(cfg, "ruler_tasks", None):
        summary["ruler"] = summarize_ruler(records, cfg)
        ruler_plot(summary["ruler"], cfg.policies, out / "ruler.png", title=f"{model_name or ''} {cfg.budget}")
    (out / "summary.json").write_text(dumps_strict(summary, indent=2) + "\n")
    (out / "table.md").write_text(markdown_table(summary))
    plot(summary, out / "plot.png")
    return summary
