"""Trainer: loss falls on a tiny CPU run, the recipe's mode switch, and the recall metric."""

from __future__ import annotations

import math

import pytest
import torch

from msakit import ops
from msakit.train.metrics import indexer_recall, load_balance
from msakit.train.trainer import TrainConfig, Trainer, lr_at, mode_at, read_metrics

from toy_model import make_model, stdlib_data

pytestmark = pytest.mark.usefixtures("one_thread")


FILES = ["json/decoder.py", "json/encoder.py", "json/scanner.py", "textwrap.py", "fnmatch.py", "bisect.py",
         "heapq.py", "colorsys.py", "glob.py", "keyword.py", "shlex.py", "sched.py"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return stdlib_data(tmp_path_factory.mktemp("tcorpus"), FILES, val_fraction=0.1)


def test_short_cpu_run_loss_falls_and_logs(data, tmp_path):
    model = make_model(data.tokenizer.vocab_size)
    cfg = TrainConfig(steps=30, batch_size=4, lr=3e-3, lr_warmup_steps=3, dense_warmup_steps=12, log_every=5,
                      eval_every=15, eval_rows=8, save_every=30, seed=0)
    tr = Trainer(model, cfg, data.train, data.val, out_dir=tmp_path / "run", tokenizer=data.tokenizer, progress=False)
    e0 = tr.evaluate(recall_rows=0)["loss"]
    hist = tr.fit()
    assert [r["mode"] for r in hist] == ["dense"] * 12 + ["sparse"] * 18
    first = sum(r["loss"] for r in hist[:5]) / 5
    last = sum(r["loss"] for r in hist[-5:]) / 5
    assert last < first - 0.5, (first, last)
    assert tr.evaluate(recall_rows=0)["loss"] < e0 - 0.5
    recs = read_metrics(tmp_path / "run" / "metrics.jsonl")
    kinds = [r["kind"] for r in recs]
    assert kinds.count("train") == 6 and kinds.count("eval") == 2
    ev = [r for r in recs if r["kind"] == "eval"][-1]
    assert len(ev["kl_per_layer"]) == 2 and len(ev["recall_per_layer"]) == 2
    assert all(0 < r <= o + 1e-6 <= 1 + 1e-6 for r, o in zip(ev["recall_per_layer"], ev["oracle_per_layer"]))
    assert "load_balance_max" in recs[0] and recs[0]["load_balance_max"] >= 1.0
    assert (tmp_path / "run" / "loss.png").stat().st_size > 1000
    assert (tmp_path / "run" / "recall.png").is_file()
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step-00000030"


def test_schedule():
    cfg = TrainConfig(steps=100, lr=1.0, lr_warmup_steps=10, min_lr_ratio=0.1, dense_warmup_steps=40)
    assert lr_at(cfg, 0) == pytest.approx(0.1) and lr_at(cfg, 9) == pytest.approx(1.0)
    assert lr_at(cfg, 10) == pytest.approx(1.0) and lr_at(cfg, 100) == pytest.approx(0.1)
    assert lr_at(cfg, 55) == pytest.approx(0.55)
    assert mode_at(cfg, 39) == "dense" and mode_at(cfg, 40) == "sparse"
    with pytest.raises(ValueError):
        TrainConfig(steps=0)


def _recall_by_hand(q, k, bidx, bs, topk):
    """Direct loops over (b, r, i): dense group-mean mass per block, summed over the selection / oracle."""
    B, T, Hq, D = q.shape
    G = k.shape[2]
    hpg = Hq // G
    rec = orc = 0.0
    for b in range(B):
        for r in range(G):
            for i in range(T):
                P = torch.zeros(i + 1, dtype=torch.float64)
                for h in range(r * hpg, (r + 1) * hpg):
                    s = (q[b, i, h].double() @ k[b, : i + 1, r].double().T) / math.sqrt(D)
                    P += torch.softmax(s, 0) / hpg
                nb = i // bs + 1
                m = [float(P[j * bs:(j + 1) * bs].sum()) for j in range(nb)]
                rec += sum(m[j] for j in set(bidx[b, r, i].tolist()) if j >= 0)
                own = i // bs
                others = sorted((j for j in range(nb) if j != own), key=lambda j: -m[j])[: topk - 1]
                orc += m[own] + sum(m[j] for j in others)
    n = B * G * T
    return rec / n, orc / n


def test_recall_all_blocks_selected_is_one_and_matches_hand_computation():
    torch.manual_seed(0)
    B, T, Hq, G, D, bs = 2, 37, 4, 2, 8, 8
    q = torch.randn(B, T, Hq, D)
    k = torch.randn(B, T, G, D)
    nb = (T + bs - 1) // bs
    allb = torch.arange(nb, dtype=torch.int32).view(1, 1, 1, nb).expand(B, G, T, nb).clone()
    r = indexer_recall(q, k, allb, block_size=bs, topk=nb)
    assert r["recall"] == pytest.approx(1.0, abs=1e-6) and r["oracle"] == pytest.approx(1.0, abs=1e-6)
    # a real selection from random index keys, top-2 of 5 blocks
    qi, ki = torch.randn(B, T, G, 4), torch.randn(B, T, 4)
    bidx = ops.index_topk(qi, ki, block_size=bs, topk=2)
    r = indexer_recall(q, k, bidx, block_size=bs, topk=2)
    want_rec, want_orc = _recall_by_hand(q, k, bidx, bs, 2)
    assert r["recall"] == pytest.approx(want_rec, abs=1e-5)
    assert r["oracle"] == pytest.approx(want_orc, abs=1e-5)
    assert r["recall"] <= r["oracle"] + 1e-9 and r["oracle"] < 1.0
    assert 0 < r["recall_far"] < 1 and r["far_queries"] == B * G * (T - 2 * bs)


def test_recall_tiny_hand_case():
    # one head, one group, T=4, block 2, top-1 (only the forced own block): queries 0,1 -> 1.0;
    # queries 2,3 keep only block 1.  q = 0 -> uniform attention: i=2: mass of block 1 = 1/3; i=3: 2/4
    q = torch.zeros(1, 4, 1, 2)
    k = torch.randn(1, 4, 1, 2)
    bidx = torch.tensor([0, 0, 1, 1], dtype=torch.int32).view(1, 1, 4, 1)
    r = indexer_recall(q, k, bidx, block_size=2, topk=1)
    assert r["recall"] == pytest.approx((1 + 1 + 1 / 3 + 2 / 4) / 4)
    assert r["oracle"] == pytest.approx(r["recall"])
    assert r["recall_far"] == pytest.approx((1 / 3 + 1 / 2) / 2)


def test_load_balance():
    assert load_balance(torch.tensor([[1.0, 1, 1, 1], [4, 0, 0, 0]])) == [1.0, 4.0]
    assert load_balance(None) == []


def test_doc_attention_path_trains(data, tmp_path):
    """--doc-attention: the rows of a batch go through the model's cu_seqlens path as one packed sequence."""
    model = make_model(data.tokenizer.vocab_size)
    cfg = TrainConfig(steps=3, batch_size=2, dense_warmup_steps=1, doc_attention=True, log_every=1, eval_every=3,
                      eval_rows=2, save_every=3)
    tr = Trainer(model, cfg, data.train, data.val, out_dir=tmp_path, progress=False)
    hist = tr.fit()
    assert len(hist) == 3 and all(math.isfinite(r["loss"]) for r in hist)
    batch = tr.loader.next_batch()
    ids, labels, cu = batch.flat()
    out = model(ids, labels=labels, cu_seqlens=cu)
    # attention stays inside each document: the packed result equals the documents run one by one
    seg = [(int(a), int(b)) for a, b in zip(cu[:-1], cu[1:])]
    a, b = seg[1] if len(seg) > 1 else seg[0]
    alone = model(ids[:, a:b]).logits
    assert torch.allclose(out.logits[:, a:b], alone, atol=1e-4)


def test_train_line_names_what_the_record_has():
    from msakit.train.trainer import train_line

    assert train_line(dict(step=3, loss=1.5, kl=None, tokens=1234, elapsed_s=2.2)) == "step 3: loss 1.5000, 1,234 tokens, 2s"
    assert train_line(dict(step=4, loss=None, kl=0.25, tokens=9, elapsed_s=10.0)) == "step 4: kl 0.2500, 9 tokens, 10s"
