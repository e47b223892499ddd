"""Plot and tabulate `benchmarks/spec.py` results (issue: DSpark drafter and lossless speculative decoding).

    python benchmarks/spec_report.py                       # the committed H200 runs (15-17)
    python benchmarks/spec_report.py --ablation A.json --speed B.json --out spec.png

Left: per-position acceptance in real decoding (P(draft k accepted | drafts < k accepted), held-out
prompts, block of 7) of DSpark and of the same drafter without the Markov head, at temperature 0
and 1 (the `acceptance` rows of the ablation run, confidence budget off).  Right: where a round's
time goes (`round_breakdown` of the speed run, CUDA-graph replays): the drafter block, the
engine's target forward over 8 positions, the whole round, and `model.generate`'s paged step (the
plain token) at batch 1 and 8.  Prints the speed table of the speed run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ablation", default=str(RESULTS / "spec_NVIDIA_H200_run16_ablation.json"))
    ap.add_argument("--speed", default=str(RESULTS / "spec_NVIDIA_H200_run17.json"))
    ap.add_argument("--out", default=str(RESULTS / "spec_NVIDIA_H200_report.png"))
    args = ap.parse_args()
    abl = json.loads(Path(args.ablation).read_text())
    spd = json.loads(Path(args.speed).read_text())
    rows = [r for r in abl["acceptance"] if r["confidence_budget"] == "off"]
    if not rows:
        raise ValueError(f"{args.ablation} has no acceptance rows with the confidence budget off")
    brk = spd.get("round_breakdown")
    if not brk:
        raise ValueError(f"{args.speed} has no round_breakdown (a CUDA run of spec.py writes it)")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a0, a1) = plt.subplots(1, 2, figsize=(12, 4.5))
    style = {"dspark": "-", "no_markov": "--"}
    color = {0.0: "tab:blue", 1.0: "tab:red"}
    for r in rows:
        pos = [x for x in r["position_acceptance"] if x is not None]
        a0.plot(range(1, len(pos) + 1), pos, style.get(r["drafter"], ":"), color=color.get(r["temperature"], "k"),
                marker="o", label=f"{r['drafter']} T={r['temperature']:g} (acc. len {r['accepted_length']:.2f})")
    a0.set_xlabel("draft position k")
    a0.set_ylabel("P(draft k accepted | drafts < k accepted)")
    a0.set_ylim(0, 1)
    a0.set_title("acceptance per position (held-out prompts, block 7)")
    a0.legend(fontsize=8)
    parts = [("drafter_block_ms", "drafter block"), ("target_w8_ms", "target fwd, 8 pos."),
             ("fused_round_ms", "whole round"), ("paged_step_nq1_ms", "plain token (paged step)"),
             ("paged_step_nq8_ms", "paged step, 8 new")]
    width = 0.8 / len(brk)
    for i, b in enumerate(brk):
        xs = [j + i * width for j in range(len(parts))]
        vals = [b.get(k, float("nan")) for k, _ in parts]
        a1.bar(xs, vals, width, label=f"B={b['batch']}")
        for x, v in zip(xs, vals):
            a1.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
    a1.set_xticks([j + 0.4 - width / 2 for j in range(len(parts))])
    a1.set_xticklabels([n for _, n in parts], rotation=20, fontsize=8)
    a1.set_ylabel("ms per call (CUDA-graph replay)")
    a1.set_title(f"where a round goes ({spd['env'].get('gpu', '?')})")
    a1.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")

    print(f"\nspeed ({Path(args.speed).name}): decode tokens/s over whole generations (prefill and graph captures "
          f"excluded; end to end includes them)")
    print(f"{'B':>3s} {'T':>4s} {'plain':>8s} {'spec':>8s} {'speedup':>8s} {'e2e':>6s} {'acc.len':>8s} "
          f"{'round ms':>9s} {'plain ms':>9s}")
    for r in spd["speed"]:
        print(f"{r['batch']:3d} {r['temperature']:4.1f} {r['plain_tok_s']:8.1f} {r['spec_tok_s']:8.1f} "
              f"{r['speedup_vs_generate']:7.2f}x {r['speedup_vs_generate_e2e']:5.2f}x {r['accepted_length']:8.2f} "
              f"{r.get('ms_per_spec_round', float('nan')):9.2f} {r.get('ms_per_plain_token', float('nan')):9.2f}")


if __name__ == "__main__":
    main()
