"""Cost model for MiniMax-M3 / M3.1-Flash style models, read from an HF ``config.json``.

Pure arithmetic on the config (standard library only; importing this module does not import
torch). Every figure follows the formulas in the MSA paper (arXiv 2606.13392, eq. 12) and the
MiniMax-M3.1-Flash model brief; the docstrings give each formula. Symbols:

    H_q, H_kv, d_h   query heads, key-value heads, head dimension
    H_idx, d_idx     index heads (one per KV group, so H_idx = H_kv in M3) and index dimension
    k, B_k           selected blocks per (query, group) and block size (tokens)
    N                context length (tokens)
    E, top_k         routed experts per MoE layer and experts used per token

Units: FLOP counts a multiply-add as 2; "values" are cached/read scalars (multiply by bytes per
value for bytes); GB means 1e9 bytes and KB 1e3 bytes (the brief's 145 GB is
69,120 values x 2 bytes x 1,048,576 tokens / 1e9 = 144.96).

Command line: ``msakit cost --config PATH [--context N] [--json]`` (`msakit.commands.cost`) prints
`report` / `format_report`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from msakit.config_io import get_int_field, read_config_json

__all__ = [
    "ModelShape",
    "DEFAULT_CONTEXT",
    "TABLE_CONTEXTS",
    "GB",
    "routed_expert_params",
    "attention_params",
    "index_params",
    "shared_expert_params",
    "dense_mlp_params",
    "mxfp8_group_params",
    "embedding_params",
    "router_params",
    "norm_params",
    "router_bias_params",
    "total_params",
    "active_routed_params",
    "active_params_per_token",
    "dense_attention_flops",
    "msa_attention_flops",
    "attention_flop_ratio",
    "attention_flop_ratio_limit",
    "model_attention_flops",
    "dense_layer_share",
    "all_sparse_saving",
    "linear_flops_per_token",
    "dense_decode_reads",
    "msa_decode_reads",
    "decode_read_ratio",
    "kv_cache_values_per_token",
    "kv_cache_bytes",
    "activation_bytes",
    "expert_bytes_per_token",
    "context_row",
    "report",
    "format_report",
    "add_parser",
]

DEFAULT_CONTEXT = 1_048_576
TABLE_CONTEXTS: tuple[int, ...] = (16_384, 131_072, 1_048_576)
GB = 1e9  # decimal gigabyte, as in the brief
BF16_BYTES = 2.0
FP8_BYTES = 1.0
FP4_BYTES = 0.5
NVFP4_BLOCK = 16  # one FP8 (E4M3) scale byte per 16 FP4 values
MXFP8_BLOCK = 32  # one E8M0 scale byte per 32 FP8 values

_SPARSE_NAMES = {"minimax_m3_sparse", "sparse_attention", "sparse", "msa"}
_DENSE_ATTN_NAMES = {"full_attention", "dense", "full"}
_MOE_NAMES = {"sparse", "moe"}
_DENSE_MLP_NAMES = {"dense", "mlp"}


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """The shape numbers a cost model needs, per-layer layouts as tuples of bools."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    expert_intermediate_size: int
    num_experts: int
    top_k: int
    sparse_layers: tuple[bool, ...]  # True where the layer uses MSA (else dense GQA)
    moe_layers: tuple[bool, ...]  # True where the FFN is MoE (else a dense MLP)
    dense_intermediate_size: int = 0
    shared_intermediate_size: int = 0
    n_shared_experts: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    block_size: int = 0
    topk: int = 0
    local_blocks: int = 1
    init_blocks: int = 0
    tie_word_embeddings: bool = False
    use_qk_norm: bool = True
    qk_norm_type: str = "per_head"
    use_routing_bias: bool = True
    name: str = ""

    def __post_init__(self) -> None:
        for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim"):
            if int(getattr(self, f)) <= 0:
                raise ValueError(f"{f} must be a positive integer, got {getattr(self, f)!r}")
        if len(self.sparse_layers) != self.num_layers:
            raise ValueError(f"layer_types / sparse_attention_freq has {len(self.sparse_layers)} "
                             f"entries but num_hidden_layers is {self.num_layers}")
        if len(self.moe_layers) != self.num_layers:
            raise ValueError(f"mlp_layer_types / moe_layer_freq has {len(self.moe_layers)} "
                             f"entries but num_hidden_layers is {self.num_layers}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) is not a multiple of "
                             f"num_key_value_heads ({self.num_kv_heads})")
        if self.num_moe_layers:
            for f in ("num_experts", "top_k", "expert_intermediate_size"):
                if getattr(self, f) <= 0:
                    raise ValueError(f"{_FIELD_NAMES[f]} must be positive when there are MoE "
                                     f"layers, got {getattr(self, f)!r}")
            if self.top_k > self.num_experts:
                raise ValueError(f"num_experts_per_tok ({self.top_k}) exceeds num_local_experts "
                                 f"({self.num_experts})")
            if self.n_shared_experts and self.shared_intermediate_size <= 0:
                raise ValueError("shared_intermediate_size must be positive when "
                                 "n_shared_experts > 0")
        if self.num_dense_mlp_layers and self.dense_intermediate_size <= 0:
            raise ValueError("dense_intermediate_size is required (positive) when some layers "
                             "have a dense MLP")
        if self.num_sparse_layers:
            for f in ("index_n_heads", "index_head_dim", "block_size", "topk"):
                if getattr(self, f) <= 0:
                    raise ValueError(f"{_FIELD_NAMES[f]} must be positive when some layers use "
                                     f"sparse attention, got {getattr(self, f)!r}")

    # -- derived counts ---------------------------------------------------------------------
    @property
    def num_sparse_layers(self) -> int:
        """Layers with MSA attention."""
        return sum(self.sparse_layers)

    @property
    def num_dense_attn_layers(self) -> int:
        """Layers with dense GQA attention."""
        return self.num_layers - self.num_sparse_layers

    @property
    def num_moe_layers(self) -> int:
        """Layers whose FFN is a mixture of experts."""
        return sum(self.moe_layers)

    @property
    def num_dense_mlp_layers(self) -> int:
        """Layers whose FFN is a dense MLP."""
        return self.num_layers - self.num_moe_layers

    @property
    def selected_tokens(self) -> int:
        """k * B_k: keys each (query, KV group) attends to in an MSA layer."""
        return self.topk * self.block_size

    def all_sparse(self) -> "ModelShape":
        """The same model with MSA in every layer (the M3 -> M3.1-Flash change)."""
        if not self.num_sparse_layers and (self.index_n_heads <= 0 or self.index_head_dim <= 0
                                           or self.block_size <= 0 or self.topk <= 0):
            raise ValueError("cannot make all layers sparse: the config has no index-branch "
                             "settings (index_n_heads, index_head_dim, index_block_size, "
                             "index_topk_blocks)")
        return dataclasses.replace(self, sparse_layers=(True,) * self.num_layers)

    def summary(self) -> dict[str, Any]:
        """A JSON-friendly dict of the shape, layouts summarised as counts and dense ids."""
        d = dataclasses.asdict(self)
        d.pop("sparse_layers")
        d.pop("moe_layers")
        d["num_sparse_layers"] = self.num_sparse_layers
        d["dense_attention_layer_ids"] = [i for i, s in enumerate(self.sparse_layers) if not s]
        d["num_moe_layers"] = self.num_moe_layers
        d["dense_mlp_layer_ids"] = [i for i, m in enumerate(self.moe_layers) if not m]
        return d

    # -- loading ----------------------------------------------------------------------------
    @classmethod
    def from_config(cls, source: str | os.PathLike[str] | Mapping[str, Any]) -> "ModelShape":
        """Read a shape from a folder holding ``config.json``, the file itself, or a dict.

        Accepts the nested (``text_config``) and flat forms, the legacy
        ``sparse_attention_config`` and the transformers flat names (``index_*``,
        ``layer_types``, ``mlp_layer_types``). Raises FileNotFoundError for a missing file and
        ValueError (naming the field) for missing or inconsistent values.
        """
        name = ""
        if isinstance(source, Mapping):
            raw: Mapping[str, Any] = source
        else:
            raw, path = read_config_json(source)
            name = str(path)
        if not isinstance(raw, Mapping):
            raise ValueError("config must be a JSON object")
        return _parse(raw, name)


