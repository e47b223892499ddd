"""benchmarks/convert_eval.py's `selections` stage (issue 28: the converted Qwen model's
selections) as a CPU dry run: a tiny converted Qwen2 model stands in for the warmed checkpoint."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


def test_selections_stage_dry_run(tmp_path, monkeypatch):
    from benchmarks import convert_eval
    from msakit.eval import tasks
    from msakit.models.convert import convert_dense_to_msa

    work, out = tmp_path / "work", tmp_path / "out"
    src = work / "qwen2.5-coder-0.5b-instruct"
    src.mkdir(parents=True)
    out.mkdir()
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok.save(str(src / "tokenizer.json"))
    monkeypatch.setattr(tasks, "encoder", lambda t: (lambda text: [ord(c) % 128 for c in text]))
    monkeypatch.setattr(convert_eval, "DEVICE", "cpu")
    monkeypatch.setattr(convert_eval, "BUDGETS", ((8, 2), (16, 3)))
    cfg = transformers.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    for bs, k in convert_eval.BUDGETS:
        torch.manual_seed(0)
        model = convert_dense_to_msa(transformers.Qwen2ForCausalLM(cfg).eval(), block_size=bs, topk=k)
        model.save_pretrained(work / convert_eval.warm_name("qk", "selected", bs) / "model")
    res = convert_eval.stage_selections(work, out, tokens=1000, time_budget=1.0, lr=1e-3, lengths=(64, 96),
                                        layers=(1,))
    assert [(r["block_size"], r["topk"]) for r in res] == [(8, 2), (16, 3)]
    for r in res:
        assert "error" not in r and "warmup" not in r
        for T in (64, 96):
            stats = r[str(T)]["stats"]
            assert sorted(stats) == [0, 1] and stats[1]["shape"] == [1, 2, T, r["topk"]]
            saved = torch.load(out / f"selections_b{r['block_size']}_{T}_L1.pt", weights_only=True)
            assert saved["block_idx"].dtype == torch.int16 and saved["block_size"] == r["block_size"]
    assert not list(out.glob("selections_*_L0.pt"))
