"""Dense -> MSA conversion (the paper's "near-lossless conversion from pretrained GQA checkpoints").

Two sources:

- msakit's own `M3ForCausalLM` whose config has dense-attention layers (sparse_attention_freq 0):
  those layers get a freshly initialised index branch and their freq becomes 1.  Every other
  weight is copied, so in "dense" mode the converted model computes exactly what it did before.
- HF Llama / Qwen2 / Qwen3 / Mistral style models (loaded through `transformers` from a local
  folder): `MSAWrappedModel` keeps the HF model and its own attention math (projections, q/k
  norms, RoPE, GQA) and only swaps the attention core through transformers' attention
  interface: "dense" mode runs HF's SDPA attention unchanged; "sparse" mode runs
  `ops.index_topk` + `ops.sparse_attention` over HF's q/k/v (after HF's RoPE).  Each converted
  layer's attention module gains an index branch (`index_q_proj`, `index_k_proj`,
  `index_q_norm`, `index_k_norm`, the M3 names) reading the layer's input `hidden.detach()`, with
  its own partial NeoX RoPE (`rotary_dim` dims, the HF model's rope_theta; Llama's main RoPE
  rotates every dim and has no q/k norm, which the main branch keeps).

Both return a model in "dense" mode with the training interface of `M3ForCausalLM`:
`forward(input_ids, labels, positions, cu_seqlens, compute_kl, return_attn_inputs) -> M3Output`
(loss, kl, expert_load), `set_attention_mode`, `update_routing_bias` (a no-op without MoE),
`save_pretrained` / `from_pretrained`, `generate`.

`load_for_conversion(path)` picks the loader by config.json's model_type.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from msakit.cache.base import HeldKeys, KVCacheProtocol
from msakit.models.config import M3_MODEL_TYPES
from msakit.models.modeling import (
    M3ForCausalLM,
    M3Output,
    document_segments,
    index_parameters,
    lm_loss,
    segment_positions,
)
from msakit.nn.attention import INDEX_MODULES, KL_TOKENS, MODES, MSAConfig
from msakit.nn.core import attend, selection_info
from msakit.ops.index_topk import Selection
from msakit.nn.norm import GemmaRMSNorm
from msakit.nn.rope import apply_partial_rope, rope_cos_sin

__all__ = [
    "HF_MODEL_TYPES",
    "MSASettings",
    "MSAWrappedModel",
    "add_index_branches",
    "convert_dense_to_msa",
    "init_index_from_qk",
    "is_msa_folder",
    "load_for_conversion",
    "msa_hf_classes",
    "register_hf_attention",
    "register_transformers",
]

HF_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
MSA_PREFIX = "msakit_"  # model_type of a saved MSA folder: "msakit_<family>"
CONFIG_KEY = "msakit_msa"  # config.json key of the MSASettings
ATTN_IMPL = "msakit_msa"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")
INDEX_INITS = ("random", "qk")


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------


def load_for_conversion(path: str | os.PathLike[str], device: Any = None, dtype: torch.dtype | None = None) -> nn.Module:
    """Load a model folder: msakit / MiniMax-M3 (`M3ForCausalLM`), a saved `MSAWrappedModel`, or
    an HF Llama-style model (through transformers, offline).  Decided by config.json's model_type."""
    from msakit.config_io import read_config_json

    folder = Path(path)
    raw, cfg_path = read_config_json(folder / "config.json", "config.json")
    model_type = raw.get("model_type")
    if is_msa_folder(folder):
        return MSAWrappedModel.from_pretrained(folder, device=device, dtype=dtype)
    if model_type in M3_MODEL_TYPES:
        return M3ForCausalLM.from_pretrained(folder, device=device, dtype=dtype)
    if model_type not in HF_MODEL_TYPES:
        raise ValueError(f"{cfg_path}: model_type {model_type!r} is not supported for conversion "
                         f"(msakit/MiniMax-M3: {', '.join(M3_MODEL_TYPES)}; HF: {', '.join(HF_MODEL_TYPES)})")
    return _load_hf(folder, device, dtype)


