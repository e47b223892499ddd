"""Named `M3Config`s.

- ``tiny``: CPU tests and the demo.  Hidden 128, 4 layers (layer 0 dense MLP, the rest MoE), MSA
  in every layer, 4 query / 2 KV heads of 32, index dim 32, rotary 16, 8 experts top-2 + 1 shared
  of width 128, blocks of 32, top-4 blocks, context 1024; vocabulary 4096 unless the tokenizer's
  size is passed (``M3Config.preset("tiny", vocab_size=tok.vocab_size)``).
- ``small``: one GPU.  Hidden 512, 8 layers, 8 / 2 heads of 64, index dim 64, rotary 32, 16
  experts top-4 + 1 shared of width 256, blocks of 64, top-8 blocks, context 8192.
- ``minimax-m3`` and ``minimax-m3.1-flash``: HF configs reconstructed from the fields public
  loaders (vLLM, transformers, ModelOpt's mixed-precision export) read from the released
  checkpoints, not official files; shipped as package data under ``msakit/models/configs/``
  (the same files as ``tests/fixtures/*/config.json``).
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any, Callable

__all__ = ["PRESETS", "built_preset", "fixture_dict", "FIXTURE_PRESETS"]

PRESETS = ("tiny", "small", "minimax-m3", "minimax-m3.1-flash")


def _built(L: int, **sizes: Any) -> dict[str, Any]:
    """The tiny / small pattern for L layers: layer 0 dense MLP, the rest MoE (1 shared expert),
    MSA in every layer with one index head per KV group (2), a local block and no init block."""
    return dict(
        vocab_size=4096, num_hidden_layers=L, num_key_value_heads=2, rms_norm_eps=1e-6, n_shared_experts=1,
        routed_scaling_factor=2.0, moe_layer_freq=[0] + [1] * (L - 1), sparse_attention_freq=[1] * L,
        index_n_heads=2, index_local_blocks=1, index_init_blocks=0, **sizes,
    )


def _tiny(L: int) -> dict[str, Any]:
    return _built(
        L, hidden_size=128, num_attention_heads=4, head_dim=32, max_position_embeddings=1024, rope_theta=10000.0,
        rotary_dim=16, dense_intermediate_size=256, intermediate_size=128, shared_intermediate_size=128,
        num_local_experts=8, num_experts_per_tok=2, index_head_dim=32, index_block_size=32, index_topk_blocks=4,
    )


def _small(L: int) -> dict[str, Any]:
    return _built(
        L, hidden_size=512, num_attention_heads=8, head_dim=64, max_position_embeddings=8192, rope_theta=1_000_000.0,
        rotary_dim=32, dense_intermediate_size=1536, intermediate_size=256, shared_intermediate_size=256,
        num_local_experts=16, num_experts_per_tok=4, index_head_dim=64, index_block_size=64, index_topk_blocks=8,
    )


_BUILT: dict[str, tuple[Callable[[int], dict[str, Any]], int]] = {"tiny": (_tiny, 4), "small": (_small, 8)}
_FILES = {"minimax-m3": "minimax-m3.json", "minimax-m3.1-flash": "minimax-m3.1-flash.json"}


FIXTURE_PRESETS = tuple(_FILES)


def built_preset(name: str, num_hidden_layers: int | None = None) -> dict[str, Any]:
    """The fields (M3Config names) of the built preset `name` ("tiny", "small") with
    `num_hidden_layers` layers (default the preset's), its per-layer lists in the preset's pattern."""
    build, default_layers = _BUILT[name]
    L = default_layers if num_hidden_layers is None else num_hidden_layers
    if isinstance(L, bool) or not isinstance(L, int) or L < 1:
        raise ValueError(f"num_hidden_layers must be a positive integer, got {L!r}")
    return build(L)


def fixture_dict(name: str) -> dict[str, Any]:
    """The packaged HF config.json of a fixture preset, as a dict."""
    try:
        text = resources.files("msakit.models").joinpath("configs", _FILES[name]).read_text(encoding="utf-8")
    except KeyError:
        raise ValueError(f"unknown fixture preset {name!r}; known: {', '.join(_FILES)}") from None
    return json.loads(text)