_FIELD_NAMES = {
    "num_experts": "num_local_experts",
    "top_k": "num_experts_per_tok",
    "expert_intermediate_size": "intermediate_size",
    "index_n_heads": "index_n_heads / sparse_num_index_heads",
    "index_head_dim": "index_head_dim / sparse_index_dim",
    "block_size": "index_block_size / sparse_block_size",
    "topk": "index_topk_blocks / sparse_topk_blocks",
}


def _pick(flat: Mapping[str, Any], flat_key: str, legacy: Mapping[str, Any],
          legacy_key: str) -> int:
    """An index setting from the flat name or the legacy one; they must agree if both set."""
    a = get_int_field(flat, flat_key, required=False) if flat.get(flat_key) is not None else None
    b = get_int_field(legacy, legacy_key, required=False) if legacy.get(legacy_key) is not None else None
    if a is not None and b is not None and a != b:
        raise ValueError(f"inconsistent config: {flat_key}={a} but "
                         f"sparse_attention_config.{legacy_key}={b}")
    return a if a is not None else (b if b is not None else 0)


def _flags(values: Any, field: str, true_names: set[str], false_names: set[str]) -> list[bool]:
    """A per-layer list of 0/1, bools or type names as bools."""
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"config field '{field}' must be a list with one entry per layer, "
                         f"got {values!r}")
    out: list[bool] = []
    for v in values:
        if isinstance(v, str):
            if v in true_names:
                out.append(True)
            elif v in false_names:
                out.append(False)
            else:
                raise ValueError(f"config field '{field}' has unknown value {v!r} "
                                 f"(expected one of {sorted(true_names | false_names)})")
        elif isinstance(v, (bool, int)) and int(v) in (0, 1):
            out.append(bool(v))
        else:
            raise ValueError(f"config field '{field}' has invalid entry {v!r}")
    return out