def convert_dense_to_msa(
    model_or_path: nn.Module | str | os.PathLike[str],
    *,
    index_head_dim: int | None = None,
    block_size: int | None = None,
    topk: int | None = None,
    local_blocks: int | None = None,
    init_blocks: int | None = None,
    rotary_dim: int | None = None,
    layers: Sequence[int] | None = None,
    seed: int = 0,
    index_init: str = "random",
    device: Any = None,
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """Add MSA index branches to a dense model; returns a model in "dense" mode whose outputs
    equal the source's.  Unset sizes default to the source config's (msakit) or to
    index_head_dim = head_dim, block 128, top-16, local 1, init 0, rotary_dim = min(64, Di / 2) (HF).
    `layers`: which layers get an index branch (default every dense-attention layer).
    index_init: "random" (normal(0, initializer_range), seeded) or "qk" (`init_index_from_qk`: from
    the main q/k projections; HF models then default to rotary_dim = head_dim, the main RoPE's)."""
    if index_init not in INDEX_INITS:
        raise ValueError(f"index_init must be one of {INDEX_INITS}, got {index_init!r}")
    for name, val, lo in (("index_head_dim", index_head_dim, 1), ("block_size", block_size, 1),
                          ("topk", topk, 1), ("local_blocks", local_blocks, 0),
                          ("init_blocks", init_blocks, 0), ("rotary_dim", rotary_dim, 0)):
        if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < lo):
            raise ValueError(f"{name} must be an integer >= {lo} (or None for the default), got {val!r}")
    model = model_or_path
    if isinstance(model_or_path, (str, os.PathLike)):
        model = load_for_conversion(model_or_path, device=device, dtype=dtype)
    if isinstance(model, MSAWrappedModel):
        raise ValueError("the model already has MSA index branches (an MSAWrappedModel)")
    opts = dict(index_head_dim=index_head_dim, block_size=block_size, topk=topk,
                local_blocks=local_blocks, init_blocks=init_blocks, layers=layers, seed=seed)
    if isinstance(model, M3ForCausalLM):
        if rotary_dim is not None and rotary_dim != model.config.rotary_dim:
            raise ValueError(f"rotary_dim={rotary_dim}: an M3 index branch uses the main branch's partial RoPE "
                             f"(rotary_dim={model.config.rotary_dim})")
        new = _convert_m3(model, **opts)
    elif _is_hf_causal_lm(model):
        if index_init == "qk" and rotary_dim is None:
            cfg = model.config
            rotary_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        new = MSAWrappedModel.wrap(model, rotary_dim=rotary_dim, **opts)
    else:
        raise ValueError(f"cannot convert a {type(model).__name__}: expected an M3ForCausalLM, an HF causal LM "
                     f"({', '.join(HF_MODEL_TYPES)}) or a model folder")
    if index_init == "qk":
        init_index_from_qk(new)
    return new


# ---------------------------------------------------------------------------------------------
# msakit M3 models
# ---------------------------------------------------------------------------------------------


