"""The model the training tests train: the real `M3ForCausalLM` at toy size (hidden 32, 2 layers,
blocks of 8, top-2), so that a step takes milliseconds on a CPU."""

from __future__ import annotations

import torch

from msakit.models import M3Config, M3ForCausalLM

TOY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
           index_head_dim=8, rotary_dim=4, index_block_size=8, index_topk_blocks=2, num_local_experts=4,
           num_experts_per_tok=2, intermediate_size=32, shared_intermediate_size=32, dense_intermediate_size=64,
           max_position_embeddings=256)


def toy_config(vocab_size: int = 300, **overrides) -> M3Config:
    return M3Config.preset("tiny", **{**TOY, "vocab_size": vocab_size, **overrides})


def make_model(vocab_size: int = 300, **overrides) -> M3ForCausalLM:
    torch.manual_seed(0)
    return M3ForCausalLM(toy_config(vocab_size, **overrides))