def _parse(raw: Mapping[str, Any], name: str) -> ModelShape:
    cfg = raw.get("text_config", raw)
    if not isinstance(cfg, Mapping):
        raise ValueError("config field 'text_config' must be an object")
    layers = get_int_field(cfg, "num_hidden_layers")
    legacy = cfg.get("sparse_attention_config") or {}
    if not isinstance(legacy, Mapping):
        raise ValueError("config field 'sparse_attention_config' must be an object")

    # Attention layout: layer_types wins; legacy sparse_attention_freq must agree with it.
    from_types = (_flags(cfg["layer_types"], "layer_types", _SPARSE_NAMES, _DENSE_ATTN_NAMES)
                  if cfg.get("layer_types") is not None else None)
    from_freq = (_flags(legacy["sparse_attention_freq"], "sparse_attention_config."
                        "sparse_attention_freq", set(), set())
                 if legacy.get("sparse_attention_freq") is not None else None)
    if legacy.get("use_sparse_attention") is False and from_freq is not None:
        from_freq = [False] * len(from_freq)
    if from_types is not None and from_freq is not None and from_types != from_freq:
        raise ValueError("inconsistent config: layer_types and "
                         "sparse_attention_config.sparse_attention_freq disagree")
    sparse = from_types if from_types is not None else from_freq
    if sparse is None:  # transformers default: every layer full attention
        sparse = [False] * layers

    # FFN layout: mlp_layer_types or moe_layer_freq. Without either, transformers' M3 default is
    # all MoE; a config that names no experts (a dense HF config: Llama, Qwen2) is all dense MLP.
    names_experts = any(cfg.get(k) is not None for k in ("num_local_experts", "num_experts"))
    from_mlp = (_flags(cfg["mlp_layer_types"], "mlp_layer_types", _MOE_NAMES, _DENSE_MLP_NAMES)
                if cfg.get("mlp_layer_types") is not None else None)
    from_moe = (_flags(cfg["moe_layer_freq"], "moe_layer_freq", set(), set())
                if cfg.get("moe_layer_freq") is not None else None)
    if from_mlp is not None and from_moe is not None and from_mlp != from_moe:
        raise ValueError("inconsistent config: mlp_layer_types and moe_layer_freq disagree")
    moe = from_mlp if from_mlp is not None else from_moe
    if moe is None:
        moe = [names_experts] * layers
    any_moe, any_dense_mlp = any(moe), not all(moe)
    # A dense HF config: intermediate_size is the MLP width, head_dim defaults to hidden / heads.
    dense_hf = not any_moe and not names_experts
    dense_inter = get_int_field(cfg, "dense_intermediate_size", required=False)
    if dense_hf and not dense_inter:
        dense_inter = get_int_field(cfg, "intermediate_size", required=any_dense_mlp)
    elif any_dense_mlp and not dense_inter:
        raise ValueError("config is missing required field 'dense_intermediate_size'")
    head_dim = get_int_field(cfg, "head_dim", required=False)
    if not head_dim:
        heads = get_int_field(cfg, "num_attention_heads")
        if not dense_hf or get_int_field(cfg, "hidden_size") % heads:
            raise ValueError("config is missing required field 'head_dim'")
        head_dim = get_int_field(cfg, "hidden_size") // heads

    num_experts = get_int_field(cfg, "num_local_experts", required=False) or get_int_field(
        cfg, "num_experts", required=False)
    if any_moe and not num_experts:
        raise ValueError("config is missing required field 'num_local_experts'")
    shared_inter = get_int_field(cfg, "shared_intermediate_size", required=False)
    n_shared = get_int_field(cfg, "n_shared_experts", 1 if shared_inter else 0)
    tie = cfg.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))
    qk_norm_type = cfg.get("qk_norm_type", "per_head")
    if qk_norm_type not in ("per_head", "per_layer"):
        raise ValueError(f"config field 'qk_norm_type' has unknown value {qk_norm_type!r}")

    return ModelShape(
        vocab_size=get_int_field(cfg, "vocab_size"),
        hidden_size=get_int_field(cfg, "hidden_size"),
        num_layers=layers,
        num_heads=get_int_field(cfg, "num_attention_heads"),
        num_kv_heads=get_int_field(cfg, "num_key_value_heads"),
        head_dim=head_dim,
        expert_intermediate_size=(get_int_field(cfg, "intermediate_size") if any_moe else 0),
        num_experts=num_experts,
        top_k=get_int_field(cfg, "num_experts_per_tok", required=any_moe),
        sparse_layers=tuple(sparse),
        moe_layers=tuple(moe),
        dense_intermediate_size=dense_inter,
        shared_intermediate_size=shared_inter,
        n_shared_experts=n_shared if any_moe else 0,
        index_n_heads=_pick(cfg, "index_n_heads", legacy, "sparse_num_index_heads"),
        index_head_dim=_pick(cfg, "index_head_dim", legacy, "sparse_index_dim"),
        block_size=_pick(cfg, "index_block_size", legacy, "sparse_block_size"),
        topk=_pick(cfg, "index_topk_blocks", legacy, "sparse_topk_blocks"),
        local_blocks=_pick(cfg, "index_local_blocks", legacy, "sparse_local_block") or 1,
        init_blocks=_pick(cfg, "index_init_blocks", legacy, "sparse_init_block"),
        tie_word_embeddings=bool(tie),
        use_qk_norm=bool(cfg.get("use_qk_norm", not dense_hf)),  # Llama / Qwen2 have none
        qk_norm_type=str(qk_norm_type),
        use_routing_bias=bool(cfg.get("use_routing_bias", True)),
        name=name,
    )