def _normal_init(params: Sequence[torch.Tensor], std: float, seed: int) -> None:
    """Deterministic normal(0, std) init, drawn on the CPU whatever the device."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=g))


def _convert_m3(
    model: M3ForCausalLM, *, index_head_dim, block_size, topk, local_blocks, init_blocks, layers, seed
) -> M3ForCausalLM:
    cfg = model.config
    dense_layers = [i for i in range(cfg.num_hidden_layers) if not cfg.is_sparse(i)]
    todo = sorted(set(dense_layers if layers is None else layers))
    bad = [i for i in todo if not 0 <= i < cfg.num_hidden_layers]
    if bad:
        raise ValueError(f"layers {bad} out of range (num_hidden_layers={cfg.num_hidden_layers})")
    already = [i for i in todo if cfg.is_sparse(i)]
    if already:
        raise ValueError(f"layers {already} already have an index branch")
    if not todo:
        raise ValueError("the model already has MSA in every layer: nothing to convert")
    changes: dict[str, Any] = {}
    for key, val in (("index_head_dim", index_head_dim), ("index_block_size", block_size),
                     ("index_topk_blocks", topk), ("index_local_blocks", local_blocks),
                     ("index_init_blocks", init_blocks)):
        if val is not None:
            if cfg.num_sparse_layers and getattr(cfg, key) != val:
                raise ValueError(f"{key}={val} differs from the model's existing MSA layers ({getattr(cfg, key)})")
            changes[key] = val
    freq = list(cfg.sparse_attention_freq)
    for i in todo:
        freq[i] = 1
    if not cfg.num_sparse_layers:
        changes.setdefault("index_head_dim", max(cfg.index_head_dim, cfg.rotary_dim))
    new_cfg = cfg.replace(sparse_attention_freq=freq, index_n_heads=cfg.num_key_value_heads, **changes)
    p = next(model.parameters())
    with torch.device("meta"):
        new = M3ForCausalLM(new_cfg, mode="dense", init=False)
    new.to(p.dtype)
    new.to_empty(device=p.device)
    missing, unexpected = new.load_state_dict(model.state_dict(), strict=False)
    fresh = [n for n in missing if any(f".self_attn.{k}." in n for k in INDEX_MODULES)]
    if unexpected or len(fresh) != len(missing):
        raise ValueError(f"conversion mismatch: missing {sorted(set(missing) - set(fresh))[:6]}, unexpected {unexpected[:6]}")
    params = dict(new.named_parameters())
    projs = [params[n] for n in sorted(fresh) if n.endswith("_proj.weight")]
    _normal_init(projs, new_cfg.initializer_range, seed)
    with torch.no_grad():
        for n in fresh:
            if "_norm." in n:
                params[n].zero_()
    new.set_attention_mode("dense")
    new.train(model.training)
    return new


# ---------------------------------------------------------------------------------------------
# HF models
# ---------------------------------------------------------------------------------------------


@dataclass
class MSASettings:
    """Index-branch settings of an `MSAWrappedModel` (saved in config.json under "msakit_msa")."""

    index_head_dim: int
    selection: Selection = dataclasses.field(default_factory=Selection)
    rotary_dim: int = 64
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    layers: list[int] | None = None
    mode: str = "dense"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        sel = d.pop("selection")
        d.update(block_size=sel["block_size"], topk=sel["topk"], local_blocks=sel["local_blocks"],
                 init_blocks=sel["init_blocks"])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "MSASettings":
        """From `to_dict`'s dict (folders written before the selection had one object name top-k
        "topk_blocks": read too)."""
        sel = Selection(int(d.get("block_size", 128)), int(d.get("topk", d.get("topk_blocks", 16))),
                        int(d.get("local_blocks", 1)), int(d.get("init_blocks", 0)))
        known = {f.name for f in dataclasses.fields(cls)} - {"selection"}
        return cls(selection=sel, **{k: v for k, v in d.items() if k in known})


def _is_hf_causal_lm(model: Any) -> bool:
    cfg = getattr(model, "config", None)
    return (isinstance(model, nn.Module) and cfg is not None and hasattr(cfg, "model_type")
            and hasattr(getattr(model, "model", None), "layers"))


def _load_hf(folder: Path, device: Any, dtype: torch.dtype | None) -> nn.Module:
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:  # pragma: no cover - transformers is in the env
        raise ValueError(f"loading the HF model in {folder} needs `transformers` (pip install msakit[hf])") from None
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype or torch.float32, local_files_only=True)
    if device is not None:
        model.to(device)
    return model


def _rope_theta(cfg: Any) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(cfg, "rope_theta", 10000.0))


class _CallState:
    """Per-forward settings and results shared by the wrapper and its patched attention modules."""

    def __init__(self, cfg: MSAConfig, settings: MSASettings) -> None:
        self.cfg = cfg
        self.settings = settings
        self.mode = settings.mode
        self.compute_kl = False
        self.want_inputs = False
        self.segments: list[tuple[int, int]] = []
        self.positions: torch.Tensor | None = None
        self.cache: Any = None  # a msakit.cache.KVCacheProtocol during a cached wrapper forward
        self.kls: list[torch.Tensor] = []
        self.inputs: dict[int, dict[str, Any]] = {}
        self.policy: Callable[..., torch.Tensor] | None = None  # `MSAWrappedModel.set_selection_policy`


def _capture_hidden(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of a converted attention module: its input and HF's cache object (if any)."""
    module.__dict__["_msakit_hidden"] = kwargs.get("hidden_states", args[0] if args else None)
    module.__dict__["_msakit_hf_cache"] = kwargs.get("cache", kwargs.get("past_key_values"))


def _index_project(module: nn.Module, hidden: torch.Tensor, positions: torch.Tensor, cfg: MSAConfig):
    B, T, _ = hidden.shape
    h = hidden.detach()  # stop-gradient: the KL never reaches the backbone through the indexer input
    G, Di = cfg.num_kv_heads, cfg.index_dim
    q_idx = module.index_q_norm(module.index_q_proj(h).view(B, T, G, Di))
    k_idx = module.index_k_norm(module.index_k_proj(h).view(B, T, 1, Di))
    cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta)
    return apply_partial_rope(q_idx, cos, sin), apply_partial_rope(k_idx, cos, sin).squeeze(2)


