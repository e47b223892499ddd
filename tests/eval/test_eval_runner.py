"""The eval loop on fake models: policies reach the model through its hook, results are
appended per sample and a rerun skips the finished ones; the report files."""

from __future__ import annotations

import json

import pytest
import torch

from eval_fakes import PlainModel, PolicyModel
from msakit.ops.index_topk import Selection
from msakit.eval import EvalConfig, make_sample, read_records, run_eval
from msakit.eval.scoring import answer_scores, model_logits

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture()
def docs(tmp_path):
    d = tmp_path / "docs"
    d.mkdir()
    import sysconfig
    from pathlib import Path

    std = Path(sysconfig.get_paths()["stdlib"])
    for n in ("textwrap.py", "fnmatch.py", "bisect.py"):
        (d / n).write_text((std / n).read_text())
    return str(d)


def _cfg(docs, **kw):
    base = dict(tasks=["loss", "passkey", "vt"], lengths=[512, 768], depths=[0.2, 0.8],
                policies=["dense", "last400", "window", "window0", "oracle", "msa"], budget=Selection(16, 4),
                samples=2, seed=0, documents=[docs])
    base.update(kw)
    return EvalConfig(**base)


def test_run_resume_and_report(tok, docs, tmp_path):
    model = PolicyModel(tok.get_vocab_size(), block_size=16, topk=2)
    cfg = _cfg(docs)
    out = tmp_path / "out"
    summary = run_eval(model, tok, cfg, out, progress=False)
    recs = read_records(out / "results.jsonl")
    n_ret = 6 * 2 * 2 * 2 * 2  # policies x tasks x lengths x depths x samples
    n_loss = 6 * 2 * 2
    assert len(recs) == n_ret + n_loss and len({r["key"] for r in recs}) == len(recs)
    # sparse policies were called through the hook with the layer's tensors, at the budget
    assert model.policy_calls and all(shape[-1] == 4 for _, shape in model.policy_calls)
    assert {r["selection"] for r in recs if r["policy"] in ("window", "oracle", "msa")} == {"policy"}
    assert model.mode == "dense" and model.policy is None  # restored
    for f in ("summary.json", "table.md", "plot.png", "settings.json"):
        assert (out / f).is_file()
    table = (out / "table.md").read_text()
    assert "| oracle |" in table and "loss 512" in table and "passkey 768" in table
    assert set(summary["loss"]) == set(cfg.policies)
    s = summary["retrieval"]["dense"]["passkey"]["512"]
    assert s["n"] == 4 and 0.0 <= s["accuracy"] <= 1.0
    # a record equals a direct teacher-forced scoring of its sample under the same policy
    r = next(x for x in recs if x["policy"] == "dense" and x["task"] == "vt" and x["length"] == 768)
    smp = make_sample(tok, "vt", 768, r["depth"], r["index"], seed=0)
    ids = torch.tensor([smp.input_ids])
    with torch.no_grad():
        (sc,) = answer_scores(model_logits(model, ids), ids, [smp.answer_start])
    assert sc["exact"] == r["exact"] and sc["pred"] == r["pred"]

    # rerun: nothing left to do, no forward
    model.forwards = 0
    run_eval(model, tok, cfg, out, progress=False)
    assert model.forwards == 0 and len(read_records(out / "results.jsonl")) == len(recs)

    # drop two records (and tear the last line): exactly those are redone
    lines = (out / "results.jsonl").read_text().splitlines()
    kept = lines[:5] + lines[7:]
    (out / "results.jsonl").write_text("\n".join(kept) + "\n" + kept[-1][:10])
    model.forwards = 0
    run_eval(model, tok, cfg, out, progress=False)
    again = read_records(out / "results.jsonl")
    assert len({r["key"] for r in again}) == len(recs) and model.forwards >= 2
    # a new policy adds only its own samples
    model.forwards = 0
    cfg2 = _cfg(docs, policies=["dense", "last400", "window", "window0", "oracle", "msa", "last256"])
    run_eval(model, tok, cfg2, out, progress=False)
    assert len({r["key"] for r in read_records(out / "results.jsonl")}) == len(recs) + 16 + 4