# --------------------------------------------------------------------------------------------
# Parameter counts (exact integers)
# --------------------------------------------------------------------------------------------


def routed_expert_params(s: ModelShape) -> int:
    """Routed experts: moe_layers * E * 3 * hidden * expert_inter (w1, w3, w2)."""
    return s.num_moe_layers * s.num_experts * 3 * s.hidden_size * s.expert_intermediate_size


def attention_params(s: ModelShape) -> int:
    """q/k/v/o projections over all layers: layers * hidden * d_h * (2*H_q + 2*H_kv)."""
    return s.num_layers * s.hidden_size * s.head_dim * (2 * s.num_heads + 2 * s.num_kv_heads)


def index_params(s: ModelShape) -> int:
    """Index branch, per sparse layer: index_q_proj hidden -> H_idx*d_idx, index_k_proj
    hidden -> d_idx (one key shared by all groups): sparse_layers * hidden * d_idx*(H_idx+1)."""
    return s.num_sparse_layers * s.hidden_size * s.index_head_dim * (s.index_n_heads + 1)


def shared_expert_params(s: ModelShape) -> int:
    """Shared experts: moe_layers * n_shared * 3 * hidden * shared_inter."""
    return s.num_moe_layers * s.n_shared_experts * 3 * s.hidden_size * s.shared_intermediate_size


def dense_mlp_params(s: ModelShape) -> int:
    """Dense FFN layers: dense_mlp_layers * 3 * hidden * dense_inter."""
    return s.num_dense_mlp_layers * 3 * s.hidden_size * s.dense_intermediate_size


def mxfp8_group_params(s: ModelShape) -> int:
    """M3.1-Flash's MXFP8 group: attention + index branch + shared experts + dense MLPs."""
    return attention_params(s) + index_params(s) + shared_expert_params(s) + dense_mlp_params(s)


def embedding_params(s: ModelShape) -> int:
    """Token embeddings + output head: 2 * vocab * hidden (vocab * hidden when tied)."""
    return (1 if s.tie_word_embeddings else 2) * s.vocab_size * s.hidden_size


def router_params(s: ModelShape) -> int:
    """Router gates (kept FP32): moe_layers * E * hidden."""
    return s.num_moe_layers * s.num_experts * s.hidden_size


def norm_params(s: ModelShape) -> int:
    """RMSNorm gains (tiny, reported apart): per layer 2*hidden (input/post-attention) + q/k
    norms (d_h each if per_head, H*d_h if per_layer) + 2*d_idx per sparse layer; + final norm."""
    if not s.use_qk_norm:
        qk = 0
    elif s.qk_norm_type == "per_head":
        qk = 2 * s.head_dim
    else:
        qk = (s.num_heads + s.num_kv_heads) * s.head_dim
    return (s.num_layers * (2 * s.hidden_size + qk) + s.num_sparse_layers * 2 * s.index_head_dim
            + s.hidden_size)


def router_bias_params(s: ModelShape) -> int:
    """Routing correction bias (e_score_correction_bias, FP32): moe_layers * E."""
    return s.num_moe_layers * s.num_experts if s.use_routing_bias else 0


def total_params(s: ModelShape) -> int:
    """All text-model parameters (the vision tower is not counted)."""
    return (routed_expert_params(s) + mxfp8_group_params(s) + embedding_params(s)
            + router_params(s) + norm_params(s) + router_bias_params(s))


def active_routed_params(s: ModelShape) -> int:
    """Routed-expert parameters one token uses: moe_layers * top_k * 3 * hidden * expert_inter."""
    return s.num_moe_layers * s.top_k * 3 * s.hidden_size * s.expert_intermediate_size


