"""YaRN on converted models: `apply_rope_scaling` gives the HF model transformers' scaled RoPE (the
same logits as a model built with rope_scaling in its config), the MSA-converted model in dense mode
equals it, and a saved converted model keeps the scaling."""

from __future__ import annotations

import pytest
import torch

from msakit.models.convert import apply_rope_scaling, convert_dense_to_msa, load_for_conversion, rope_scaling_dict

pytestmark = pytest.mark.usefixtures("one_thread")

KW = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, max_position_embeddings=64)


def _pair():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    plain = Qwen2ForCausalLM(Qwen2Config(**KW)).eval().double()
    yarn_cfg = Qwen2Config(**KW, rope_scaling={"rope_type": "yarn", "type": "yarn", "factor": 4.0,
                                                "original_max_position_embeddings": 64})
    yarn = Qwen2ForCausalLM(yarn_cfg).eval().double()
    yarn.load_state_dict(plain.state_dict())
    return plain, yarn


def test_apply_equals_config_yarn_and_msa_dense_equals_hf(tmp_path):
    plain, yarn = _pair()
    ids = torch.randint(0, 97, (1, 200), generator=torch.Generator().manual_seed(0))  # past the native 64
    with torch.no_grad():
        ref = yarn(input_ids=ids, use_cache=False).logits
        before = plain(input_ids=ids, use_cache=False).logits
        assert not torch.allclose(before, ref, atol=1e-6)
        assert apply_rope_scaling(plain, "yarn:4")["factor"] == 4.0
        assert plain.config.max_position_embeddings == 256
        torch.testing.assert_close(plain(input_ids=ids, use_cache=False).logits, ref, atol=1e-10, rtol=1e-10)
        msa = convert_dense_to_msa(plain, block_size=16, topk=2, init_blocks=1, seed=0, dtype=torch.float64).eval()
        torch.testing.assert_close(msa(ids, compute_kl=False).logits, ref, atol=1e-10, rtol=1e-10)
        msa.save_pretrained(tmp_path / "m")
        back = load_for_conversion(tmp_path / "m", dtype=torch.float64).eval()
        torch.testing.assert_close(back(ids, compute_kl=False).logits, ref, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("spec", ["yarn", "yarn:1", "rope:4", "yarn:x", "yarn:4:0"])
def test_bad_specs(spec):
    with pytest.raises(ValueError, match="rope scaling"):
        rope_scaling_dict(spec, 32768)
