"""`M3Config`: the MiniMax-M3 / M3.1-Flash text model's settings, in and out of HF ``config.json``.

Reading builds on `msakit.cost.ModelShape.from_config` (one parser for the layouts, the legacy
``sparse_attention_config`` / ``moe_layer_freq`` and the flat transformers names ``index_*``,
``layer_types``, ``mlp_layer_types``), then reads the remaining numeric fields and rejects what
this implementation does not support, naming the field.  Unknown extra keys are ignored (HF
configs carry many: vision_config, quantization_config, token ids, ...).

Writing (`to_dict` / `save`) gives a flat HF text config (``model_type: minimax_m3_vl_text``)
with the legacy ``sparse_attention_config`` and ``moe_layer_freq`` spellings the released
checkpoints use; `from_pretrained` reads it back to an equal `M3Config`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from msakit.config_io import check_fixed_fields, get_field, get_rotary_dim, load_config_file, write_config_json
from msakit.cost import ModelShape
from msakit.models.presets import FIXTURE_PRESETS, PRESETS, built_preset, fixture_dict
from msakit.ops.index_topk import Selection

__all__ = ["M3Config", "M3_MODEL_TYPES", "PRESETS"]

M3_MODEL_TYPES = ("minimax_m3_vl", "minimax_m3_vl_text", "minimax_m3", "minimax_m3_text")
_SWIGLU_ACTS = ("swigluoai", "silu")  # transformers rewrites "swigluoai" to "silu" and computes SwiGLU-OAI inline


@dataclass
class M3Config:
    """Settings of an M3-style model (HF field names).  Per-layer lists hold 0/1 per layer."""

    vocab_size: int = 4096
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 1024
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rotary_dim: int = 16
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    dense_intermediate_size: int = 256
    intermediate_size: int = 128  # routed expert width
    shared_intermediate_size: int = 128  # width of one shared expert
    n_shared_experts: int = 1
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    routed_scaling_factor: float = 2.0
    norm_topk_prob: bool = True
    use_routing_bias: bool = True
    moe_layer_freq: list[int] | None = None  # 1 = MoE, 0 = dense MLP; None -> [0] + [1] * (L - 1)
    sparse_attention_freq: list[int] | None = None  # 1 = MSA (index branch), 0 = dense GQA; None -> all 1
    index_n_heads: int = 2  # must equal num_key_value_heads
    index_head_dim: int = 32
    index_block_size: int = 32
    index_topk_blocks: int = 4
    index_local_blocks: int = 1
    index_init_blocks: int = 0
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    torch_dtype: str | None = None

    def __post_init__(self) -> None:
        L = self.num_hidden_layers
        _pos_int(self, "num_hidden_layers")
        if self.moe_layer_freq is None:
            self.moe_layer_freq = [0] + [1] * (L - 1)
        if self.sparse_attention_freq is None:
            self.sparse_attention_freq = [1] * L
        self.moe_layer_freq = _layer_list(self.moe_layer_freq, "moe_layer_freq", L)
        self.sparse_attention_freq = _layer_list(self.sparse_attention_freq, "sparse_attention_freq", L)
        for f in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "max_position_embeddings"):
            _pos_int(self, f)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        for f in ("rms_norm_eps", "rope_theta", "swiglu_alpha", "swiglu_limit", "routed_scaling_factor",
                  "initializer_range"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or not math.isfinite(v):
                raise ValueError(f"{f} must be a positive number, got {v!r}")
            setattr(self, f, float(v))
        if not isinstance(self.rotary_dim, int) or isinstance(self.rotary_dim, bool) or self.rotary_dim < 0 \
                or self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(f"rotary_dim must be an even integer in [0, head_dim={self.head_dim}], got {self.rotary_dim!r}")
        if any(self.moe_layer_freq):
            for f in ("num_local_experts", "num_experts_per_tok", "intermediate_size"):
                _pos_int(self, f)
            if self.num_experts_per_tok > self.num_local_experts:
                raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_local_experts "
                                 f"({self.num_local_experts})")
            _nonneg_int(self, "n_shared_experts")
            if self.n_shared_experts:
                _pos_int(self, "shared_intermediate_size")
        if not all(self.moe_layer_freq):
            _pos_int(self, "dense_intermediate_size")
        for f in ("index_n_heads", "index_head_dim", "index_block_size", "index_topk_blocks", "index_local_blocks"):
            _pos_int(self, f)
        _nonneg_int(self, "index_init_blocks")
        if any(self.sparse_attention_freq):
            if self.index_n_heads != self.num_key_value_heads:
                raise ValueError(f"index_n_heads / sparse_num_index_heads ({self.index_n_heads}) must equal "
                                 f"num_key_value_heads ({self.num_key_value_heads}): MSA has one index head per KV group")
            if self.rotary_dim > self.index_head_dim:
                raise ValueError(f"rotary_dim ({self.rotary_dim}) must be <= index_head_dim ({self.index_head_dim}): "
                                 "the index branch uses the main branch's partial RoPE")
            if self.index_topk_blocks < self.index_local_blocks + self.index_init_blocks:
                raise ValueError(f"index_topk_blocks ({self.index_topk_blocks}) must be >= index_local_blocks + "
                                 f"index_init_blocks ({self.index_local_blocks} + {self.index_init_blocks})")
        for f in ("norm_topk_prob", "use_routing_bias"):
            setattr(self, f, bool(getattr(self, f)))

    # -- derived ------------------------------------------------------------------------------
    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layer_freq)

    @property
    def num_sparse_layers(self) -> int:
        return sum(self.sparse_attention_freq)

    def is_moe(self, layer: int) -> bool:
        return bool(self.moe_layer_freq[layer])

    def is_sparse(self, layer: int) -> bool:
        return bool(self.sparse_attention_freq[layer])

    def to_shape(self) -> ModelShape:
        """The `msakit.cost.ModelShape` of this config (parameter / FLOP / cache arithmetic)."""
        return ModelShape.from_config(self.to_dict())

    def replace(self, **changes: Any) -> "M3Config":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    # -- presets -----------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "M3Config":
        """A named config ("tiny", "small", "minimax-m3", "minimax-m3.1-flash") with overrides
        (M3Config field names).

        Changing num_hidden_layers without giving the per-layer lists rebuilds them in the
        preset's pattern (tiny/small: layer 0 dense MLP, MSA everywhere).
        """
        key = str(name).lower()
        if key not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
        unknown = set(overrides) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown M3Config field(s) for preset {name!r}: {sorted(unknown)}")
        if key in FIXTURE_PRESETS:
            cfg = cls.from_dict(fixture_dict(key))
            return cfg.replace(**overrides) if overrides else cfg
        base = built_preset(key, overrides.get("num_hidden_layers"))
        if "num_key_value_heads" in overrides and "index_n_heads" not in overrides:
            base["index_n_heads"] = overrides["num_key_value_heads"]
        base.update(overrides)
        return cls(**base)

    @property
    def selection(self) -> Selection:
        """The MSA layers' selection settings (index_block_size, index_topk_blocks,
        index_local_blocks, index_init_blocks)."""
        return Selection(self.index_block_size, self.index_topk_blocks, self.index_local_blocks,
                         self.index_init_blocks)

    # -- reading -----------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> "M3Config":
        """From a folder holding config.json or the file itself."""
        return load_config_file(path, cls.from_dict)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "M3Config":
        """From an HF config dict (nested ``text_config`` or flat)."""
        if not isinstance(raw, Mapping):
            raise ValueError("config must be a JSON object")
        shape = ModelShape.from_config(raw)
        cfg = raw.get("text_config", raw)
        legacy = cfg.get("sparse_attention_config") or {}
        L = shape.num_layers

        def get(key: str, default: Any) -> Any:
            return get_field(cfg, key, default)

        _check_value(cfg, "scoring_func", ("sigmoid",), "sigmoid")
        act = get("hidden_act", "swigluoai")
        if act not in _SWIGLU_ACTS:
            raise ValueError(f"config field 'hidden_act' is {act!r}; only 'swigluoai' (SwiGLU-OAI) is supported")
        check_fixed_fields(cfg, (("use_gemma_norm", True), ("use_qk_norm", True), ("attention_output_gate", False),
                           ("tie_word_embeddings", False)))
        _check_value(cfg, "qk_norm_type", ("per_head",), "per_head")
        score = legacy.get("sparse_score_type", cfg.get("index_score_type", "max"))
        if score != "max":
            raise ValueError(f"config field 'sparse_attention_config.sparse_score_type'={score!r} is unsupported: "
                             "only 'max' block scoring is implemented")
        sparse = [int(s) for s in shape.sparse_layers]
        dv = legacy.get("sparse_disable_index_value")
        if dv is not None:
            if not isinstance(dv, (list, tuple)) or len(dv) != L:
                raise ValueError(f"config field 'sparse_attention_config.sparse_disable_index_value' must be a list "
                                 f"with one entry per layer ({L}), got {dv!r}")
            bad = [i for i, (s, d) in enumerate(zip(sparse, dv)) if s and not d]
            if bad:
                raise ValueError("config field 'sparse_attention_config.sparse_disable_index_value' is 0 for sparse "
                                 f"layer(s) {bad[:8]}: the index value head is unsupported (M3 disables it in every "
                                 "sparse layer)")
        if shape.num_sparse_layers and shape.index_n_heads != shape.num_kv_heads:
            raise ValueError(f"config field 'index_n_heads / sparse_num_index_heads'={shape.index_n_heads} must equal "
                             f"num_key_value_heads={shape.num_kv_heads}: MSA uses one index head per KV group")
        local = _raw_pick(cfg, "index_local_blocks", legacy, "sparse_local_block")
        init = _raw_pick(cfg, "index_init_blocks", legacy, "sparse_init_block")

        theta, rot_type = _rope(cfg)
        if rot_type not in (None, "default"):
            raise ValueError(f"config field 'rope_scaling / rope_parameters.rope_type'={rot_type!r} is unsupported "
                             "(plain RoPE only)")
        head_dim = shape.head_dim
        rotary = get_rotary_dim(cfg, head_dim, check=True)
        tok = {k: cfg.get(k, raw.get(k)) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        dtype = cfg.get("torch_dtype", cfg.get("dtype"))
        any_moe = bool(shape.num_moe_layers)
        return cls(
            vocab_size=shape.vocab_size,
            hidden_size=shape.hidden_size,
            num_hidden_layers=L,
            num_attention_heads=shape.num_heads,
            num_key_value_heads=shape.num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=int(get("max_position_embeddings", 524288)),
            rms_norm_eps=get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rotary_dim=rotary,
            swiglu_alpha=get("swiglu_alpha", 1.702),
            swiglu_limit=get("swiglu_limit", 7.0),
            dense_intermediate_size=shape.dense_intermediate_size,
            intermediate_size=shape.expert_intermediate_size if any_moe else int(get("intermediate_size", 0)),
            shared_intermediate_size=shape.shared_intermediate_size,
            n_shared_experts=shape.n_shared_experts if any_moe else int(get("n_shared_experts", 0)),
            num_local_experts=shape.num_experts,
            num_experts_per_tok=shape.top_k if any_moe else int(get("num_experts_per_tok", 0)),
            routed_scaling_factor=get("routed_scaling_factor", 2.0),
            norm_topk_prob=get("norm_topk_prob", True),
            use_routing_bias=shape.use_routing_bias,
            moe_layer_freq=[int(m) for m in shape.moe_layers],
            sparse_attention_freq=sparse,
            index_n_heads=shape.index_n_heads or shape.num_kv_heads,
            index_head_dim=shape.index_head_dim or head_dim,
            index_block_size=shape.block_size or 128,
            index_topk_blocks=shape.topk or 16,
            index_local_blocks=1 if local is None else local,
            index_init_blocks=0 if init is None else init,
            initializer_range=get("initializer_range", 0.02),
            bos_token_id=tok["bos_token_id"],
            eos_token_id=tok["eos_token_id"],
            pad_token_id=tok["pad_token_id"],
            torch_dtype=str(dtype) if dtype is not None else None,
        )

    # -- writing -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A flat HF MiniMax-M3 text config (legacy sparse_attention_config / moe_layer_freq)."""
        L = self.num_hidden_layers
        d: dict[str, Any] = {
            "model_type": "minimax_m3_vl_text",
            "architectures": ["MiniMaxM3SparseForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": L,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "use_gemma_norm": True,
            "use_qk_norm": True,
            "qk_norm_type": "per_head",
            "attention_output_gate": False,
            "rope_theta": self.rope_theta,
            "rotary_dim": self.rotary_dim,
            "hidden_act": "swigluoai",
            "swiglu_alpha": self.swiglu_alpha,
            "swiglu_limit": self.swiglu_limit,
            "dense_intermediate_size": self.dense_intermediate_size,
            "intermediate_size": self.intermediate_size,
            "shared_intermediate_size": self.shared_intermediate_size,
            "n_shared_experts": self.n_shared_experts,
            "num_local_experts": self.num_local_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "scoring_func": "sigmoid",
            "use_routing_bias": self.use_routing_bias,
            "routed_scaling_factor": self.routed_scaling_factor,
            "norm_topk_prob": self.norm_topk_prob,
            "moe_layer_freq": list(self.moe_layer_freq),
            "num_mtp_modules": 0,
            "tie_word_embeddings": False,
            "initializer_range": self.initializer_range,
            "sparse_attention_config": {
                "use_sparse_attention": bool(any(self.sparse_attention_freq)),
                "sparse_index_dim": self.index_head_dim,
                "sparse_num_index_heads": self.index_n_heads,
                "sparse_topk_blocks": self.index_topk_blocks,
                "sparse_block_size": self.index_block_size,
                "sparse_score_type": "max",
                "sparse_init_block": self.index_init_blocks,
                "sparse_local_block": self.index_local_blocks,
                "sparse_attention_freq": list(self.sparse_attention_freq),
                "sparse_disable_index_value": [1] * L,
            },
        }
        for k in ("bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype"):
            v = getattr(self, k)
            if v is not None:
                d[k] = v
        return d

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write config.json into a folder (created) or to a *.json path; returns the file."""
        return write_config_json(path, self.to_dict())

    save_pretrained = save


# -- helpers ---------------------------------------------------------------------------------



def _pos_int(cfg: M3Config, f: str) -> None:
    v = getattr(cfg, f)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{f} must be a positive integer, got {v!r}")


def _nonneg_int(cfg: M3Config, f: str) -> None:
    v = getattr(cfg, f)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{f} must be a non-negative integer, got {v!r}")


def _layer_list(values: Any, f: str, L: int) -> list[int]:
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"{f} must be a list with one 0/1 entry per layer, got {values!r}")
    if len(values) != L:
        raise ValueError(f"{f} has {len(values)} entries but num_hidden_layers is {L}")
    out = []
    for v in values:
        if isinstance(v, (bool, int)) and int(v) in (0, 1):
            out.append(int(v))
        else:
            raise ValueError(f"{f} has invalid entry {v!r} (expected 0 or 1)")
    return out


def _check_value(cfg: Mapping[str, Any], key: str, allowed: tuple[str, ...], default: str) -> None:
    v = cfg.get(key, default)
    if v is None:
        return
    if v not in allowed:
        raise ValueError(f"config field '{key}'={v!r} is unsupported (supported: {', '.join(allowed)})")


def _raw_pick(cfg: Mapping[str, Any], flat: str, legacy: Mapping[str, Any], legacy_key: str) -> int | None:
    """An index setting as written (None if absent); the flat and legacy spellings must agree."""
    a, b = cfg.get(flat), legacy.get(legacy_key)
    for name, v in ((flat, a), (f"sparse_attention_config.{legacy_key}", b)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise ValueError(f"config field '{name}' must be an integer, got {v!r}")
    if a is not None and b is not None and a != b:
        raise ValueError(f"inconsistent config: {flat}={a} but sparse_attention_config.{legacy_key}={b}")
    return a if a is not None else b


def _rope(cfg: Mapping[str, Any]) -> tuple[float, str | None]:
    """(rope_theta, rope type or None) from rope_theta / rope_parameters / rope_scaling."""
    params = cfg.get("rope_parameters") or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"config field 'rope_parameters' must be an object, got {params!r}")
    scaling = cfg.get("rope_scaling")
    rtype = params.get("rope_type")
    if isinstance(scaling, Mapping):
        rtype = scaling.get("rope_type", scaling.get("type", rtype))
    elif scaling is not None:
        raise ValueError(f"config field 'rope_scaling' must be an object or null, got {scaling!r}")
    a, b = cfg.get("rope_theta"), params.get("rope_theta")
    if a is not None and b is not None and float(a) != float(b):
        raise ValueError(f"inconsistent config: rope_theta={a} but rope_parameters.rope_theta={b}")
    theta = a if a is not None else b
    if theta is None:
        theta = 5_000_000.0
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise ValueError(f"config field 'rope_theta' must be a number, got {theta!r}")
    return float(theta), rtype