def active_params_per_token(s: ModelShape, *, include_small: bool = True) -> int:
    """Parameters a token touches, excluding embeddings and output head: the MXFP8 group +
    top_k routed experts per MoE layer + router (+ norms and routing bias if include_small)."""
    n = mxfp8_group_params(s) + active_routed_params(s) + router_params(s)
    if include_small:
        n += norm_params(s) + router_bias_params(s)
    return n


def linear_flops_per_token(s: ModelShape) -> int:
    """Non-attention matmul FLOPs per token, excluding the output head: 2 * active matmul
    params (the brief's "about 47 GFLOPs, twice the 23.5B active parameters")."""
    return 2 * active_params_per_token(s, include_small=False)


# --------------------------------------------------------------------------------------------
# Attention FLOPs (sequence average per token, per layer)
# --------------------------------------------------------------------------------------------


def dense_attention_flops(s: ModelShape, n: int) -> float:
    """Dense causal GQA, per token per layer averaged over a length-N sequence: 2*H_q*d_h*N
    (the paper's 2*H_q*d_h*N^2 for the whole sequence divided by N)."""
    return 2.0 * s.num_heads * s.head_dim * n


def msa_attention_flops(s: ModelShape, n: int) -> float:
    """MSA per token per layer (sequence average): H_idx*d_idx*N (index branch) +
    4*H_q*d_h*k*B_k (main branch over the selected keys). Paper eq. 12 divided by N; H_idx is
    the number of index heads (= H_kv in M3). Assumes N >= k*B_k (else the layer is dense)."""
    index = float(s.index_n_heads * s.index_head_dim * n)
    main = 4.0 * s.num_heads * s.head_dim * s.topk * s.block_size
    return index + main


def attention_flop_ratio(s: ModelShape, n: int) -> float:
    """Dense GQA / MSA attention FLOPs at context N (16x at 131,072, 28.4x at 1,048,576)."""
    return dense_attention_flops(s, n) / msa_attention_flops(s, n)


def attention_flop_ratio_limit(s: ModelShape) -> float:
    """lim_{N->inf} of the ratio: 2*H_q*d_h / (H_idx*d_idx) (32x for M3); never reached."""
    return 2.0 * s.num_heads * s.head_dim / (s.index_n_heads * s.index_head_dim)


def model_attention_flops(s: ModelShape, n: int) -> dict[str, float]:
    """Attention FLOPs per token summed over layers: dense-attention layers, MSA layers, total."""
    dense = s.num_dense_attn_layers * dense_attention_flops(s, n)
    sparse = s.num_sparse_layers * msa_attention_flops(s, n) if s.num_sparse_layers else 0.0
    return {"dense_layers": dense, "sparse_layers": sparse, "total": dense + sparse}


def dense_layer_share(s: ModelShape, n: int) -> float:
    """Fraction of the model's attention FLOPs spent in its dense layers (M3: 60% at 1M)."""
    m = model_attention_flops(s, n)
    return m["dense_layers"] / m["total"]


def all_sparse_saving(s: ModelShape, n: int) -> float:
    """Attention FLOPs of this layout / the same config with every layer sparse
    (M3: 2.4x at 1M, 1.75x at 128K; an all-sparse config gives 1.0)."""
    return model_attention_flops(s, n)["total"] / model_attention_flops(s.all_sparse(), n)["total"]


# --------------------------------------------------------------------------------------------
# Decode reads and KV cache
# --------------------------------------------------------------------------------------------


def dense_decode_reads(s: ModelShape, n: int) -> float:
    """Values one decode step reads per dense layer: every cached K and V, 2*H_kv*d_h*N."""
    return 2.0 * s.num_kv_heads * s.head_dim * n


def msa_decode_reads(s: ModelShape, n: int) -> float:
    """Values one decode step reads per MSA layer: every index key (d_idx*N) plus K and V of
    the k*B_k selected tokens for each KV group (H_kv*k*B_k*2*d_h)."""
    return float(s.index_head_dim * n + s.num_kv_heads * s.selected_tokens * 2 * s.head_dim)


def decode_read_ratio(s: ModelShape, n: int) -> float:
    """Dense / MSA decode reads per layer (about 7.9x at 1M for M3)."""
    return dense_decode_reads(s, n) / msa_decode_reads(s, n)


def kv_cache_values_per_token(s: ModelShape) -> int:
    """Cached values per token over all layers: 2*H_kv*d_h per layer (K and V) + d_idx per
    sparse layer (the index key). MSA does not shrink this: any block may be selected later.
    69,120 for M3.1-Flash's 60 sparse layers."""
    return s.num_layers * 2 * s.num_kv_heads * s.head_dim + s.num_sparse_layers * s.index_head_dim


def kv_cache_bytes(s: ModelShape, n: int, bytes_per_value: float = BF16_BYTES) -> float:
    """KV-cache bytes for one sequence of N tokens (divide by GB=1e9 for the brief's GB)."""
    return kv_cache_values_per_token(s) * bytes_per_value * n


# --------------------------------------------------------------------------------------------
# Expert bytes per token
# --------------------------------------------------------------------------------------------


