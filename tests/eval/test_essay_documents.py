"""tools/essay_documents.py: RULER's essays cut into long documents for `msakit eval --docs`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tools.essay_documents import essay_parts, main  # noqa: E402
from msakit.eval.documents import long_documents  # noqa: E402
from msakit.eval.ruler import DATA_FILES  # noqa: E402


def test_parts_cut_at_line_breaks_and_rejoin():
    text = "".join(f"line {i} " + "x" * (i % 7) + "\n" for i in range(200)) + "tail without newline"
    parts = essay_parts(text, 50)
    assert "".join(parts) == text
    assert all(p.endswith("\n") for p in parts[:-1]) and all(len(p) >= 50 for p in parts[:-1])
    assert essay_parts("", 10) == []


def test_cli_writes_parts_that_eval_reads(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    for name in DATA_FILES:
        (data / name).write_text("word\n")
    text = "".join(f"Essay sentence number {i}.\n" for i in range(400))
    (data / "PaulGrahamEssays.json").write_text(json.dumps({"text": text}))
    out = tmp_path / "docs"
    assert main(["--out", str(out), "--chars", "2000", "--ruler-data", str(data)]) == 0
    files = sorted(out.iterdir())
    assert len(files) > 3 and "".join(f.read_text() for f in files) == text
    docs = long_documents(lambda s: s.split(), 300, 2, paths=[out])
    assert len(docs) == 2 and all(len(d.ids) == 300 for d in docs)
    assert main(["--out", str(out), "--ruler-data", str(data)]) == 2  # not empty: nothing overwritten
    assert "not empty" in capsys.readouterr().err
    assert main(["--out", str(tmp_path / "x"), "--ruler-data", str(tmp_path / "none")]) == 2
    assert main(["--out", str(tmp_path / "y"), "--chars", "0", "--ruler-data", str(data)]) == 2
