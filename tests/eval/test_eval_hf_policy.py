"""HFPolicyModel: a plain HF model running selection policies through transformers' attention
interface (dense = HF's logits; a window covering every block = dense)."""

from __future__ import annotations

import pytest
import torch

from msakit.ops.index_topk import Selection
from msakit.eval import EvalConfig, HFPolicyModel, make_policy, run_eval
from msakit.eval.scoring import model_logits

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def hf():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).eval()


def test_dense_equals_hf_and_full_window_equals_dense(hf):
    ids = torch.randint(0, 97, (2, 70), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(input_ids=ids, use_cache=False).logits
        m = HFPolicyModel(hf, block_size=16, topk=2)
        assert torch.equal(model_logits(m, ids), ref)
        m.set_attention_mode("sparse")
        m.set_selection_policy(make_policy("window", Selection(16, 5)))  # 5 blocks of 16 >= 70 tokens
        torch.testing.assert_close(model_logits(m, ids), ref, atol=1e-4, rtol=1e-4)
        calls = []

        def spy(layer, q, k, q_idx, k_idx, sel):
            calls.append((layer, tuple(q.shape), tuple(k.shape), q_idx, sel.block_size))
            return make_policy("oracle", Selection(16, 2))(layer, q, k, q_idx, k_idx, sel)

        m.set_selection_policy(spy)
        sparse = model_logits(m, ids)
        assert not torch.allclose(sparse, ref, atol=1e-3)
        assert calls == [(0, (2, 70, 4, 8), (2, 70, 2, 8), None, 16), (1, (2, 70, 4, 8), (2, 70, 2, 8), None, 16)]
        m.set_attention_mode("dense")
        assert torch.equal(model_logits(m, ids), ref)


def test_run_eval_on_hf_policy_model(hf, tok, tmp_path):
    m = HFPolicyModel(hf, block_size=16, topk=2)
    cfg = EvalConfig(tasks=["passkey"], lengths=[512], depths=[0.5], policies=["dense", "window", "oracle"],
                     budget=Selection(16, 4), samples=1)
    small = _Remap(tok, 97)
    s = run_eval(m, small, cfg, tmp_path / "h", progress=False)
    assert set(s["retrieval"]) == {"dense", "window", "oracle"}
    with pytest.raises(ValueError, match="index branch"):
        run_eval(m, small, EvalConfig(tasks=["passkey"], lengths=[512], policies=["msa"], budget=Selection(16, 4),
                                      samples=1), tmp_path / "h2", progress=False)


class _Remap:
    """The tiny tokenizer's ids folded into the tiny model's vocabulary (a callable tokenizer)."""

    def __init__(self, tok, vocab: int) -> None:
        self.tok, self.vocab = tok, vocab

    def __call__(self, text: str) -> list[int]:
        return [i % self.vocab for i in self.tok.encode(text, add_special_tokens=False).ids]


@pytest.mark.parametrize("name", ["window", "window0", "oracle"])
def test_same_logits_as_converted_model_hook(hf, name):
    """A policy gives the same logits on HFPolicyModel as on the converted model's own hook."""
    import copy

    from msakit.models.convert import convert_dense_to_msa

    ids = torch.randint(0, 97, (1, 90), generator=torch.Generator().manual_seed(3))
    fn = make_policy(name, Selection(16, 3))
    a = HFPolicyModel(copy.deepcopy(hf), block_size=16, topk=3)
    b = convert_dense_to_msa(copy.deepcopy(hf), block_size=16, topk=3)
    for m in (a, b):
        m.set_attention_mode("sparse")
        m.set_selection_policy(fn)
    with torch.no_grad():
        la, lb = model_logits(a, ids), model_logits(b, ids)
    torch.testing.assert_close(la, lb, atol=1e-5, rtol=1e-5)