def activation_bytes(s: ModelShape, tokens: int, *, backward: bool = False, bytes_per_value: float = 4.0) -> float:
    """A lower bound of the activation memory of one forward over `tokens` tokens (batch x
    length): the float32 logits [tokens, vocab] and two hidden states [tokens, hidden] in
    `bytes_per_value`; with `backward`, also the logits' gradient and the hidden state every layer
    keeps for the backward.  Attention scores, MLP intermediates and the KV cache are left out,
    so a batch above this bound cannot fit, and one below it may still not."""
    logits = float(tokens) * s.vocab_size * 4.0
    hidden = float(tokens) * s.hidden_size * bytes_per_value
    if not backward:
        return logits + 2 * hidden
    return 2 * logits + (s.num_layers + 2) * hidden


def expert_bytes_per_token(s: ModelShape) -> dict[str, float]:
    """Routed-expert weight bytes one token reads (decode ceiling = bandwidth / bytes):
    BF16 2 bytes/value; NVFP4 0.5 byte/value packed plus one FP8 block scale per 16 values
    (1/16 byte/value; the per-tensor FP32 global scale is negligible and not counted)."""
    p = active_routed_params(s)
    packed = p * FP4_BYTES
    scales = p / NVFP4_BLOCK
    bf16 = p * BF16_BYTES
    return {
        "active_routed_params": p,
        "bf16_bytes": bf16,
        "nvfp4_packed_bytes": packed,
        "nvfp4_scale_bytes": scales,
        "nvfp4_total_bytes": packed + scales,
        "ratio_bf16_to_packed": bf16 / packed if p else 0.0,
        "ratio_bf16_to_nvfp4_total": bf16 / (packed + scales) if p else 0.0,
    }


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def context_row(s: ModelShape, n: int) -> dict[str, float]:
    """The per-context figures shown in the table."""
    row: dict[str, float] = {
        "context": n,
        "dense_flops_per_layer": dense_attention_flops(s, n),
        "kv_cache_gb_bf16": kv_cache_bytes(s, n) / GB,
        "model_attention_flops": model_attention_flops(s, n)["total"],
    }
    if _has_index(s):
        row.update({
            "msa_flops_per_layer": msa_attention_flops(s, n),
            "flop_ratio": attention_flop_ratio(s, n),
            "decode_read_ratio": decode_read_ratio(s, n),
            "dense_layer_share": dense_layer_share(s, n),
            "all_sparse_saving": all_sparse_saving(s, n),
        })
    return row


def _has_index(s: ModelShape) -> bool:
    return min(s.index_n_heads, s.index_head_dim, s.block_size, s.topk) > 0


def report(shape: ModelShape, context: int = DEFAULT_CONTEXT) -> dict[str, Any]:
    """All figures as a nested, JSON-serialisable dict (counts exact ints; FLOPs, values and
    bytes as floats; GB = 1e9 bytes)."""
    s, n = shape, int(context)
    if n <= 0:
        raise ValueError(f"context must be a positive number of tokens, got {context}")
    total = total_params(s)
    routed = routed_expert_params(s)
    params = {
        "routed_experts": routed,
        "mxfp8_group": {
            "total": mxfp8_group_params(s),
            "attention_qkvo": attention_params(s),
            "index_branch": index_params(s),
            "shared_experts": shared_expert_params(s),
            "dense_mlps": dense_mlp_params(s),
        },
        "embeddings_and_head": embedding_params(s),
        "router": router_params(s),
        "norms": norm_params(s),
        "router_bias": router_bias_params(s),
        "total": total,
        "routed_share": routed / total,
        "active_routed_per_token": active_routed_params(s),
        "active_per_token": active_params_per_token(s),
    }
    attn: dict[str, Any] = {"context": n, "dense_per_layer": dense_attention_flops(s, n)}
    decode: dict[str, Any] = {"context": n, "dense_per_layer": dense_decode_reads(s, n)}
    m = model_attention_flops(s, n)
    attn["model"] = dict(m)
    if _has_index(s):
        attn.update({
            "msa_per_layer": msa_attention_flops(s, n),
            "msa_index_branch_per_layer": float(s.index_n_heads * s.index_head_dim * n),
            "msa_main_branch_per_layer":
                4.0 * s.num_heads * s.head_dim * s.topk * s.block_size,
            "ratio": attention_flop_ratio(s, n),
            "ratio_limit": attention_flop_ratio_limit(s),
        })
        attn["model"].update({
            "dense_layer_share": dense_layer_share(s, n),
            "all_sparse_total": model_attention_flops(s.all_sparse(), n)["total"],
            "all_sparse_saving": all_sparse_saving(s, n),
        })
        decode.update({
            "msa_per_layer": msa_decode_reads(s, n),
            "ratio": decode_read_ratio(s, n),
        })
    decode["model_total"] = (s.num_dense_attn_layers * dense_decode_reads(s, n)
                             + (s.num_sparse_layers * msa_decode_reads(s, n)
                                if s.num_sparse_layers else 0.0))
    kv_values = kv_cache_values_per_token(s)
    contexts = sorted(set(TABLE_CONTEXTS) | {n})
    return {
        "config": s.summary(),
        "context": n,
        "units": {"flops": "FLOP (multiply-add = 2)", "values": "scalars", "GB": "1e9 bytes",
                  "KB": "1e3 bytes"},
        "parameters": params,
        "attention_flops_per_token": attn,
        "linear_flops_per_token": linear_flops_per_token(s),
        "decode_reads_per_step": decode,
        "kv_cache": {
            "values_per_token": kv_values,
            "bytes_per_token_bf16": kv_values * BF16_BYTES,
            "context": n,
            "gb_per_sequence_bf16": kv_cache_bytes(s, n, BF16_BYTES) / GB,
            "gb_per_sequence_8bit": kv_cache_bytes(s, n, FP8_BYTES) / GB,
        },
        "expert_bytes_per_token": expert_bytes_per_token(s),
        "table": [context_row(s, c) for c in contexts],
    }


