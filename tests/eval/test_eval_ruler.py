"""RULER's tasks (msakit.eval.ruler): templates, sizes and answers on small stand-in data; RULER's
string-match scoring; greedy generation under policies with HF's cache equal to recomputing the
whole sequence; run_eval with RULER tasks (records, resume, standard errors, paired differences);
the real data when msakit[ruler] is installed."""

from __future__ import annotations

import json
import math
import re
import warnings

import pytest
import torch

from eval_fakes import BigramModel, tiny_tokenizer
from msakit.eval import EvalConfig, HFPolicyModel, make_policy, run_eval
from msakit.eval.generation import greedy_generate
from msakit.eval.ruler import (RULER_TASKS, RulerData, RulerGenerator, expand_tasks, postprocess, ruler_score)
from msakit.eval.ruler_report import summarize_ruler
from msakit.eval.scoring import model_logits
from msakit.ops.index_topk import Selection
from ruler_fakes import split_sentences, write_ruler_data

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_ruler_data(tmp_path_factory.mktemp("ruler_data"))


@pytest.fixture(scope="module")
def gen(data_dir):
    tok = tiny_tokenizer()
    enc = lambda t: tok.encode(t, add_special_tokens=False).ids  # noqa: E731
    return RulerGenerator(enc, RulerData.find([data_dir]), seed=0, split=split_sentences)


def test_scoring_is_rulers_string_match():
    assert ruler_score("  The answer: 123 and 456\x01", ["123", "456"], "all") == 1.0
    assert ruler_score("123", ["123", "456"], "all") == 0.5
    assert ruler_score("PARIS is it", ["paris", "Lyon"], "part") == 1.0
    assert ruler_score("nothing", ["paris", "Lyon"], "part") == 0.0
    assert postprocess(" a\tb\n") == "a\nb"
    with pytest.raises(ValueError, match="metric"):
        ruler_score("x", ["x"], "some")
    assert expand_tasks(["ruler", "ruler_vt", "vt", "loss"]) == list(RULER_TASKS) + ["vt", "loss"]


@pytest.mark.parametrize("task", RULER_TASKS)
def test_samples_fit_hold_their_answers_and_are_seeded(gen, task):
    L = 2048
    s = gen.sample(task, L, 0)
    assert len(s.input_ids) + s.tokens_to_generate <= L
    assert len(s.input_ids) + s.tokens_to_generate > 0.8 * L or task.startswith("qa")  # sizes are calibrated tight
    assert s.input_ids == gen.encode(s.text)
    again, other = gen.sample(task, L, 0), gen.sample(task, L, 1)
    assert again.text == s.text and again.outputs == s.outputs
    assert other.text != s.text
    body = s.text
    if task == "cwe":  # in the list after the worked example the 10 common words are the most frequent (6 x below 4K)
        entries = re.findall(r"\d+\. ([a-z]+)", body.split("Below is a numbered list")[2].split("Question:")[0])
        counts = {w: entries.count(w) for w in set(entries)}
        assert len(s.outputs) == 10 and all(counts[w] == 6 for w in s.outputs)
        assert all(c == 1 for w, c in counts.items() if w not in s.outputs)
    elif task == "fwe":
        words = body.split("coded words. ", 1)[1].split("\n", 1)[0].split()
        counts = {w: words.count(w) for w in set(words)}
        top = sorted(counts, key=counts.get, reverse=True)
        assert top[0] == "..." and set(s.outputs) == set(top[1:4])
    elif task == "ruler_vt":
        q = body.rsplit("Question:", 1)[0]
        value = body.rsplit("assigned the value ", 1)[1].split()[0]
        assert f"VAR {s.outputs[0]} = {value}" in q
        for a, b in zip(s.outputs, s.outputs[1:]):
            assert f"VAR {b} = VAR {a}" in q
        assert len(s.outputs) == 5
    elif task.startswith("qa"):
        assert body.endswith(" Answer:") and "Document 1:\n" in body
        assert any(o in body for o in s.outputs)
    else:  # niah: every asked value sits in a needle of the context
        for v in s.outputs:
            assert f" is: {v}." in body
        single = task.startswith("niah_single") or task.startswith("niah_multikey")
        assert body.startswith("A special magic") == single
        assert body.endswith("mentioned in the provided text is" if single else "mentioned in the provided text are")