def test_settings_mismatch_refused(tok, docs, tmp_path):
    model = PolicyModel(tok.get_vocab_size())
    out = tmp_path / "o"
    cfg = _cfg(docs, tasks=["passkey"], lengths=[512], depths=[0.5], policies=["dense"], samples=1)
    run_eval(model, tok, cfg, out, progress=False)
    with pytest.raises(ValueError, match="other settings"):
        run_eval(model, tok, _cfg(docs, tasks=["passkey"], lengths=[512], depths=[0.5], policies=["dense"],
                                  samples=1, seed=1), out, progress=False)


def test_last_n_loss_is_strided_truncation(tok, docs, tmp_path):
    """last<N> loss: every scored token sees N/2 .. N - 1 tokens; with N >= length it equals dense."""
    model = PolicyModel(tok.get_vocab_size())
    cfg = _cfg(docs, tasks=["loss"], lengths=[512], policies=["dense", "last512", "last128"], samples=1)
    s = run_eval(model, tok, cfg, tmp_path / "l", progress=False)["loss"]
    assert s["last512"]["512"]["loss"] == pytest.approx(s["dense"]["512"]["loss"], rel=1e-6)
    assert s["last128"]["512"]["tokens"] == 511
    assert s["last128"]["512"]["buckets"]["0-512"] != s["dense"]["512"]["buckets"]["0-512"]


def test_plain_model_dense_only(tok, docs, tmp_path):
    model = PlainModel(tok.get_vocab_size())
    cfg = _cfg(docs, tasks=["passkey"], lengths=[512], depths=[0.5], policies=["dense", "window"], samples=1)
    with pytest.raises(ValueError, match="sparse attention"):
        run_eval(model, tok, cfg, tmp_path / "p", progress=False)
    assert not (tmp_path / "p").exists()  # refused before any work
    cfg = _cfg(docs, tasks=["passkey"], lengths=[512], depths=[0.5], policies=["dense", "last300"], samples=1)
    run_eval(model, tok, cfg, tmp_path / "p", progress=False)
    assert [r["policy"] for r in read_records(tmp_path / "p" / "results.jsonl")] == ["dense", "last300"]


def test_msa_without_hook_uses_model_selection(tok, docs, tmp_path):
    class NoHook(PolicyModel):
        set_selection_policy = None

    model = NoHook(tok.get_vocab_size())
    cfg = _cfg(docs, tasks=["passkey"], lengths=[512], depths=[0.5], policies=["msa"], samples=1)
    run_eval(model, tok, cfg, tmp_path / "n", progress=False)
    (r,) = read_records(tmp_path / "n" / "results.jsonl")
    assert r["selection"] == "model" and not model.policy_calls


def test_config_validation(docs):
    for bad, match in ((dict(tasks=["qa"]), "task"), (dict(lengths=[10]), "lengths"), (dict(depths=[2.0]), "depths"),
                       (dict(policies=["dense", "dense"]), "repeat"), (dict(policies=["lastx"]), "policy"),
                       (dict(samples=0), "samples")):
        with pytest.raises(ValueError, match=match):
            _cfg(docs, **bad)


def test_summary_json_roundtrip(tok, docs, tmp_path):
    model = PolicyModel(tok.get_vocab_size())
    cfg = _cfg(docs, tasks=["niah"], lengths=[512], depths=[0.5], policies=["dense", "oracle"], samples=2)
    run_eval(model, tok, cfg, tmp_path / "s", progress=False)
    summ = json.loads((tmp_path / "s" / "summary.json").read_text())
    assert summ["settings"]["budget"] == "block16-top4"
    assert set(summ["retrieval"]) == {"dense", "oracle"}