def _held_index_keys(hf_cache: Any, layer: int, k_idx: torch.Tensor, past: int) -> torch.Tensor:
    """The index keys [B, past + Tq, Di] of every position HF's cache holds for `layer`: those kept
    beside the cache (attribute `msakit_index_keys`, cut to `past` after a crop) + the new ones."""
    store = hf_cache.__dict__.setdefault("msakit_index_keys", {})
    held = store.get(layer)
    if past and (held is None or held.shape[1] < past):
        raise ValueError("the HF cache holds keys written without msakit's attention (no index keys for them)")
    if past:
        k_idx = torch.cat([held[:, :past], k_idx], dim=1)
    store[layer] = k_idx
    return k_idx


def _msa_attention_interface(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention interface "msakit_msa": HF's q/k/v [B, H, T, D] after RoPE.

    Three ways in, each through the attention core (`msakit.nn.core.attend`): the wrapper's cached
    forward (a msakit cache: HF ran without its own, q/k/v are the new positions'; the cache
    stores them and the core attends its view), HF's own cache (plain transformers generate:
    key/value hold every position; the index keys are kept beside HF's cache), or a full sequence
    (training, prefill)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    st: _CallState | None = module.__dict__.get("_msakit_state")
    hidden = module.__dict__.pop("_msakit_hidden", None)
    hf_cache = module.__dict__.pop("_msakit_hf_cache", None)
    layer = module.__dict__.get("_msakit_layer")
    if st is None or layer is None or hidden is None:  # not converted: HF's own SDPA math
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    q = query.transpose(1, 2).contiguous()
    k = key.transpose(1, 2).contiguous()
    v = value.transpose(1, 2).contiguous()
    Tq, Tk = q.shape[1], k.shape[1]
    cfg = st.cfg
    if st.cache is not None:
        if scaling is not None and abs(scaling * math.sqrt(q.shape[-1]) - 1.0) > 1e-6:
            raise ValueError(f"msakit's caches attend with scale 1/sqrt(head_dim); this model uses {scaling}")
        q_idx, k_idx = _index_project(module, hidden, st.positions, cfg)
        st.cache.write(layer, k, v, k_idx)
        return attend(q, q_idx, st.cache.view(layer), cfg.selection, mode=st.mode)[0], None
    positions = st.positions
    if positions is None:
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(Tk - Tq, Tk, device=q.device).unsqueeze(0)
    q_idx, k_idx = _index_project(module, hidden, positions, cfg)
    if hf_cache is not None:
        k_idx = _held_index_keys(hf_cache, layer, k_idx, Tk - Tq)
        if Tq != Tk:
            if st.mode == "sparse":
                return attend(q, q_idx, HeldKeys(k, v, k_idx), cfg.selection, mode="sparse", softmax_scale=scaling)[0], None
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, **kwargs)
    elif Tq != Tk:
        raise ValueError(f"{Tk} keys for {Tq} queries without a cache")
    segments = st.segments or [(0, Tq)]  # the HF model called directly, not through the wrapper
    block_idx = None
    if st.policy is not None and st.mode == "sparse":
        if len(segments) > 1:
            raise ValueError("a selection policy takes one unpacked sequence per row")
        with torch.no_grad():
            block_idx = st.policy(layer, q, k, q_idx, k_idx, cfg.selection)
    o, kl, bidx = attend(q, q_idx, HeldKeys(k, v, k_idx), cfg.selection, mode=st.mode, compute_kl=st.compute_kl,
                         kl_tokens=cfg.kl_tokens, need_block_idx=st.want_inputs, segments=segments,
                         softmax_scale=scaling, block_idx=block_idx)
    if kl is not None:
        st.kls.append(kl)
    if st.want_inputs:
        st.inputs[layer] = dict(q=q.detach(), k=k.detach(), q_idx=q_idx.detach(), k_idx=k_idx.detach(), block_idx=bidx,
                                **selection_info(cfg.selection, segments))
    return o, None


_registered: set[str] = set()


def register_hf_attention(name: str, fn: Callable[..., Any]) -> None:
    """Registers `fn` as the transformers attention implementation `name` (`attn_implementation`),
    once per name: `fn(module, query, key, value, attention_mask, **kwargs) -> (out, weights)`."""
    if name not in _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(name, fn)
        _registered.add(name)


