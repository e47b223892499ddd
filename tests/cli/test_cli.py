"""`msakit train | convert | generate`: a tiny end-to-end run, resume, and bad input -> one line, exit 2."""

from __future__ import annotations

import json

import pytest

from cli_helpers import common as _common
from cli_helpers import one_line_error as _one_line_error
from cli_helpers import tree_state as _tree_hash
from msakit.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


def test_train_resume_and_generate(env, copy_run, capsys):
    run_dir = copy_run
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if r["kind"] == "train"] == [1, 2, 3, 4]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-00000004"
    assert (run_dir / "tokenizer.json").is_file() and (run_dir / "loss.png").is_file()
    capsys.readouterr()
    rc = main(["train", "--resume", "--steps", "6", "--out", str(run_dir), "--no-progress", "--cache-dir", env["cache"]])
    assert rc == 0
    assert "resumed" in capsys.readouterr().out
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6]
    rc = main(["generate", str(run_dir), "--prompt", "def f(x):", "--max-new-tokens", "12", "--seed", "1",
               "--temperature", "0.9", "--top-k", "20", "--top-p", "0.95", "--device", "cpu"])
    assert rc == 0
    text = capsys.readouterr().out
    assert text.startswith("def f(x):") and len(text) > len("def f(x):")
    main(["generate", str(run_dir), "--prompt", "def f(x):", "--max-new-tokens", "12", "--seed", "1",
          "--temperature", "0.9", "--top-k", "20", "--top-p", "0.95", "--device", "cpu"])
    assert capsys.readouterr().out == text  # same seed, same text


def test_bad_input_exits_2_with_one_line(env, copy_run, tmp_path, capsys):
    run_dir = copy_run
    before = _tree_hash(run_dir)
    # missing data path
    _one_line_error(capsys, main(["train", "--config", env["config"], *_common(env, tmp_path / "a"),
                                  "--data", str(tmp_path / "missing")]))
    # empty corpus
    (tmp_path / "empty").mkdir()
    err = _one_line_error(capsys, main(["train", "--config", env["config"], "--out", str(tmp_path / "b"),
                                        "--no-stdlib", "--data", str(tmp_path / "empty"), "--no-progress",
                                        "--context", "64"]))
    assert "empty corpus" in err
    # a context longer than the model's positions (toy: 256)
    err = _one_line_error(capsys, main(["train", "--config", env["config"], *_common(env, tmp_path / "c"),
                                        "--context", "512"]))
    assert "max_position_embeddings" in err
    # an unsupported config
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "minimax_m3", "hidden_size": 32,
                                                 "num_attention_heads": 3, "num_key_value_heads": 2}))
    _one_line_error(capsys, main(["train", "--config", str(bad), *_common(env, tmp_path / "d")]))
    # a run folder that already holds a run is not overwritten
    err = _one_line_error(capsys, main(["train", "--config", env["config"], *_common(env, run_dir)]))
    assert "--resume" in err
    # a corrupt checkpoint: resume and generate refuse, nothing changes
    ck = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    st = ck / "trainer_state.json"
    good = st.read_bytes()
    st.write_bytes(good.replace(b'"step"', b'"stpe"', 1))
    try:
        before = _tree_hash(run_dir)
        err = _one_line_error(capsys, main(["train", "--resume", "--out", str(run_dir), "--cache-dir", env["cache"]]))
        assert "corrupt" in err
        _one_line_error(capsys, main(["generate", str(run_dir), "--max-new-tokens", "2"]))
        assert _tree_hash(run_dir) == before
    finally:
        st.write_bytes(good)
    # missing checkpoint, bad sampling settings
    _one_line_error(capsys, main(["generate", str(tmp_path / "nope")]))
    _one_line_error(capsys, main(["generate", str(run_dir), "--top-p", "1.5"]))
    _one_line_error(capsys, main(["convert", str(tmp_path / "nope"), "--out", str(tmp_path / "e")]))
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists() and not (tmp_path / "e").exists()