def test_greedy_generate_with_cache_equals_recompute_under_policies():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(cfg).eval().double()
    m = HFPolicyModel(hf, block_size=8, topk=3, init_blocks=1)
    prompt = torch.randint(0, 97, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    for mode, pol in (("dense", None), ("sparse", "window0"), ("sparse", "oracle")):
        m.set_attention_mode(mode)
        m.set_selection_policy(make_policy(pol, Selection(8, 3)) if pol else None)
        cached = greedy_generate(m, prompt, 12)
        ids = list(prompt)
        for _ in range(12):  # the reference: the whole sequence under the policy at every step
            ids.append(int(model_logits(m, torch.tensor([ids]))[0, -1].argmax()))
        assert cached == ids[len(prompt):], (mode, pol)
    m.set_selection_policy(make_policy("window", Selection(8, 3)))
    assert len(greedy_generate(m, prompt, 12, stop=lambda new: len(new) == 3)) == 3


def test_greedy_generate_converted_model_with_msa_policy():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from msakit.models.convert import convert_dense_to_msa

    cfg = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    m = convert_dense_to_msa(Qwen2ForCausalLM(cfg).eval(), block_size=8, topk=3, init_blocks=1, seed=0,
                             dtype=torch.float64).eval()
    m.set_attention_mode("sparse")
    m.set_selection_policy(make_policy("msa", Selection(8, 3)))
    prompt = torch.randint(0, 97, (60,), generator=torch.Generator().manual_seed(2)).tolist()
    cached = greedy_generate(m, prompt, 10)
    ids = list(prompt)
    for _ in range(10):
        ids.append(int(model_logits(m, torch.tensor([ids]))[0, -1].argmax()))
    assert cached == ids[len(prompt):]


def test_run_eval_ruler_records_resume_and_report(data_dir, tmp_path):
    tok = tiny_tokenizer()
    model = BigramModel(tok.get_vocab_size())
    cfg = EvalConfig(tasks=["niah_single_1", "qa_1"], lengths=[2048], policies=["dense", "last1024"], samples=1,
                     ruler_samples=2, ruler_data=[str(data_dir)])
    assert cfg.identity()["ruler_version"] >= 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = run_eval(model, tok, cfg, tmp_path / "r", progress=False)
        recs = [json.loads(x) for x in (tmp_path / "r" / "results.jsonl").read_text().splitlines()]
        assert len(recs) == 2 * 2 * 2 and {r["task"] for r in recs} == {"niah_single_1", "qa_1"}
        for r in recs:
            assert r["score"] == ruler_score(r["pred"], r["outputs"], r["metric"])
            assert r["prompt_tokens"] <= (2048 if r["policy"] == "dense" else 1024) - 1
        logs = []
        run_eval(model, tok, cfg, tmp_path / "r", progress=False, log=logs.append)  # resumed: nothing to do
    assert logs[0].startswith("0 samples to run")
    cell = s["ruler"]["scores"]["dense"]["qa_1"]["2048"]
    assert cell["n"] == 2 and math.isclose(cell["se"], math.sqrt(cell["score"] * (1 - cell["score"]) / 2))
    assert "average" in s["ruler"]["scores"]["dense"] and "last1024" in s["ruler"]["vs_dense"]
    assert "±" in (tmp_path / "r" / "table.md").read_text() and (tmp_path / "r" / "ruler.png").is_file()


def test_summary_errors_and_paired_differences():
    cfg = EvalConfig(tasks=["ruler_vt", "cwe"], lengths=[4096], policies=["dense", "msa"], ruler_samples=4)
    recs = []
    for i, (d, m) in enumerate([(1, 1), (1, 0), (0, 0), (1, 1)]):
        recs.append(dict(policy="dense", task="ruler_vt", length=4096, index=i, score=d))
        recs.append(dict(policy="msa", task="ruler_vt", length=4096, index=i, score=m))
    for i in range(4):
        recs.append(dict(policy="dense", task="cwe", length=4096, index=i, score=0.5))
        recs.append(dict(policy="msa", task="cwe", length=4096, index=i, score=0.5))
    recs.append(dict(policy="msa", task="ruler_vt", length=4096, index=9, score=1))  # past ruler_samples: ignored
    rs = summarize_ruler(recs, cfg)
    vt = rs["scores"]["dense"]["ruler_vt"]["4096"]
    assert vt == dict(score=0.75, se=math.sqrt(0.75 * 0.25 / 4), n=4)
    diff = rs["vs_dense"]["msa"]["ruler_vt"]["4096"]  # differences 0, -1, 0, 0
    assert diff["score"] == -0.25 and math.isclose(diff["se"], math.sqrt(0.25 / 4))
    avg = rs["scores"]["msa"]["average"]["4096"]
    assert avg["score"] == (0.5 + 0.5) / 2 and avg["tasks"] == 2


def test_missing_data_names_the_install():
    with pytest.raises(FileNotFoundError, match="msakit\\[ruler\\]"):
        RulerData.find(["/nonexistent-folder"])


def test_real_data_when_installed():
    pytest.importorskip("long_context_eval")
    pytest.importorskip("wonderwords")
    pytest.importorskip("punkt")
    tok = tiny_tokenizer()
    g = RulerGenerator(lambda t: tok.encode(t, add_special_tokens=False).ids, RulerData.find(), seed=0)
    for task in RULER_TASKS:
        s = g.sample(task, 8192, 0)  # the tiny tokenizer spends ~2x Qwen's tokens on a text
        assert len(s.input_ids) + s.tokens_to_generate <= 8192 and s.outputs
    assert g.data.squad[0][0]["outputs"] and len(g.data.hotpotqa[1]) > 1000