def msa_config(hf_config: Any, settings: MSASettings) -> MSAConfig:
    """The MSAConfig of an HF model's converted layers."""
    heads = hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    if settings.rotary_dim > head_dim:
        raise ValueError(f"rotary_dim={settings.rotary_dim} exceeds head_dim={head_dim}")
    return MSAConfig(
        hidden_size=hf_config.hidden_size, num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
        index_dim=settings.index_head_dim, rotary_dim=settings.rotary_dim, rope_theta=settings.rope_theta,
        rms_norm_eps=settings.rms_norm_eps, selection=settings.selection,
    )


def add_index_branches(hf_model: nn.Module, settings: MSASettings, *, seed: int | None = 0) -> None:
    """Give each of `settings.layers` of an HF causal LM an index branch (in place; the M3 names
    under `self_attn.`) and switch it to msakit's attention implementation.  seed None leaves the
    new projections uninitialised (weights loaded next)."""
    cfg = hf_model.config
    base = base_model_type(cfg.model_type)
    if base not in HF_MODEL_TYPES:
        raise ValueError(f"HF model_type {cfg.model_type!r} is not supported (supported: {', '.join(HF_MODEL_TYPES)})")
    if getattr(cfg, "use_sliding_window", False) or (getattr(cfg, "sliding_window", None) and base == "mistral"):
        raise ValueError("sliding-window attention is not supported by the MSA wrapper")
    if "_msakit_state" in hf_model.__dict__:
        raise ValueError("the model already has MSA index branches")
    register_transformers()
    n_layers = len(hf_model.model.layers)
    if settings.layers is None:
        settings.layers = list(range(n_layers))
    bad = [i for i in settings.layers if not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"layers {bad} out of range (the model has {n_layers})")
    sel = msa_config(cfg, settings)
    state = _CallState(sel, settings)
    H, G, Di = cfg.hidden_size, sel.num_kv_heads, settings.index_head_dim
    fresh: list[torch.Tensor] = []
    for i in settings.layers:
        attn = hf_model.model.layers[i].self_attn
        w = attn.q_proj.weight
        attn.index_q_proj = nn.Linear(H, G * Di, bias=False, device=w.device, dtype=w.dtype)
        attn.index_k_proj = nn.Linear(H, Di, bias=False, device=w.device, dtype=w.dtype)
        attn.index_q_norm = GemmaRMSNorm(Di, settings.rms_norm_eps).to(device=w.device, dtype=w.dtype)
        attn.index_k_norm = GemmaRMSNorm(Di, settings.rms_norm_eps).to(device=w.device, dtype=w.dtype)
        fresh += [attn.index_q_proj.weight, attn.index_k_proj.weight]
        attn.__dict__["_msakit_state"] = state
        attn.__dict__["_msakit_layer"] = i
        attn.register_forward_pre_hook(_capture_hidden, with_kwargs=True)
    if seed is not None and not any(t.is_meta for t in fresh):
        _normal_init(fresh, float(getattr(cfg, "initializer_range", 0.02)), seed)
    hf_model.__dict__["_msakit_state"] = state
    hf_model.set_attn_implementation(ATTN_IMPL)


# -- transformers classes of saved MSA folders ----------------------------------------------------
# A saved MSA model's config.json says model_type "msakit_<family>" and holds the settings under
# CONFIG_KEY; these classes (registered with AutoConfig / AutoModelForCausalLM) build the family's
# model and add the index branches, so `AutoModelForCausalLM.from_pretrained(folder)` loads every
# weight, index branches included, and runs MSA through the attention interface.


def base_model_type(model_type: str) -> str:
    """"msakit_qwen2" -> "qwen2"; other names unchanged."""
    return model_type[len(MSA_PREFIX):] if model_type.startswith(MSA_PREFIX) else model_type


_MSA_CLASSES: dict[str, tuple[type, type]] = {}


def msa_hf_classes(family: str) -> tuple[type, type]:
    """(config class, causal-LM class) of saved MSA models of `family` ("qwen2", ...), registered
    with transformers' auto classes at the first call."""
    if family not in HF_MODEL_TYPES:
        raise ValueError(f"family must be one of {HF_MODEL_TYPES}, got {family!r}")
    if family not in _MSA_CLASSES:
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        base_cfg = CONFIG_MAPPING[family]
        base_model = MODEL_FOR_CAUSAL_LM_MAPPING[base_cfg]
        cfg_cls = type(f"MSA{base_cfg.__name__}", (base_cfg,), {"model_type": MSA_PREFIX + family})

        def __init__(self, config, *args, **kwargs):  # noqa: N807
            base_model.__init__(self, config, *args, **kwargs)
            add_index_branches(self, MSASettings.from_dict(getattr(config, CONFIG_KEY)), seed=0)

        model_cls = type(f"MSA{base_model.__name__}", (base_model,), {"config_class": cfg_cls, "__init__": __init__})
        AutoConfig.register(MSA_PREFIX + family, cfg_cls, exist_ok=True)
        AutoModelForCausalLM.register(cfg_cls, model_cls, exist_ok=True)
        _MSA_CLASSES[family] = (cfg_cls, model_cls)
    return _MSA_CLASSES[family]


