"""tools/convert_table.py: rows compared with dense on the samples both have."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "convert_table.py"


@pytest.fixture()
def tool():
    spec = importlib.util.spec_from_file_location("convert_table_tool", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write(folder: Path, records: list[dict]) -> Path:
    folder.mkdir(parents=True)
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def loss(policy, doc, nll_sum, tokens, length=4096):
    return dict(policy=policy, task="loss", length=length, depth=None, index=0, doc=doc, nll_sum=nll_sum,
                tokens=tokens, buckets={})


def hit(policy, index, exact, depth=0.5, task="niah", length=4096):
    return dict(policy=policy, task=task, length=length, depth=depth, index=index, exact=exact)


def test_rows_compare_on_shared_samples(tool, tmp_path, capsys):
    base = write(tmp_path / "base", [
        loss("dense", "a", 10.0, 10), loss("dense", "b", 30.0, 10),
        hit("dense", 0, True), hit("dense", 1, True), hit("dense", 2, False), hit("dense", 3, True)])
    # the row has document a only and samples 0..2: dense is taken on the same ones
    warm = write(tmp_path / "warm", [
        loss("msa", "a", 11.0, 10), hit("msa", 0, True), hit("msa", 1, False), hit("msa", 2, True)])
    out = tmp_path / "table"
    assert tool.main(["--dense", f"{base}:dense", "--row", f"warm={warm}:msa", "--out", str(out)]) == 0
    t = json.loads((out / "table.json").read_text())["rows"]["warm"]
    e = t["loss"]["4096"]
    assert e["docs"] == 1 and e["loss"] == pytest.approx(1.1) and e["dense"] == pytest.approx(1.0)
    assert e["rel"] == pytest.approx(0.1)
    r = t["retrieval"]["niah"]["4096"]
    assert (r["correct"], r["dense_correct"], r["n"], r["only_dense"], r["only_row"]) == (2, 2, 3, 1, 1)
    md = (out / "table.md").read_text()
    assert "| warm | 1.1000 (+10.0%) |" in md and "2/3 (d 2)" in md
    assert (out / "plot.png").stat().st_size > 0


def test_bad_sources_exit_2(tool, tmp_path, capsys):
    base = write(tmp_path / "base", [loss("dense", "a", 1.0, 1)])
    assert tool.main(["--dense", f"{base}:dense", "--row", f"x={tmp_path / 'missing'}:msa", "--out",
                      str(tmp_path / "o")]) == 2
    assert "holds no results.jsonl" in capsys.readouterr().err
    assert tool.main(["--dense", f"{base}:dense", "--row", f"x={base}:oracle", "--out", str(tmp_path / "o")]) == 2
    assert "no records of policy 'oracle'" in capsys.readouterr().err
    assert tool.main(["--dense", f"{base}:dense", "--row", f"nolabel{base}", "--out", str(tmp_path / "o")]) == 2
    assert not (tmp_path / "o").exists()
