"""Merge `msakit eval` folders into one table against a dense reference, matched sample by sample.

Each row is one policy of one eval folder (``LABEL=FOLDER:POLICY``).  Its loss at a length is the
token-weighted mean NLL over the documents it has, and the dense loss beside it is taken over the
same documents; its retrieval accuracy at a (task, length) is over the (depth, sample) pairs it has,
and dense's over the same pairs.  Rows of folders with fewer samples are so compared fairly.

    python tools/convert_table.py --dense runs/eval_base:dense \\
        --row "oracle top-8=runs/eval_base:oracle" --row "MSA q/k=runs/eval_warm_qk:msa" --out runs/table

Writes table.md, table.json and plot.png (accuracy by length per task, loss against dense by length)
into --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from msakit.eval.runner import RESULTS, read_records  # noqa: E402
from msakit.eval.tasks import RETRIEVAL_TASKS  # noqa: E402


def parse_source(text: str) -> tuple[Path, str]:
    """'FOLDER:POLICY' -> (folder, policy); the folder must hold results.jsonl."""
    folder, sep, policy = text.rpartition(":")
    if not sep or not folder or not policy:
        raise ValueError(f"a source must be FOLDER:POLICY, got {text!r}")
    path = Path(folder)
    if not (path / RESULTS).is_file():
        raise ValueError(f"{path} holds no {RESULTS}")
    return path, policy


def load(folder: Path, policy: str) -> tuple[dict, dict]:
    """(loss records by (length, doc), retrieval records by (task, length, depth, index)) of `policy`."""
    loss, ret = {}, {}
    for r in read_records(folder / RESULTS):
        if r.get("policy") != policy:
            continue
        if r["task"] == "loss":
            loss[(r["length"], r["doc"])] = r
        elif r["task"] in RETRIEVAL_TASKS:
            ret[(r["task"], r["length"], f"{float(r['depth']):g}", r["index"])] = r
    if not loss and not ret:
        raise ValueError(f"{folder} has no records of policy {policy!r}")
    return loss, ret


def compare(row: tuple[dict, dict], dense: tuple[dict, dict]) -> dict[str, Any]:
    """Loss and accuracy of `row` and of `dense` on the samples both have."""
    (loss, ret), (dloss, dret) = row, dense
    out: dict[str, Any] = dict(loss={}, retrieval={})
    for length in sorted({k[0] for k in loss}):
        keys = [k for k in loss if k[0] == length and k in dloss]
        if not keys:
            continue
        tok = sum(loss[k]["tokens"] for k in keys)
        m = sum(loss[k]["nll_sum"] for k in keys) / tok
        d = sum(dloss[k]["nll_sum"] for k in keys) / tok
        out["loss"][str(length)] = dict(loss=m, dense=d, rel=m / d - 1.0, docs=len(keys), tokens=tok)
    for task in RETRIEVAL_TASKS:
        for length in sorted({k[1] for k in ret if k[0] == task}):
            keys = [k for k in ret if k[0] == task and k[1] == length and k in dret]
            if not keys:
                continue
            hit = sum(bool(ret[k]["exact"]) for k in keys)
            dhit = sum(bool(dret[k]["exact"]) for k in keys)
            # discordant pairs: what a paired test of the two policies rests on
            only_dense = sum(bool(dret[k]["exact"]) and not ret[k]["exact"] for k in keys)
            only_row = sum(bool(ret[k]["exact"]) and not dret[k]["exact"] for k in keys)
            out["retrieval"].setdefault(task, {})[str(length)] = dict(
                correct=hit, dense_correct=dhit, n=len(keys), acc=100.0 * hit / len(keys),
                dense_acc=100.0 * dhit / len(keys), points=100.0 * (hit - dhit) / len(keys),
                only_dense=only_dense, only_row=only_row)
    return out


def _len_label(n: int | str) -> str:
    n = int(n)
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def markdown(rows: dict[str, dict], lengths: list[str]) -> str:
    head = ["row"] + [f"loss {_len_label(L)}" for L in lengths] + \
        [f"{t} {'/'.join(_len_label(L) for L in lengths)}" for t in RETRIEVAL_TASKS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, c in rows.items():
        cells = [label]
        for L in lengths:
            e = c["loss"].get(L)
            cells.append("" if e is None else f"{e['loss']:.4f} ({100 * e['rel']:+.1f}%)")
        for t in RETRIEVAL_TASKS:
            by = c["retrieval"].get(t, {})
            cells.append("; ".join(f"{by[L]['correct']}/{by[L]['n']} (d {by[L]['dense_correct']})" if L in by else "-"
                                   for L in lengths))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: dict[str, dict], lengths: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 1 + len(RETRIEVAL_TASKS), figsize=(4.2 * (1 + len(RETRIEVAL_TASKS)), 3.6))
    xs = [int(L) for L in lengths]
    markers = "osD^vP*Xh"
    for i, (label, c) in enumerate(rows.items()):
        mk, off = markers[i % len(markers)], 1.0 + 0.02 * (i - len(rows) / 2)  # equal curves stay visible
        style = dict(color="black", ls="--", lw=1.2) if label == "dense" else {}
        pts = [(int(L), 100 * c["loss"][L]["rel"]) for L in lengths if L in c["loss"]]
        if pts:
            axes[0].plot([x * off for x, _ in pts], [y for _, y in pts], marker=mk, label=label, **style)
        for ax, t in zip(axes[1:], RETRIEVAL_TASKS):
            by = c["retrieval"].get(t, {})
            p = [(int(L), by[L]["acc"]) for L in lengths if L in by]
            if p:
                ax.plot([x * off for x, _ in p], [y for _, y in p], marker=mk, label=label, **style)
    axes[0].set_title("loss against dense (same documents)")
    axes[0].set_ylabel("%")
    axes[0].set_yscale("symlog", linthresh=2.0)
    axes[0].axhline(2.0, color="grey", lw=0.8, ls=":")
    for ax, t in zip(axes[1:], RETRIEVAL_TASKS):
        ax.set_title(f"{t}: exact match")
        ax.set_ylabel("%")
        ax.set_ylim(-5, 105)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [_len_label(x) for x in xs])
        ax.set_xlabel("context")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(6, len(labels)), fontsize=8)
    fig.tight_layout(rect=(0, 0.06 * (1 + (len(labels) - 1) // 6), 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dense", required=True, help="FOLDER:POLICY of the reference (usually ...:dense)")
    ap.add_argument("--row", action="append", default=[], metavar="LABEL=FOLDER:POLICY", help="a row (repeatable)")
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)
    try:
        if not args.row:
            raise ValueError("give at least one --row")
        dense = load(*parse_source(args.dense))
        rows: dict[str, dict] = {"dense": compare(dense, dense)}
        for spec in args.row:
            label, sep, src = spec.partition("=")
            if not sep or not label:
                raise ValueError(f"--row must be LABEL=FOLDER:POLICY, got {spec!r}")
            if label in rows:
                raise ValueError(f"--row label {label!r} repeats")
            rows[label] = compare(load(*parse_source(src)), dense)
    except ValueError as e:
        print(f"convert_table: {e}", file=sys.stderr)
        return 2
    lengths = sorted({L for c in rows.values() for L in c["loss"]} |
                     {L for c in rows.values() for by in c["retrieval"].values() for L in by}, key=int)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(markdown(rows, lengths))
    (args.out / "table.json").write_text(json.dumps(dict(dense=args.dense, rows=rows), indent=1) + "\n")
    plot(rows, lengths, args.out / "plot.png")
    print(markdown(rows, lengths), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