def register_transformers() -> None:
    """Register msakit's attention implementation and the saved-MSA-model classes of every
    supported family with transformers (idempotent; `import msakit` calls it once transformers
    is imported)."""
    register_hf_attention(ATTN_IMPL, _msa_attention_interface)
    for family in HF_MODEL_TYPES:
        msa_hf_classes(family)


def is_msa_folder(folder: str | os.PathLike[str]) -> bool:
    """Whether `folder` holds a saved MSA model (config.json model_type "msakit_<family>")."""
    try:
        raw = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    mt = raw.get("model_type") if isinstance(raw, dict) else None
    return isinstance(mt, str) and mt.startswith(MSA_PREFIX) and base_model_type(mt) in HF_MODEL_TYPES


class MSAWrappedModel(nn.Module):
    """An HF causal LM with MSA index branches; `M3ForCausalLM`'s training interface.

    `MSAWrappedModel(hf_model, settings)` adds the index branches to a plain HF model in place;
    an HF model that already has them (loaded from a saved MSA folder) is wrapped as it is
    (settings None)."""

    def __init__(self, hf_model: nn.Module, settings: MSASettings | None = None, *, seed: int | None = 0) -> None:
        super().__init__()
        if "_msakit_state" not in hf_model.__dict__:
            if settings is None:
                raise ValueError("settings are required for an HF model without index branches")
            add_index_branches(hf_model, settings, seed=seed)
        elif settings is not None:
            raise ValueError("the HF model already has index branches: pass settings=None")
        self.hf = hf_model
        self._state: _CallState = hf_model.__dict__["_msakit_state"]
        self.settings = self._state.settings
        self.set_attention_mode(self.settings.mode)

    @property
    def msa_config(self) -> MSAConfig:
        """The converted layers' shape and selection settings (every converted layer has the same)."""
        return self._state.cfg

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def wrap(cls, hf_model: nn.Module, *, index_head_dim=None, block_size=None, topk=None, local_blocks=None,
             init_blocks=None, rotary_dim=None, layers=None, seed: int = 0) -> "MSAWrappedModel":
        cfg = hf_model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        di = index_head_dim if index_head_dim is not None else head_dim
        rot = rotary_dim if rotary_dim is not None else min(64, di // 2, head_dim) // 2 * 2
        settings = MSASettings(
            index_head_dim=di,
            selection=Selection(128 if block_size is None else block_size, 16 if topk is None else topk,
                                1 if local_blocks is None else local_blocks, 0 if init_blocks is None else init_blocks),
            rotary_dim=rot,
            rope_theta=_rope_theta(cfg), rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
            layers=None if layers is None else sorted(set(layers)), mode="dense",
        )
        return cls(hf_model, settings, seed=seed)

    @property
    def config(self) -> Any:
        return self.hf.config

    @property
    def attention_mode(self) -> str:
        return self._state.mode

    def set_attention_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self._state.mode = mode
        self.settings.mode = mode

    def set_kl_tokens(self, tokens: str) -> None:
        """The index KL over the "selected" tokens (default) or over "all" causal tokens."""
        if tokens not in KL_TOKENS:
            raise ValueError(f"tokens must be one of {KL_TOKENS}, got {tokens!r}")
        self._state.cfg = dataclasses.replace(self._state.cfg, kl_tokens=tokens)

    def index_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The index branches' parameters (name as in named_parameters(), parameter)."""
        return index_parameters(self)

    def set_selection_policy(self, policy: Callable[..., torch.Tensor] | None) -> None:
        """Replace the indexer's selection in sparse mode (evaluation): policy(layer_idx, q
        [B,T,Hq,D], k [B,T,G,D], q_idx, k_idx, cfg) -> block_idx int32 [B, G, T, K]; None
        restores the indexer (see `M3ForCausalLM.set_selection_policy`)."""
        if policy is not None and not callable(policy):
            raise ValueError(f"policy must be callable or None, got {type(policy).__name__}")
        self._state.policy = policy

    def update_routing_bias(self, expert_load: torch.Tensor, rate: float = 1e-3) -> None:
        """No MoE in the wrapped dense model: accepts the empty [0, E] load and does nothing."""
        if expert_load.numel():
            raise ValueError("this model has no MoE layers; expert_load must be empty")

    def gradient_checkpointing_enable(self, enabled: bool = True) -> None:
        """Recompute each HF decoder layer in backward.  The recomputation runs after this
        forward has reset its per-call state, so each layer's checkpoint saves the state of its
        forward and restores it around the recomputation (`context_fn`); the recomputed KL terms
        are dropped, not collected again."""
        if not enabled:
            self.hf.gradient_checkpointing_disable()
            return
        st = self._state
        keys = ("compute_kl", "want_inputs", "segments", "positions", "mode", "cfg", "policy")

        def context_fn():
            saved = {k: getattr(st, k) for k in keys}

            @contextlib.contextmanager
            def recompute():
                now = {k: getattr(st, k) for k in keys + ("kls", "inputs")}
                for k, v in saved.items():
                    setattr(st, k, v)
                st.kls, st.inputs = [], {}
                try:
                    yield
                finally:
                    for k, v in now.items():
                        setattr(st, k, v)

            return contextlib.nullcontext(), recompute()

        self.hf.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": context_fn})

    # -- forward -----------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        compute_kl: bool = True,
        return_attn_inputs: bool = False,
        output_hidden_states: bool = False,
        cache: KVCacheProtocol | None = None,
        logits_to_keep: int = 0,
    ) -> M3Output:
        """input_ids [B, T] -> M3Output (as `M3ForCausalLM.forward`).  With `cache` (a
        `msakit.cache.KVCacheProtocol`: generation) the T tokens are new positions: every converted
        layer writes their keys into it and attends what it holds; logits only, no KL.
        `logits_to_keep` > 0: logits of the last that many positions only."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must have shape [B, T], got {tuple(input_ids.shape)}")
        if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or logits_to_keep < 0:
            raise ValueError(f"logits_to_keep must be an integer >= 0, got {logits_to_keep!r}")
        B, T = input_ids.shape
        st = self._state
        if cache is not None:
            if cu_seqlens is not None or labels is not None or return_attn_inputs:
                raise ValueError("a cached forward takes no cu_seqlens, labels or return_attn_inputs")
            if len(self.settings.layers) != len(self.hf.model.layers):
                raise ValueError("a cached forward needs an index branch in every layer (settings.layers)")
            placed = cache.begin(B, T, input_ids.device)
            pos = placed if positions is None else positions
            st.cache, st.positions, st.segments = cache, pos, [(0, T)]
            try:
                out = self.hf(input_ids=input_ids, position_ids=pos, use_cache=False, logits_to_keep=logits_to_keep)
            finally:
                st.cache, st.positions, st.segments = None, None, []
            cache.end()
            return M3Output(logits=out.logits)
        segments = document_segments(cu_seqlens, B, T)
        position_ids = positions
        if position_ids is None and len(segments) > 1:
            position_ids = segment_positions(segments, T, input_ids.device)
        st.compute_kl, st.want_inputs, st.segments = compute_kl, return_attn_inputs, segments
        st.positions = position_ids if position_ids is not None else torch.arange(T, device=input_ids.device).unsqueeze(0)
        st.kls, st.inputs = [], {}
        try:
            out = self.hf(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                          output_hidden_states=output_hidden_states, logits_to_keep=logits_to_keep)
            kls, inputs = st.kls, st.inputs
        finally:
            st.kls, st.inputs, st.positions, st.segments = [], {}, None, []
            st.compute_kl = st.want_inputs = False
        logits = out.logits
        kl = torch.stack([x.float() for x in kls]).sum() if kls else torch.zeros((), device=logits.device)
        if labels is not None and 0 < logits_to_keep < T:
            raise ValueError("labels need the logits of every position (logits_to_keep=0)")
        loss = lm_loss(logits, labels, segments) if labels is not None else None
        attn_inputs = None
        if return_attn_inputs:
            attn_inputs = [inputs.get(i) for i in range(len(self.hf.model.layers))]
        return M3Output(
            logits=logits, loss=loss, kl=kl, expert_load=torch.zeros(0, 0, device=logits.device),
            attn_inputs=attn_inputs, hidden_states=list(out.hidden_states) if output_hidden_states else None,
        )

    # -- I/O ---------------------------------------------------------------------------------
    def save_pretrained(self, path: str | os.PathLike[str], *, tokenizer: Any = None, **kwargs: Any) -> None:
        """An HF folder that transformers loads once msakit is imported: every weight (index
        branches included, M3 names under `self_attn.`) as HF writes it, config.json with
        model_type "msakit_<family>" and the settings under "msakit_msa", and the tokenizer
        (`tokenizer`: an object with save_pretrained or save; default: the tokenizer files of the
        folder the model was loaded from, when there are any)."""
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        self.hf.save_pretrained(str(folder), **kwargs)
        cfg_path = folder / "config.json"
        raw = json.loads(cfg_path.read_text(encoding="utf-8"))
        family = base_model_type(raw.get("model_type", self.hf.config.model_type))
        raw["model_type"] = MSA_PREFIX + family
        raw["architectures"] = [msa_hf_classes(family)[1].__name__]
        raw[CONFIG_KEY] = self.settings.to_dict()
        cfg_path.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        if tokenizer is not None:
            (tokenizer.save_pretrained if hasattr(tokenizer, "save_pretrained") else tokenizer.save)(str(folder))
            return
        source = Path(str(getattr(self.hf, "name_or_path", "") or ""))
        if source.is_dir() and source.resolve() != folder.resolve():
            for name in TOKENIZER_FILES:
                if (source / name).is_file():
                    shutil.copyfile(source / name, folder / name)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], device: Any = None, dtype: torch.dtype | None = None) -> "MSAWrappedModel":
        """Load a folder written by `save_pretrained` (every weight must be in it)."""
        from transformers import AutoModelForCausalLM

        folder = Path(path)
        if not is_msa_folder(folder):
            raise ValueError(f"{folder} is not a saved MSA model (config.json model_type 'msakit_<family>')")
        register_transformers()
        hf, info = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype or torch.float32, local_files_only=True,
                                                        output_loading_info=True)
        if info.get("missing_keys"):
            raise ValueError(f"{folder}: weights missing from the checkpoint: {sorted(info['missing_keys'])[:6]}")
        if device is not None:
            hf.to(device)
        return cls(hf)


# ---------------------------------------------------------------------------------------------
# Index initialisation from the main branch
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def init_index_from_qk(model: nn.Module) -> None:
    """Initialise every index branch from its layer's main q/k projections, so that the index
    scores start close to the group-averaged main scores: index_q_proj of group g = the mean of
    q_proj over g's query heads, index_k_proj (one index key head) = the mean of k_proj over the
    KV heads; the index norms take the main q/k norms' scales (M3, Qwen3) or scale 1 (models
    without q/k norms).  q/k biases have no counterpart in the index branch.  Needs index_head_dim ==
    head_dim; for HF models the index RoPE should rotate what the main RoPE rotates
    (rotary_dim = head_dim, which `convert_dense_to_msa(index_init="qk")` picks)."""
    if isinstance(model, MSAWrappedModel):
        attns = [model.hf.model.layers[i].self_attn for i in model.settings.layers]
        sel = model.msa_config
    elif isinstance(model, M3ForCausalLM):
        attns = model.msa_layers()
        if not attns:
            raise ValueError("the model has no MSA layers")
        sel = attns[0].cfg
    else:
        raise ValueError(f"init_index_from_qk takes an MSAWrappedModel or an M3ForCausalLM, got {type(model).__name__}")
    Hq, G, D, Di = sel.num_heads, sel.num_kv_heads, sel.head_dim, sel.index_dim
    if Di != D:
        raise ValueError(f"init_index_from_qk needs index_head_dim == head_dim, got {Di} and {D}")
    for attn in attns:
        wq = attn.q_proj.weight.float().view(G, Hq // G, D, -1)
        wk = attn.k_proj.weight.float().view(G, D, -1)
        attn.index_q_proj.weight.copy_(wq.mean(1).reshape(G * D, -1))
        attn.index_k_proj.weight.copy_(wk.mean(0))
        for main, index in (("q_norm", attn.index_q_norm), ("k_norm", attn.index_k_norm)):
            norm = getattr(attn, main, None)
            if isinstance(norm, GemmaRMSNorm):
                index.weight.copy_(norm.weight)
            elif isinstance(getattr(norm, "weight", None), torch.Tensor) and norm.weight.shape == index.weight.shape:
                index.weight.copy_(norm.weight.float() - 1.0)  # HF RMSNorm scales by weight, Gemma's by 1 + weight
            else:
                index.weight.zero_()
