"""`DSparkConfig`: the DSpark drafter's settings, in and out of the released ``dspark/config.json``.

The M3.1-Flash drafter (the released ``dspark/config.json``, shipped as
package data ``msakit/speculative/configs/minimax-m3.1-flash-dspark.json``; preset ``"minimax-m3.1-flash"``):
5 dense layers at the target's width 6144, 64 / 4 heads of 128, SwiGLU-OAI FFN 12288, sliding
window 4096 on every layer, taps of target layers [3, 17, 31, 45, 59], ``dspark_block_size`` 7
(the block is [anchor, mask x 6]; row j predicts anchor + j + 1, so 7 drafts and a verify width of
8), noise / mask token 200058, a vanilla Markov head of rank 256, a confidence head that reads the
Markov feature, Gemma norms.

Scaled-down drafters for small targets come from `DSparkConfig.for_target(target_config, size)`:
the target's width, heads and vocabulary, taps spread evenly over the target's layers (M3.1's
pattern: ``round(linspace(L/20, L-1, min(5, L)))`` gives [3, 17, 31, 45, 59] for L = 60), fewer
draft layers ("tiny": 1, "small": 2, "full": 5).

``markov_rank = 0`` is the drafter without the Markov head (the paper's ablation); the
confidence head then reads the draft hidden state only.

Reading accepts the nested (``text_config``) and flat forms and rejects, naming the field, what
this implementation does not support (non-Gemma norms, hybrid context fusion, MoE or sparse
draft layers, another Markov head type, another activation).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

from msakit.config_io import check_fixed_fields as _check_fixed
from msakit.config_io import get_field as _get
from msakit.config_io import get_int_field as _cfg_int
from msakit.config_io import get_rotary_dim as _rotary_dim
from msakit.config_io import load_config_file, write_config_json

__all__ = ["DSparkConfig", "DRAFTER_PRESETS", "spread_taps"]

_FILES = {"minimax-m3.1-flash": "minimax-m3.1-flash-dspark.json"}
# draft layers of the scaled-down presets (the released drafter has 5)
_SIZES = {"tiny": 1, "small": 2, "full": 5}
DRAFTER_PRESETS = tuple(_FILES) + tuple(_SIZES)


def spread_taps(num_target_layers: int, num_taps: int = 5) -> list[int]:
    """Tap layers spread over a target of `num_target_layers` (M3.1: 60 -> [3, 17, 31, 45, 59]).

    The last tap is always the last layer (its pre-final-norm residual); the first sits at L / 20.
    """
    L = int(num_target_layers)
    if L < 1:
        raise ValueError(f"the target must have at least one layer, got {L}")
    n = max(1, min(int(num_taps), L))
    if n == 1:
        return [L - 1]
    start = min(L / 20.0, L - n)  # leave room for n distinct layers
    taps = [int(round(start + (L - 1 - start) * i / (n - 1))) for i in range(n)]
    out: list[int] = []
    for t in taps:  # rounding can collide on very shallow targets: push up to keep them distinct
        t = max(t, out[-1] + 1) if out else t
        out.append(min(t, L - 1))
    if len(set(out)) != n:
        out = list(range(L - n, L))
    return out


@dataclass
class DSparkConfig:
    """Settings of a DSpark drafter (HF field names in comments where they differ)."""

    vocab_size: int = 4096
    hidden_size: int = 128
    num_hidden_layers: int = 1
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256  # dense_intermediate_size == dspark_ffn_hidden_size
    draft_block_size: int = 7  # dspark_block_size: rows of a block = drafts per round (anchor row included)
    noise_token_id: int = 4095  # dspark_noise_token_id: the mask token of rows 1 .. draft_block_size - 1
    target_layer_ids: list[int] = field(default_factory=lambda: [0, 1, 2, 3])  # dspark_target_layer_ids
    markov_rank: int = 256  # dspark_markov_rank; 0 = no Markov head
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    sliding_window: int = 4096
    rope_theta: float = 10000.0
    rotary_dim: int = 16
    rms_norm_eps: float = 1e-6
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    initializer_range: float = 0.02
    quantization_config: dict | None = None  # kept for the round trip (the released weights are MXFP8)

    def __post_init__(self) -> None:
        for f in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "intermediate_size", "draft_block_size", "sliding_window"):
            _pos_int(self, f)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if isinstance(self.markov_rank, bool) or not isinstance(self.markov_rank, int) or self.markov_rank < 0:
            raise ValueError(f"dspark_markov_rank must be a non-negative integer, got {self.markov_rank!r}")
        if isinstance(self.noise_token_id, bool) or not isinstance(self.noise_token_id, int) \
                or not 0 <= self.noise_token_id < self.vocab_size:
            raise ValueError(f"dspark_noise_token_id must be a token id in [0, vocab_size={self.vocab_size}), "
                             f"got {self.noise_token_id!r}")
        taps = self.target_layer_ids
        if not isinstance(taps, (list, tuple)) or not taps or any(
                isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in taps):
            raise ValueError(f"dspark_target_layer_ids must be a non-empty list of layer indices, got {taps!r}")
        if len(set(taps)) != len(taps):
            raise ValueError(f"dspark_target_layer_ids has repeated layers: {list(taps)}")
        self.target_layer_ids = [int(t) for t in taps]
        if not isinstance(self.rotary_dim, int) or isinstance(self.rotary_dim, bool) or self.rotary_dim < 0 \
                or self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(f"rotary_dim must be an even integer in [0, head_dim={self.head_dim}], got {self.rotary_dim!r}")
        for f in ("rope_theta", "rms_norm_eps", "swiglu_alpha", "swiglu_limit", "initializer_range"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or not math.isfinite(v):
                raise ValueError(f"{f} must be a positive number, got {v!r}")
            setattr(self, f, float(v))
        self.enable_confidence_head = bool(self.enable_confidence_head)
        self.confidence_head_with_markov = bool(self.confidence_head_with_markov) and self.markov_rank > 0

    # -- derived ------------------------------------------------------------------------------
    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def has_markov(self) -> bool:
        return self.markov_rank > 0

    @property
    def num_drafts(self) -> int:
        """Drafts per round (= draft_block_size: the anchor row predicts the first one)."""
        return self.draft_block_size

    @property
    def verify_width(self) -> int:
        return self.draft_block_size + 1

    def replace(self, **changes: Any) -> "DSparkConfig":
        return dataclasses.replace(self, **changes)

    # -- checks against a target --------------------------------------------------------------
    def check_target(self, target_config: Any) -> None:
        """Raise ValueError when this drafter cannot serve a target with `target_config`
        (an `M3Config` or anything with vocab_size / hidden_size / num_hidden_layers)."""
        tv, th, tl = (getattr(target_config, k, None) for k in ("vocab_size", "hidden_size", "num_hidden_layers"))
        if tv != self.vocab_size:
            raise ValueError(f"vocabulary mismatch: the drafter has vocab_size={self.vocab_size} but the target has "
                             f"{tv} (the drafter shares the target's embedding and output head)")
        if th != self.hidden_size:
            raise ValueError(f"width mismatch: the drafter has hidden_size={self.hidden_size} but the target has {th} "
                             "(the drafter shares the target's embedding and output head)")
        bad = [t for t in self.target_layer_ids if t >= tl]
        if bad:
            raise ValueError(f"dspark_target_layer_ids {self.target_layer_ids} tap layer(s) {bad} beyond the target's "
                             f"depth ({tl} layers: 0 .. {tl - 1})")

    # -- presets ------------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "DSparkConfig":
        """The released M3.1-Flash drafter ("minimax-m3.1-flash") with overrides."""
        key = str(name).lower()
        if key not in _FILES:
            raise ValueError(f"unknown drafter preset {name!r}; known: {', '.join(_FILES)} (for a scaled-down "
                             f"drafter use DSparkConfig.for_target(target_config, {'|'.join(_SIZES)}))")
        text = resources.files("msakit.speculative").joinpath("configs", _FILES[key]).read_text(encoding="utf-8")
        cfg = cls.from_dict(json.loads(text))
        return cfg.replace(**overrides) if overrides else cfg

    @classmethod
    def for_target(cls, target_config: Any, size: str = "small", **overrides: Any) -> "DSparkConfig":
        """A drafter scaled to `target_config` (an `M3Config`): its width, heads, vocabulary, rotary
        settings; taps spread over its layers; `size` draft layers (tiny 1, small 2, full 5)."""
        if size not in _SIZES:
            raise ValueError(f"unknown drafter size {size!r}; known: {', '.join(_SIZES)}")
        t = target_config
        L = int(t.num_hidden_layers)
        V = int(t.vocab_size)
        base = dict(
            vocab_size=V,
            hidden_size=int(t.hidden_size),
            num_hidden_layers=_SIZES[size],
            num_attention_heads=int(t.num_attention_heads),
            num_key_value_heads=int(t.num_key_value_heads),
            head_dim=int(t.head_dim),
            intermediate_size=int(getattr(t, "dense_intermediate_size", 0) or 4 * int(t.hidden_size)),
            draft_block_size=7,
            noise_token_id=V - 1,
            target_layer_ids=spread_taps(L, 5),
            markov_rank=256 if size != "tiny" else 64,
            sliding_window=min(4096, int(getattr(t, "max_position_embeddings", 4096))),
            rope_theta=float(getattr(t, "rope_theta", 10000.0)),
            rotary_dim=int(getattr(t, "rotary_dim", 0)),
            rms_norm_eps=float(getattr(t, "rms_norm_eps", 1e-6)),
            swiglu_alpha=float(getattr(t, "swiglu_alpha", 1.702)),
            swiglu_limit=float(getattr(t, "swiglu_limit", 7.0)),
            initializer_range=float(getattr(t, "initializer_range", 0.02)),
        )
        unknown = set(overrides) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown DSparkConfig field(s): {sorted(unknown)}")
        base.update(overrides)
        cfg = cls(**base)
        cfg.check_target(t)
        return cfg

    # -- reading ------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> "DSparkConfig":
        """From a folder holding config.json or the file itself."""
        return load_config_file(path, cls.from_dict, "drafter config")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "DSparkConfig":
        """From the released nested form (``text_config`` + ``quantization_config``) or a flat dict."""
        if not isinstance(raw, Mapping):
            raise ValueError("config must be a JSON object")
        cfg = raw.get("text_config", raw)
        if not isinstance(cfg, Mapping):
            raise ValueError("config field 'text_config' must be an object")

        def get(key: str, default: Any) -> Any:
            return _get(cfg, key, default)

        L = _cfg_int(cfg, "num_hidden_layers")
        _check_fixed(cfg, (("use_gemma_norm", True), ("dspark_hybrid_context_fusion", False),
                           ("dspark_use_dense_ffn", True)))
        act = get("hidden_act", "swigluoai")
        if act not in ("swigluoai", "silu"):
            raise ValueError(f"config field 'hidden_act' is {act!r}; only 'swigluoai' (SwiGLU-OAI) is supported")
        if cfg.get("sparse_attention_config") not in (None, {}):
            raise ValueError("config field 'sparse_attention_config' must be null: draft layers are dense "
                             "sliding-window attention")
        moe = cfg.get("moe_layer_freq")
        if moe is not None and (not isinstance(moe, (list, tuple)) or any(int(m) for m in moe)):
            raise ValueError(f"config field 'moe_layer_freq'={moe!r} is unsupported: draft layers are dense")
        types = cfg.get("layer_types")
        if types is not None:
            if not isinstance(types, (list, tuple)) or len(types) != L:
                raise ValueError(f"config field 'layer_types' must list one type per layer ({L}), got {types!r}")
            bad = sorted({t for t in types if t not in ("sliding_attention", "full_attention")})
            if bad:
                raise ValueError(f"config field 'layer_types' has unsupported type(s) {bad} (sliding_attention only)")
            if len(set(types)) > 1:
                raise ValueError("config field 'layer_types' mixes sliding and full attention; one window for all "
                                 "draft layers is implemented")
        mtype = get("dspark_markov_head_type", "vanilla")
        rank = _cfg_int(cfg, "dspark_markov_rank", 0, required=False)
        if mtype in ("none", None) or not rank:
            rank = 0
        elif mtype != "vanilla":
            raise ValueError(f"config field 'dspark_markov_head_type'={mtype!r} is unsupported (only 'vanilla')")
        ffn = cfg.get("dspark_ffn_hidden_size")
        dense = cfg.get("dense_intermediate_size", cfg.get("intermediate_size"))
        if ffn is not None and dense is not None and int(ffn) != int(dense):
            raise ValueError(f"inconsistent config: dspark_ffn_hidden_size={ffn} but dense_intermediate_size={dense}")
        inter = ffn if ffn is not None else dense
        if inter is None:
            raise ValueError("config is missing required field 'dspark_ffn_hidden_size' / 'dense_intermediate_size'")
        window = cfg.get("sliding_window")
        if types is not None and types[0] == "full_attention":
            window = None
        max_pos = cfg.get("max_position_embeddings")
        if window is None:  # full attention over the context: a window as long as any context
            window = int(max_pos) if max_pos else 1 << 30
        head_dim = _cfg_int(cfg, "head_dim")
        rotary = _rotary_dim(cfg, head_dim)
        taps = cfg.get("dspark_target_layer_ids")
        if taps is None:
            raise ValueError("config is missing required field 'dspark_target_layer_ids'")
        q = raw.get("quantization_config", cfg.get("quantization_config"))
        vocab = _cfg_int(cfg, "vocab_size")
        try:
            return cls(
                vocab_size=vocab,
                hidden_size=_cfg_int(cfg, "hidden_size"),
                num_hidden_layers=L,
                num_attention_heads=_cfg_int(cfg, "num_attention_heads"),
                num_key_value_heads=_cfg_int(cfg, "num_key_value_heads"),
                head_dim=head_dim,
                intermediate_size=int(inter),
                draft_block_size=_cfg_int(cfg, "dspark_block_size"),
                noise_token_id=_cfg_int(cfg, "dspark_noise_token_id"),
                target_layer_ids=list(taps) if isinstance(taps, (list, tuple)) else taps,
                markov_rank=rank,
                enable_confidence_head=bool(get("enable_confidence_head", True)),
                confidence_head_with_markov=bool(get("confidence_head_with_markov", True)),
                sliding_window=int(window),
                rope_theta=float(get("rope_theta", 10000.0)),
                rotary_dim=int(rotary),
                rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
                swiglu_alpha=float(get("swiglu_alpha", 1.702)),
                swiglu_limit=float(get("swiglu_limit", 7.0)),
                initializer_range=float(get("initializer_range", 0.02)),
                quantization_config=dict(q) if isinstance(q, Mapping) else None,
            )
        except TypeError as e:  # a list where an int belongs etc.
            raise ValueError(f"invalid drafter config: {e}") from None

    # -- writing ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The released nested layout (``text_config`` with the DSpark field names)."""
        L = self.num_hidden_layers
        text: dict[str, Any] = {
            "num_hidden_layers": L,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "dense_intermediate_size": self.intermediate_size,
            "dspark_ffn_hidden_size": self.intermediate_size,
            "dspark_markov_rank": self.markov_rank,
            "dspark_markov_head_type": "vanilla" if self.markov_rank else "none",
            "dspark_block_size": self.draft_block_size,
            "dspark_noise_token_id": self.noise_token_id,
            "dspark_target_layer_ids": list(self.target_layer_ids),
            "dspark_use_dense_ffn": True,
            "dspark_hybrid_context_fusion": False,
            "enable_confidence_head": self.enable_confidence_head,
            "confidence_head_with_markov": self.confidence_head_with_markov,
            "use_gemma_norm": True,
            "sliding_window": self.sliding_window,
            "layer_types": ["sliding_attention"] * L,
            "moe_layer_freq": [0] * L,
            "sparse_attention_config": None,
            "rope_theta": self.rope_theta,
            "rotary_dim": self.rotary_dim,
            "hidden_act": "swigluoai",
            "swiglu_alpha": self.swiglu_alpha,
            "swiglu_limit": self.swiglu_limit,
            "rms_norm_eps": self.rms_norm_eps,
            "initializer_range": self.initializer_range,
        }
        d: dict[str, Any] = {"model_type": "minimax_m3_vl", "text_config": text}
        if self.quantization_config is not None:
            d["quantization_config"] = dict(self.quantization_config)
        return d

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write config.json into a folder (created) or to a *.json path; returns the file."""
        return write_config_json(path, self.to_dict())

    save_pretrained = save


def _pos_int(cfg: DSparkConfig, f: str) -> None:
    v = getattr(cfg, f)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{f} must be a positive integer, got {v!r}")