def _g(x: float, unit: str = "", scale: float = 1e9, digits: int = 2) -> str:
    return f"{x / scale:,.{digits}f}{(' ' + unit) if unit else ''}"


_LABEL_W = 42  # label column, including the two-space indent
_VALUE_W = 22  # right-aligned value column (units included)


def _line(label: str, value: str, note: str = "") -> str:
    return f"  {label:<{_LABEL_W - 2}}{value:>{_VALUE_W}}" + (f"   {note}" if note else "")


def format_report(r: dict[str, Any]) -> str:
    """Human-readable text of a `report` dict: aligned columns, thousands separators, units."""
    c, p = r["config"], r["parameters"]
    n = r["context"]
    lines: list[str] = []
    add = lines.append
    n_dense_attn = c["num_layers"] - c["num_sparse_layers"]
    n_dense_mlp = c["num_layers"] - c["num_moe_layers"]
    add(f"msakit cost: {c['name'] or '<dict config>'}")
    add(f"  layers {c['num_layers']}: attention {c['num_sparse_layers']} MSA + {n_dense_attn} "
        f"dense{_ids(c['dense_attention_layer_ids'])}; FFN {c['num_moe_layers']} MoE + "
        f"{n_dense_mlp} dense{_ids(c['dense_mlp_layer_ids'])}")
    add(f"  hidden {c['hidden_size']:,}; heads {c['num_heads']} q / {c['num_kv_heads']} kv x "
        f"{c['head_dim']}; vocab {c['vocab_size']:,}; tied embeddings: "
        f"{'yes' if c['tie_word_embeddings'] else 'no'}")
    if c["index_n_heads"]:
        add(f"  index {c['index_n_heads']} heads x {c['index_head_dim']}; top-{c['topk']} "
            f"blocks of {c['block_size']} (= {c['topk'] * c['block_size']:,} keys per "
            f"KV group)")
    add(f"  experts {c['num_experts']} routed (top-{c['top_k']}) x "
        f"{c['expert_intermediate_size']:,} + {c['n_shared_experts']} shared x "
        f"{c['shared_intermediate_size']:,}; dense MLP {c['dense_intermediate_size']:,}")
    add("")

    mx = p["mxfp8_group"]
    tot = p["total"]
    add(f"{'Parameters (text model, no vision)':<{_LABEL_W}}"
        f"{'count':>{_VALUE_W}}   share")

    def prow(label: str, v: int, share: bool = True) -> None:
        add(_line(label, f"{v:,}", f"{100 * v / tot:6.2f} %" if share else ""))

    prow("routed experts (NVFP4 group)", p["routed_experts"])
    prow("MXFP8 group", mx["total"])
    prow("  attention q/k/v/o", mx["attention_qkvo"], False)
    prow("  index branch (index_q/k_proj)", mx["index_branch"], False)
    prow("  shared experts", mx["shared_experts"], False)
    prow("  dense MLPs", mx["dense_mlps"], False)
    prow("embeddings + output head (BF16)", p["embeddings_and_head"])
    prow("router gates (FP32)", p["router"])
    prow("norm weights", p["norms"])
    prow("routing bias (FP32)", p["router_bias"])
    prow("total", tot)
    add(_line("active per token (excl. emb/head)", f"{p['active_per_token']:,}",
              f"({p['active_per_token'] / 1e9:.1f} B)"))
    add(_line("  of which routed experts", f"{p['active_routed_per_token']:,}"))
    add("")

    a = r["attention_flops_per_token"]
    am = a["model"]
    add(f"Attention FLOPs per token at context {n:,} (sequence average: paper eq. 12 / N)")
    add(_line("dense GQA per layer      2*Hq*dh*N", _g(a["dense_per_layer"], "GFLOP")))
    if "msa_per_layer" in a:
        add(_line("MSA per layer", _g(a["msa_per_layer"], "GFLOP")))
        add(_line("  index branch           Hidx*didx*N",
                  _g(a["msa_index_branch_per_layer"], "GFLOP")))
        add(_line("  main branch            4*Hq*dh*k*Bk",
                  _g(a["msa_main_branch_per_layer"], "GFLOP")))
        add(_line("ratio dense / MSA", f"{a['ratio']:.1f} x",
                  f"limit 2*Hq*dh/(Hidx*didx) = {a['ratio_limit']:.1f} x, never reached"))
    add(_line("model total, this layout", _g(am["total"], "GFLOP")))
    if "dense_layer_share" in am:
        add(_line("  share in dense-attention layers", f"{100 * am['dense_layer_share']:.1f} %"))
        add(_line("same config, every layer MSA", _g(am["all_sparse_total"], "GFLOP"),
                  f"saving {am['all_sparse_saving']:.2f} x"))
    add(_line("rest of network (2 x active params)", _g(r["linear_flops_per_token"], "GFLOP")))
    add("")

    d = r["decode_reads_per_step"]
    add(f"Decode reads per step at context {n:,} (values)")
    add(_line("dense GQA per layer      2*Hkv*dh*N", _g(d["dense_per_layer"], "M", 1e6, 1)))
    if "msa_per_layer" in d:
        add(_line("MSA per layer   didx*N + Hkv*k*Bk*2*dh", _g(d["msa_per_layer"], "M", 1e6, 1)))
        add(_line("ratio dense / MSA", f"{d['ratio']:.1f} x"))
    add(_line("model total, this layout", _g(d["model_total"], "M", 1e6, 1)))
    add("")

    kv = r["kv_cache"]
    add("KV cache (MSA keeps every K and V, plus one index key per token per MSA layer)")
    add(_line("values per token, all layers", f"{kv['values_per_token']:,}"))
    add(_line("bytes per token, BF16", _g(kv["bytes_per_token_bf16"], "KB", 1e3, 1)))
    add(_line(f"one {n:,}-token sequence, BF16", _g(kv["gb_per_sequence_bf16"], "GB", 1)))
    add(_line(f"one {n:,}-token sequence, 8-bit", _g(kv["gb_per_sequence_8bit"], "GB", 1)))
    add("")

    e = r["expert_bytes_per_token"]
    add("Routed-expert weight bytes read per token (decode ceiling = bandwidth / bytes)")
    add(_line("active routed parameters", f"{e['active_routed_params']:,}"))
    add(_line("BF16, 2 bytes/value", _g(e["bf16_bytes"], "GB")))
    add(_line("NVFP4 packed, 0.5 byte/value", _g(e["nvfp4_packed_bytes"], "GB"),
              f"BF16 / packed = {e['ratio_bf16_to_packed']:.1f} x"))
    add(_line("  + block scales, 1 byte per 16 values", _g(e["nvfp4_scale_bytes"], "GB")))
    add(_line("  = NVFP4 total", _g(e["nvfp4_total_bytes"], "GB"),
              f"BF16 / total = {e['ratio_bf16_to_nvfp4_total']:.2f} x"))
    add("")

    add("By context (attention FLOPs per token: per layer, and model = summed over layers)")
    add(f"  {'context':>11}{'dense/layer':>13}{'MSA/layer':>11}{'FLOP ratio':>12}"
        f"{'decode ratio':>14}{'model attn':>13}{'dense share':>13}{'all-MSA saving':>16}"
        f"{'KV BF16':>10}")
    for row in r["table"]:
        mark = " *" if row["context"] == n else "  "
        if "flop_ratio" in row:
            mid = (f"{_g(row['msa_flops_per_layer'], 'GF'):>11}{row['flop_ratio']:>10.1f} x"
                   f"{row['decode_read_ratio']:>12.1f} x")
            tail = f"{100 * row['dense_layer_share']:>11.1f} %{row['all_sparse_saving']:>14.2f} x"
        else:
            mid = f"{'-':>11}{'-':>12}{'-':>14}"
            tail = f"{'-':>13}{'-':>16}"
        add(f"{mark}{row['context']:>11,}{_g(row['dense_flops_per_layer'], 'GF'):>13}{mid}"
            f"{_g(row['model_attention_flops'], 'GF'):>13}{tail}"
            f"{_g(row['kv_cache_gb_bf16'], 'GB', 1, 1):>10}")
    add("  (* = --context;  GF = 1e9 FLOP, multiply-add = 2;  GB = 1e9 bytes;  KB = 1e3 bytes)")
    return "\n".join(lines)


def _ids(ids: Sequence[int]) -> str:
    if not ids:
        return ""
    if list(ids) == list(range(ids[0], ids[-1] + 1)) and len(ids) > 2:
        return f" (layers {ids[0]}-{ids[-1]})"
    return " (layer" + ("s " if len(ids) > 1 else " ") + ", ".join(map(str, ids)) + ")"

