"""`msakit train | convert | generate`: a tiny end-to-end run, resume, and bad input -> one line, exit 2."""

from __future__ import annotations

import hashlib
import json
import sysconfig
from pathlib import Path

import pytest

from msakit.cli import main

from toy_model import toy_config

pytestmark = pytest.mark.usefixtures("one_thread")


STDLIB = Path(sysconfig.get_paths()["stdlib"])
FILES = ["json/decoder.py", "json/encoder.py", "textwrap.py", "fnmatch.py", "bisect.py", "heapq.py", "glob.py",
         "colorsys.py"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    data = root / "data"
    data.mkdir()
    for n in FILES:
        (data / n.replace("/", "_")).write_text((STDLIB / n).read_text())
    cfg_dir = root / "toy"
    toy_config(300).save(cfg_dir)
    dense_dir = root / "toy_dense"
    toy_config(300, sparse_attention_freq=[0, 0]).save(dense_dir)
    return {"root": root, "data": str(data), "config": str(cfg_dir), "dense_config": str(dense_dir),
            "cache": str(root / "cache")}


def _common(env, out, *extra):
    return ["--out", str(out), "--no-stdlib", "--data", env["data"], "--vocab-size", "300", "--context", "64",
            "--cache-dir", env["cache"], "--batch-size", "2", "--lr-warmup-steps", "1", "--log-every", "1",
            "--eval-every", "4", "--eval-rows", "4", "--no-progress", "--val-fraction", "0.15", *extra]


def _tree_hash(p: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(x for x in p.rglob("*") if x.is_file()):
        h.update(str(f.relative_to(p)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def _one_line_error(capsys, rc) -> str:
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "error:" in err, err
    return err


@pytest.fixture(scope="module")
def run_dir(env):
    out = env["root"] / "run"
    rc = main(["train", "--config", env["config"], "--steps", "4", "--warmup-steps", "2", "--save-every", "2",
               *_common(env, out)])
    assert rc == 0
    return out


def test_train_resume_and_generate(env, run_dir, capsys):
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if r["kind"] == "train"] == [1, 2, 3, 4]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-00000004"
    assert (run_dir / "tokenizer.json").is_file() and (run_dir / "loss.png").is_file()
    capsys.readouterr()
    rc = main(["train", "--resume", "--steps", "6", *_common(env, run_dir)])
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


def test_convert_dense_checkpoint(env, capsys):
    dense = env["root"] / "dense"
    assert main(["train", "--config", env["dense_config"], "--steps", "2", "--warmup-steps", "2",
                 *_common(env, dense)]) == 0
    conv = env["root"] / "conv"
    rc = main(["convert", str(dense), "--steps", "4", "--warmup-steps", "2", "--block-size", "8", "--topk", "2",
               "--index-dim", "8", *[a for a in _common(env, conv) if a not in ("--vocab-size", "300")]])
    assert rc == 0
    out = capsys.readouterr().out
    assert "converted" in out and "after conversion" in out
    cfg = json.loads((conv / "checkpoints" / "step-00000004" / "config.json").read_text())
    assert json.dumps(cfg).count("sparse") > 0
    recs = [json.loads(x) for x in (conv / "metrics.jsonl").read_text().splitlines() if '"train"' in x]
    assert [r["mode"] for r in recs] == ["dense", "dense", "sparse", "sparse"]


def test_bad_input_exits_2_with_one_line(env, run_dir, tmp_path, capsys):
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
        err = _one_line_error(capsys, main(["train", "--resume", *_common(env, run_dir)]))
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
