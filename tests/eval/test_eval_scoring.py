"""Teacher-forced exact match equals greedy decoding; per-token NLL and position buckets."""

from __future__ import annotations

import pytest
import torch

from eval_fakes import BigramModel
from msakit.eval import answer_scores, bucket_edges, bucket_sums, model_logits, token_nll
from msakit.eval.scoring import bucket_label, bucket_start


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):  # recompute the whole forward every token
        logits = model_logits(model, torch.tensor([ids]))
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_teacher_forced_equals_greedy():
    V = 23
    model = BigramModel(V, seed=0)
    g = torch.Generator().manual_seed(0)
    hits = 0
    for trial in range(12):
        prompt = torch.randint(0, V, (15,), generator=g).tolist()
        greedy = _greedy(model, prompt, 4)
        answer = list(greedy)
        if trial % 2:  # half the trials: a wrong answer token somewhere
            j = trial % 4
            answer[j] = (answer[j] + 1) % V
        ids = torch.tensor([prompt + answer])
        (sc,) = answer_scores(model_logits(model, ids), ids, [len(prompt)])
        assert sc["exact"] == (answer == greedy)
        assert sc["answer_tokens"] == 4 and sc["pred"][:1] == greedy[:1]
        if answer == greedy:
            assert sc["correct"] == 4 and sc["pred"] == greedy
        hits += sc["exact"]
    assert hits == 6


def test_answer_scores_batch_and_nll():
    V, T = 11, 9
    logits = torch.full((2, T, V), -5.0)
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))
    for t in range(T - 1):
        logits[0, t, ids[0, t + 1]] = 5.0  # row 0 predicts every next token
    logits[1, :, 0] = 5.0  # row 1 always predicts token 0
    ids[1, 6:] = torch.tensor([0, 3, 0])
    res = answer_scores(logits, ids, [6, 6])
    assert res[0]["exact"] and res[0]["correct"] == 3
    assert not res[1]["exact"] and res[1]["correct"] == 2
    ref = torch.nn.functional.cross_entropy(logits[0, 5:8], ids[0, 6:9])
    assert res[0]["nll"] == pytest.approx(float(ref), rel=1e-6)
    with pytest.raises(ValueError, match="answer_start"):
        answer_scores(logits, ids, [0, 6])
    with pytest.raises(ValueError, match="one entry per row"):
        answer_scores(logits, ids, [6])


def test_token_nll_matches_unchunked():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 50, 17, generator=g)
    ids = torch.randint(0, 17, (2, 50), generator=g)
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 17), ids[:, 1:].reshape(-1),
                                            reduction="none").view(2, 49)
    got = token_nll(logits, ids, chunk=7)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)


def test_buckets():
    assert bucket_edges(4096) == [0, 512, 1024, 2048, 4096]
    assert bucket_edges(3000) == [0, 512, 1024, 2048, 3000]
    nll = torch.arange(10, dtype=torch.float32)
    pos = torch.arange(1, 11)
    b = bucket_sums(nll, pos, [0, 4, 8, 11])
    assert b == {"0-4": [0 + 1 + 2, 3], "4-8": [3 + 4 + 5 + 6, 4], "8-11": [7 + 8 + 9, 3]}
    labels = [bucket_label(lo, hi) for lo, hi in zip(bucket_edges(8192)[:-1], bucket_edges(8192)[1:])]
    assert labels == ["0-512", "512-1K", "1K-2K", "2K-4K", "4K-8K"]
    assert sorted(sorted(labels), key=bucket_start) == labels


def test_model_logits_checks_shape():
    class Bad(torch.nn.Module):
        def forward(self, input_ids):
            return torch.zeros(3)

    with pytest.raises(ValueError, match="logits"):
        model_logits(Bad(), torch.zeros(1, 4, dtype=torch.long))
