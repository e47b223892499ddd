"""The RULER part of an evaluation's report: scores with standard errors, differences against dense
on the same samples, a table and a plot.

Per (policy, task, length) cell: the mean of the per-sample scores (RULER's string match, in
[0, 1]; reported in percent), the number of samples n and the standard error sqrt(p (1 - p) / n),
the binomial one, an upper bound for scores in [0, 1] that equals the sample error for 0/1 scores.
The average over tasks (RULER's headline number) has the error sqrt(sum se^2) / tasks.  Against the
first ``dense`` policy, each policy's difference is paired: the mean of (score - dense score) over
the samples both ran, with its standard error std / sqrt(n) (per task; pooled over tasks as above).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Sequence

from msakit.eval.ruler import NIAH_TASKS, RULER_TASKS

__all__ = ["ruler_markdown", "ruler_plot", "summarize_ruler"]


def _mean_se(xs: Sequence[float], binomial: bool) -> tuple[float, float]:
    n = len(xs)
    m = sum(xs) / n
    if binomial:
        return m, math.sqrt(max(0.0, m * (1 - m)) / n)
    var = sum((x - m) ** 2 for x in xs) / (n - 1) if n > 1 else 0.0
    return m, math.sqrt(var / n)


def _pool(cells: Sequence[dict[str, float]]) -> dict[str, float]:
    """Average of per-task cells {score, se, n} -> {score, se, tasks, n}."""
    k = len(cells)
    return dict(score=sum(c["score"] for c in cells) / k, se=math.sqrt(sum(c["se"] ** 2 for c in cells)) / k,
                tasks=k, n=sum(c["n"] for c in cells))


def summarize_ruler(records: Sequence[dict[str, Any]], cfg: Any) -> dict[str, Any]:
    """{"scores": {policy: {task | "average" | "niah": {length: cell}}}, "vs_dense": {policy: ...}}
    from the RULER records of `cfg`'s grid (samples below ``cfg.ruler_samples``)."""
    tasks = [t for t in cfg.tasks if t in RULER_TASKS]
    lengths = [str(n) for n in cfg.lengths]
    by: dict[tuple[str, str, str], dict[int, float]] = {}
    for r in records:
        if r.get("task") not in tasks or r.get("policy") not in cfg.policies or r.get("length") not in cfg.lengths:
            continue
        if r.get("index", 0) >= cfg.ruler_samples:
            continue
        by.setdefault((r["policy"], r["task"], str(r["length"])), {})[r["index"]] = float(r["score"])
    scores: dict[str, Any] = {}
    for (pol, task, L), s in by.items():
        m, se = _mean_se(list(s.values()), binomial=True)
        scores.setdefault(pol, {}).setdefault(task, {})[L] = dict(score=m, se=se, n=len(s))
    ref = next((p for p in cfg.policies if p == "dense"), None)
    diffs: dict[str, Any] = {}
    if ref is not None:
        for pol in cfg.policies:
            if pol == ref:
                continue
            for task in tasks:
                for L in lengths:
                    a, b = by.get((pol, task, L), {}), by.get((ref, task, L), {})
                    shared = sorted(set(a) & set(b))
                    if shared:
                        m, se = _mean_se([a[i] - b[i] for i in shared], binomial=False)
                        diffs.setdefault(pol, {}).setdefault(task, {})[L] = dict(score=m, se=se, n=len(shared))
    for table in (scores, diffs):
        for pol, per_task in table.items():
            for name, group in (("average", tasks), ("niah", [t for t in tasks if t in NIAH_TASKS])):
                for L in lengths:
                    cells = [per_task[t][L] for t in group if L in per_task.get(t, {})]
                    if group and len(cells) == len(group):  # only over complete task sets
                        per_task.setdefault(name, {})[L] = _pool(cells)
    return dict(tasks=tasks, lengths=lengths, reference=ref, scores=scores, vs_dense=diffs,
                samples=cfg.ruler_samples)


def _cell(c: dict[str, float] | None, signed: bool = False) -> str:
    if not c:
        return "-"
    v = f"{100 * c['score']:+.1f}" if signed else f"{100 * c['score']:.1f}"
    return f"{v} ± {100 * c['se']:.1f} ({c['n']})"


def ruler_markdown(rs: dict[str, Any], policies: Sequence[str]) -> str:
    """RULER score (percent) ± standard error (samples) per policy, task and length; the average and
    NIAH rows; then the paired differences against dense."""
    lengths = rs["lengths"]
    rows = rs["tasks"] + [r for r in ("niah", "average") if any(r in v for v in rs["scores"].values())]
    out = [f"RULER: score in percent ± standard error (samples); {rs['samples']} samples per task and length; "
           "'niah' and 'average' pool the tasks (error sqrt(sum se^2) / tasks).", "",
           "| policy | task | " + " | ".join(lengths) + " |", "|" + "---|" * (2 + len(lengths))]
    for pol in policies:
        for t in rows:
            e = rs["scores"].get(pol, {}).get(t)
            if e:
                out.append(f"| {pol} | {t} | " + " | ".join(_cell(e.get(L)) for L in lengths) + " |")
    if rs["vs_dense"]:
        out += ["", f"RULER: difference against {rs['reference']} on the same samples (points ± paired standard "
                "error (samples)):", "", "| policy | task | " + " | ".join(lengths) + " |",
                "|" + "---|" * (2 + len(lengths))]
        for pol in policies:
            for t in rows:
                e = rs["vs_dense"].get(pol, {}).get(t)
                if e:
                    out.append(f"| {pol} | {t} | " + " | ".join(_cell(e.get(L), True) for L in lengths) + " |")
    return "\n".join(out) + "\n"


def ruler_plot(rs: dict[str, Any], policies: Sequence[str], path: str | os.PathLike[str], title: str = "") -> Path | None:
    """Average and NIAH score by length with error bars, and every task at the longest length."""
    if not rs["scores"]:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, row in zip(axes[:2], ("average", "niah")):
        for i, pol in enumerate(policies):
            e = rs["scores"].get(pol, {}).get(row, {})
            ls = [L for L in rs["lengths"] if L in e]
            if ls:
                ax.errorbar([int(L) for L in ls], [100 * e[L]["score"] for L in ls],
                            yerr=[100 * e[L]["se"] for L in ls], label=pol, marker="osD^vP*X"[i % 8], capsize=3)
        ax.set_xscale("log", base=2)
        ax.set(title=f"RULER {row} (± s.e.)", xlabel="context (tokens)", ylabel="score %", ylim=(-3, 103))
        ax.legend(fontsize=7)
    ax = axes[2]
    L = max(rs["lengths"], key=int)
    width = 0.8 / max(1, len(policies))
    for i, pol in enumerate(policies):
        per = rs["scores"].get(pol, {})
        xs = [j for j, t in enumerate(rs["tasks"]) if L in per.get(t, {})]
        ax.bar([x + i * width for x in xs], [100 * per[rs["tasks"][x]][L]["score"] for x in xs], width,
               yerr=[100 * per[rs["tasks"][x]][L]["se"] for x in xs], label=pol)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rs["tasks"]))], rs["tasks"], rotation=60, fontsize=7)
    ax.set(title=f"RULER tasks at {L} tokens", ylabel="score %", ylim=(0, 105))
    fig.suptitle(title or "RULER")
    fig.tight_layout()
    p = Path(path)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p
