"""Task generators: exact lengths, the answer at the end, the needle at the requested depth, seeded."""

from __future__ import annotations

import pytest

from msakit.eval import make_sample, make_samples
from msakit.eval.tasks import NOISE, encoder


@pytest.mark.parametrize("task", ["passkey", "niah", "vt"])
@pytest.mark.parametrize("length", [500, 777, 2048])
def test_length_exact_and_answer_last(tok, task, length):
    s = make_sample(tok, task, length, 0.5, 0, seed=3)
    assert len(s.input_ids) == length
    enc = encoder(tok)
    assert s.answer_ids == enc(s.answer)
    assert s.input_ids[s.answer_start:] == s.answer_ids
    assert tok.decode(s.answer_ids) == s.answer


@pytest.mark.parametrize("task", ["passkey", "niah", "vt"])
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_needle_at_depth(tok, task, depth):
    s = make_sample(tok, task, 3000, depth, 1, seed=0)
    enc = encoder(tok)
    if task == "passkey":
        needles = [enc(f"The pass key is {s.meta['key']}. Remember it. {s.meta['key']} is the pass key.\n")]
    elif task == "niah":
        needles = [enc(f"One of the special magic numbers for {k} is: {v}.\n")
                   for k, v in [(s.meta["key"], s.meta["value"])] + list(s.meta["distractors"].items())]
    else:
        names = s.meta["variables"]
        needles = [enc(f"VAR {names[0]} = {s.meta['value']}.\n")] + [
            enc(f"VAR {b} = VAR {a}.\n") for a, b in zip(names[:-1], names[1:])]
    p = s.needle_pos
    assert s.input_ids[p:p + len(needles[0])] == needles[0]
    h0, h1 = s.haystack
    assert 0 < h0 <= p < h1 <= s.answer_start
    # depth is measured on the noise: the needle starts within half a noise paragraph of
    # depth * noise tokens, plus the other needles that may precede it
    noise = (h1 - h0) - sum(len(n) for n in needles)
    before_noise = (p - h0) - sum(len(n) for n in needles[1:])
    unit = len(enc(NOISE))
    assert before_noise - unit / 2 - 1 <= depth * noise <= (p - h0) + unit / 2 + 1
    if task == "vt":
        stmts = s.meta["statement_pos"]
        assert stmts == sorted(stmts) and stmts[0] == p
        for pos, n in zip(stmts, needles):
            assert s.input_ids[pos:pos + len(n)] == n


def test_niah_distractors_present_and_distinct(tok):
    s = make_sample(tok, "niah", 2000, 0.3, 2, seed=5, num_needles=4)
    text = tok.decode(s.input_ids)
    assert len(s.meta["distractors"]) == 3 and s.meta["key"] not in s.meta["distractors"]
    for k, v in s.meta["distractors"].items():
        assert f"One of the special magic numbers for {k} is: {v}." in text
    assert text.count(f"for {s.meta['key']} is: {s.meta['value']}.") == 1


def test_vt_chain_in_order(tok):
    s = make_sample(tok, "vt", 2500, 0.2, 0, seed=1, hops=3)
    names, text = s.meta["variables"], tok.decode(s.input_ids)
    assert len(names) == 4 and s.answer == " " + " ".join(names)
    pos = [text.index(f"VAR {b} = VAR {a}.") for a, b in zip(names[:-1], names[1:])]
    assert text.index(f"VAR {names[0]} = {s.meta['value']}.") < pos[0] and pos == sorted(pos)


def test_seeded_determinism(tok):
    a = make_samples(tok, "niah", 600, 0.5, 3, seed=7)
    b = [make_sample(tok, "niah", 600, 0.5, i, seed=7) for i in (2, 1, 0)][::-1]
    assert [x.input_ids for x in a] == [x.input_ids for x in b]
    c = make_samples(tok, "niah", 600, 0.5, 3, seed=8)
    assert [x.input_ids for x in a] != [x.input_ids for x in c]
    assert len({tuple(x.input_ids) for x in a}) == 3  # samples of one cell differ


def test_bad_arguments(tok):
    with pytest.raises(ValueError, match="task"):
        make_sample(tok, "qa", 512, 0.5, 0)
    with pytest.raises(ValueError, match="depth"):
        make_sample(tok, "passkey", 512, 1.5, 0)
    with pytest.raises(ValueError, match="too short"):
        make_sample(tok, "vt", 64, 0.5, 0)
    with pytest.raises(ValueError, match="tokenizer"):
        make_sample(object(), "passkey", 512, 0.5, 0)
