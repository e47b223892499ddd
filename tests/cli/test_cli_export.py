"""`msakit export`: a run's newest checkpoint as a model folder that generate reads; a damaged
source, a drafter or an --out holding anything is refused in one line, nothing written."""

from __future__ import annotations

import torch

from cli_helpers import one_line_error, tree_state
from msakit.cli import main
from msakit.models import M3ForCausalLM

from test_cli_hostile_folders import hostile  # noqa: F401  (the damaged model folders)


def test_export_a_run_and_generate_from_it(run_dir, tmp_path, capsys):
    out = tmp_path / "model"
    before = tree_state(run_dir)
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    assert tree_state(run_dir) == before
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    a = M3ForCausalLM.from_pretrained(out)
    b = M3ForCausalLM.from_pretrained(run_dir / "checkpoints" / "step-00000004")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    capsys.readouterr()
    assert main(["generate", str(out), "--prompt", "def", "--max-new-tokens", "3", "--temperature", "0",
                 "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("def")


def test_export_refusals(run_dir, drafter_run, hostile, tmp_path, capsys):  # noqa: F811
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("a user's file")
    for argv, word in ((["export", str(run_dir), "--out", str(full)], "not empty"),
                       (["export", str(hostile["truncated"]), "--out", str(tmp_path / "a")], "model.safetensors"),
                       (["export", str(hostile["nan"]), "--out", str(tmp_path / "b")], "NaN"),
                       (["export", str(drafter_run), "--out", str(tmp_path / "c")], "drafter"),
                       (["export", str(tmp_path / "missing"), "--out", str(tmp_path / "d")], "not found")):
        before = {p: tree_state(p) for p in (run_dir, full, hostile["truncated"], drafter_run)}
        err = one_line_error(capsys, main(argv))
        assert word in err, err
        assert {p: tree_state(p) for p in before} == before
    assert not any((tmp_path / x).exists() for x in "abcd")
