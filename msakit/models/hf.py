"""MSA on HF causal LMs, for any family with an adapter (`msakit.models.adapters`).

`add_index_branches(hf_model, settings)` gives each converted layer's attention module an index
branch (`index_q_proj`, `index_k_proj`, `index_q_norm`, `index_k_norm`, the M3 names) reading
the layer's input `hidden.detach()`, with its own partial NeoX RoPE (`rotary_dim` dims, the HF
model's rope_theta), and installs `MSAHandler` as the module's attention handler
(`msakit.models.hooks`: the one transformers attention function dispatches to it).  The HF model
keeps its own attention math (projections, q/k norms, RoPE, GQA); the handler receives HF's q/k/v
after RoPE and calls the attention core (`msakit.nn.core.attend`): "dense" mode attends every
causal token (HF's outputs unchanged) while the index branch's KL is taken; "sparse" mode attends
the index branch's top-k blocks.

`MSAWrappedModel` wraps such a model with the `msakit.models.interface.MSAModel` interface
(forward -> M3Output, attention modes, KL tokens, selection policies, checkpointing, saving).
A saved one is an HF folder whose config.json says model_type "msakit_<family>" and holds the
settings under "msakit_msa"; `register_transformers()` (called by `import msakit` once
transformers is imported) registers a config / causal-LM class per registered family, so plain
`transformers.AutoModelForCausalLM.from_pretrained(folder)` loads it and runs MSA.

transformers is an optional dependency (msakit[hf]) and slow to import: it is imported inside
the functions that load models or register classes.
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
from typing import Any, Sequence

import torch
from torch import nn

from msakit.cache.base import HeldKeys, KVCacheProtocol
from msakit.models.adapters import (
    MSA_PREFIX,
    FamilyAdapter,
    adapter_for,
    base_model_type,
    family_adapter,
    find_family,
    on_family_registered,
)
from msakit.models.hooks import (
    add_hook,
    attach,
    attached,
    hf_sdpa_attention,
    register_attention,
    set_attention_handler,
    use_msakit_attention,
)
from msakit.models.interface import (
    ForwardCall,
    M3Output,
    SelectionPolicy,
    begin_forward,
    check_kl_tokens,
    check_mode,
    check_policy,
    end_forward,
    index_parameters,
)
from msakit.models.io import ModelFolderError, check_finite, manifest_entries
from msakit.nn.attention import MSAConfig, index_projections
from msakit.nn.core import attend, selection_info
from msakit.nn.norm import GemmaRMSNorm
from msakit.nn.rope import rope_cos_sin
from msakit.ops.index_topk import Selection

__all__ = [
    "CONFIG_KEY",
    "HFModelWrapper",
    "MSAHandler",
    "MSASettings",
    "MSAState",
    "MSAWrappedModel",
    "TOKENIZER_FILES",
    "add_index_branches",
    "is_msa_folder",
    "load_hf_model",
    "msa_config",
    "msa_hf_classes",
    "normal_init",
    "register_transformers",
]

CONFIG_KEY = "msakit_msa"  # config.json key of the MSASettings
STATE_KEY = "msa"  # `msakit.models.hooks` key of the MSAState on the HF model and of the capture pre-hook
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")


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


def normal_init(params: Sequence[torch.Tensor], std: float, seed: int) -> None:
    """Deterministic normal(0, std) init, drawn on the CPU whatever the device."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=g))


def msa_config(adapter: FamilyAdapter, hf_config: Any, settings: MSASettings) -> MSAConfig:
    """The MSAConfig of an HF model's converted layers."""
    shape = adapter.attention_shape(hf_config)
    if settings.rotary_dim > shape.head_dim:
        raise ValueError(f"rotary_dim={settings.rotary_dim} exceeds head_dim={shape.head_dim}")
    return MSAConfig(
        hidden_size=shape.hidden_size, num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim, index_dim=settings.index_head_dim, rotary_dim=settings.rotary_dim,
        rope_theta=settings.rope_theta, rms_norm_eps=settings.rms_norm_eps, selection=settings.selection,
    )


# ---------------------------------------------------------------------------------------------
# The attention handler
# ---------------------------------------------------------------------------------------------


class MSAState:
    """Settings shared by a converted model's handlers, and one forward's inputs and results."""

    def __init__(self, adapter: FamilyAdapter, cfg: MSAConfig, settings: MSASettings) -> None:
        self.adapter = adapter
        self.cfg = cfg
        self.settings = settings
        self.policy: SelectionPolicy | None = None  # `MSAWrappedModel.set_selection_policy`
        self.end()

    @property
    def mode(self) -> str:
        """The attention mode ("dense" or "sparse"), kept in the settings (saved with them)."""
        return self.settings.mode

    @mode.setter
    def mode(self, mode: str) -> None:
        self.settings.mode = check_mode(mode)

    def begin(self, call: ForwardCall, device: torch.device) -> None:
        """A wrapper forward starts: its cache, positions, documents and what it asks for."""
        self.cache = call.cache
        self.positions = call.positions if call.positions is not None else \
            torch.arange(call.T, device=device).unsqueeze(0)
        self.segments = call.segments or [(0, call.T)]
        self.compute_kl, self.want_inputs = call.compute_kl, call.want_inputs
        self.kls, self.inputs = [], {}

    def end(self) -> None:
        """Between forwards: no cache, positions or documents; nothing asked for or collected."""
        self.cache: KVCacheProtocol | None = None
        self.positions: torch.Tensor | None = None
        self.segments: list[tuple[int, int]] = []
        self.compute_kl = self.want_inputs = False
        self.kls: list[torch.Tensor] = []
        self.inputs: dict[int, dict[str, Any]] = {}


def _held_index_keys(hf_cache: Any, layer: int, k_idx: torch.Tensor, past: int) -> torch.Tensor:
    """The index keys [B, past + Tq, Di] of every position HF's cache holds for `layer`: those kept
    beside the cache (attached to it, cut to `past` after a crop) + the new ones."""
    store = attached(hf_cache, "index_keys")
    if store is None:
        store = attach(hf_cache, "index_keys", {})
    held = store.get(layer)
    if past and (held is None or held.shape[1] < past):
        raise ValueError("the HF cache holds keys written without msakit's attention (no index keys for them)")
    if past:
        k_idx = torch.cat([held[:, :past], k_idx], dim=1)
    store[layer] = k_idx
    return k_idx


class MSAHandler:
    """The attention handler of one converted layer: HF's q/k/v [B, H, T, D] after RoPE + the
    index branch's projections of the layer input -> `msakit.nn.core.attend`.

    Three ways in: the wrapper's cached forward (a msakit cache: HF ran without its own, q/k/v
    are the new positions'; the cache stores them and the core attends its view), HF's own
    cache (plain transformers generate: key/value hold every position; the index keys are kept
    beside HF's cache), or a full sequence (training, prefill)."""

    def __init__(self, state: MSAState, layer: int) -> None:
        self.state = state
        self.layer = layer
        self.hidden: torch.Tensor | None = None
        self.hf_cache: Any = None

    def capture(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook of the attention module: its input and HF's cache object (if any)."""
        self.hidden = kwargs.get("hidden_states", args[0] if args else None)
        self.hf_cache = kwargs.get("cache", kwargs.get("past_key_values"))

    def index_project(self, module: nn.Module, hidden: torch.Tensor, positions: torch.Tensor):
        """q_idx [B, T, G, Di], k_idx [B, T, Di] of the layer input (`msakit.nn.attention.index_projections`
        with the index branch's own partial RoPE)."""
        cfg = self.state.cfg
        cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta)
        return index_projections(module, hidden, cos, sin, cfg)

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        st, layer = self.state, self.layer
        hidden, hf_cache = self.hidden, self.hf_cache
        self.hidden = self.hf_cache = None
        if hidden is None:  # called without the pre-hook: HF's own SDPA math
            return hf_sdpa_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                     **kwargs)
        q = query.transpose(1, 2).contiguous()
        k = key.transpose(1, 2).contiguous()
        v = value.transpose(1, 2).contiguous()
        Tq, Tk = q.shape[1], k.shape[1]
        cfg = st.cfg
        if st.cache is not None:
            if scaling is not None and abs(scaling * math.sqrt(q.shape[-1]) - 1.0) > 1e-6:
                raise ValueError(f"msakit's caches attend with scale 1/sqrt(head_dim); this model uses {scaling}")
            q_idx, k_idx = self.index_project(module, hidden, st.positions)
            st.cache.write(layer, k, v, k_idx)
            return attend(q, q_idx, st.cache.view(layer), cfg.selection, mode=st.mode)[0], None
        positions = st.positions
        if positions is None:
            positions = kwargs.get("position_ids")
            if positions is None:
                positions = torch.arange(Tk - Tq, Tk, device=q.device).unsqueeze(0)
        q_idx, k_idx = self.index_project(module, hidden, positions)
        if hf_cache is not None:
            k_idx = _held_index_keys(hf_cache, layer, k_idx, Tk - Tq)
            if Tq != Tk:
                if st.mode == "sparse":
                    block_idx = None
                    if st.policy is not None:  # an evaluation policy decoding with HF's cache
                        with torch.no_grad():
                            block_idx = st.policy(layer, q, k, q_idx, k_idx, cfg.selection)
                    return attend(q, q_idx, HeldKeys(k, v, k_idx), cfg.selection, mode="sparse",
                                  softmax_scale=scaling, block_idx=block_idx)[0], None
                return hf_sdpa_attention(module, query, key, value, attention_mask, dropout=dropout,
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
            st.inputs[layer] = dict(q=q.detach(), k=k.detach(), q_idx=q_idx.detach(), k_idx=k_idx.detach(),
                                    block_idx=bidx, **selection_info(cfg.selection, segments))
        return o, None


def add_index_branches(hf_model: nn.Module, settings: MSASettings, *, seed: int | None = 0) -> MSAState:
    """Give each of `settings.layers` of an HF causal LM an index branch (in place; the M3 names
    under the family's attention module), install their `MSAHandler`s and switch the model to
    msakit's attention function; returns the shared `MSAState`.  seed None leaves the new
    projections uninitialised (weights loaded next)."""
    cfg = hf_model.config
    adapter = family_adapter(cfg.model_type)
    adapter.check(cfg)
    if attached(hf_model, STATE_KEY) is not None:
        raise ValueError("the model already has MSA index branches")
    register_transformers()
    attns = adapter.attention_modules(hf_model)
    n_layers = len(attns)
    if settings.layers is None:
        settings.layers = list(range(n_layers))
    bad = [i for i in settings.layers if not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"layers {bad} out of range (the model has {n_layers})")
    mcfg = msa_config(adapter, cfg, settings)
    state = MSAState(adapter, mcfg, settings)
    H, G, Di = mcfg.hidden_size, mcfg.num_kv_heads, settings.index_head_dim
    fresh: list[torch.Tensor] = []
    for i in settings.layers:
        attn = attns[i]
        w = adapter.qk_weights(attn)[0]
        attn.index_q_proj = nn.Linear(H, G * Di, bias=False, device=w.device, dtype=w.dtype)
        attn.index_k_proj = nn.Linear(H, Di, bias=False, device=w.device, dtype=w.dtype)
        attn.index_q_norm = GemmaRMSNorm(Di, settings.rms_norm_eps).to(device=w.device, dtype=w.dtype)
        attn.index_k_norm = GemmaRMSNorm(Di, settings.rms_norm_eps).to(device=w.device, dtype=w.dtype)
        fresh += [attn.index_q_proj.weight, attn.index_k_proj.weight]
        handler = MSAHandler(state, i)
        set_attention_handler(attn, handler)
        add_hook(attn, STATE_KEY, handler.capture, pre=True, with_kwargs=True)
    if seed is not None and not any(t.is_meta for t in fresh):
        normal_init(fresh, float(getattr(cfg, "initializer_range", 0.02)), seed)
    attach(hf_model, STATE_KEY, state)
    use_msakit_attention(hf_model)
    return state


# ---------------------------------------------------------------------------------------------
# transformers classes of saved MSA folders
# ---------------------------------------------------------------------------------------------
# A saved MSA model's config.json says model_type "msakit_<family>" and holds the settings under
# CONFIG_KEY; these classes (registered with AutoConfig / AutoModelForCausalLM) build the family's
# model and add the index branches, so `AutoModelForCausalLM.from_pretrained(folder)` loads every
# weight, index branches included, and runs MSA through the attention interface.

_MSA_CLASSES: dict[str, tuple[type, type]] = {}


def msa_hf_classes(family: str) -> tuple[type, type]:
    """(config class, causal-LM class) of saved MSA models of `family` ("qwen2", ...), registered
    with transformers' auto classes at the first call."""
    adapter = family_adapter(family)
    if adapter.name not in _MSA_CLASSES:
        # transformers: optional dependency, imported when classes are registered
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        base_cfg = CONFIG_MAPPING[adapter.name]
        base_model = MODEL_FOR_CAUSAL_LM_MAPPING[base_cfg]
        cfg_cls = type(f"MSA{base_cfg.__name__}", (base_cfg,), {"model_type": MSA_PREFIX + adapter.name})

        def __init__(self, config, *args, **kwargs):  # noqa: N807
            base_model.__init__(self, config, *args, **kwargs)
            add_index_branches(self, MSASettings.from_dict(getattr(config, CONFIG_KEY)), seed=0)

        model_cls = type(f"MSA{base_model.__name__}", (base_model,), {"config_class": cfg_cls, "__init__": __init__})
        AutoConfig.register(MSA_PREFIX + adapter.name, cfg_cls, exist_ok=True)
        AutoModelForCausalLM.register(cfg_cls, model_cls, exist_ok=True)
        _MSA_CLASSES[adapter.name] = (cfg_cls, model_cls)
    return _MSA_CLASSES[adapter.name]


def _register_classes(adapter: FamilyAdapter) -> None:
    msa_hf_classes(adapter.name)


def register_transformers() -> None:
    """Register msakit's attention function and the saved-MSA-model classes of every registered
    family, now and as families are registered later, with transformers (idempotent)."""
    register_attention()
    on_family_registered(_register_classes)


def is_msa_folder(folder: str | os.PathLike[str]) -> bool:
    """Whether `folder` holds a saved MSA model (config.json model_type "msakit_<family>")."""
    try:
        raw = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    mt = raw.get("model_type") if isinstance(raw, dict) else None
    return isinstance(mt, str) and mt.startswith(MSA_PREFIX) and find_family(mt) is not None


# the selection a converted HF model gets when none is given (`MSAWrappedModel.wrap`)
DEFAULT_BLOCK_SIZE, DEFAULT_TOPK = 128, 16


def load_hf_model(folder: str | os.PathLike[str], device: Any = None, dtype: torch.dtype | None = None, *,
                  strict: bool = False) -> nn.Module:
    """An HF causal LM from a local folder (transformers, offline; float32 unless `dtype`).
    strict: every weight of the model must be in the folder (ValueError naming the missing)."""
    try:
        # transformers: optional dependency, imported when an HF folder is loaded
        from transformers import AutoModelForCausalLM
    except ImportError:  # pragma: no cover - transformers is in the env
        raise ValueError(f"loading the HF model in {folder} needs `transformers` (pip install msakit[hf])") from None
    manifest_entries(folder)  # the files its index names lie inside the folder
    model, info = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype or torch.float32,
                                                       local_files_only=True, output_loading_info=True)
    if strict and info.get("missing_keys"):
        raise ModelFolderError(f"{folder}: weights missing from the checkpoint: {sorted(info['missing_keys'])[:6]}")
    for name, t in model.state_dict().items():  # transformers loads the weights: refuse NaN / inf here
        check_finite(name, t, folder)
    if device is not None:
        model.to(device)
    return model


# ---------------------------------------------------------------------------------------------
# The wrapper
# ---------------------------------------------------------------------------------------------


class HFModelWrapper(nn.Module):
    """An HF causal LM (`hf`) whose attention handlers share one state object with the attention
    `mode` and the selection `policy`: the `msakit.models.interface.SelectionModel` methods."""

    def __init__(self, hf_model: nn.Module, state: Any) -> None:
        super().__init__()
        self.hf = hf_model
        self._state = state

    @property
    def config(self) -> Any:
        return self.hf.config

    @property
    def attention_mode(self) -> str:
        return self._state.mode

    def set_attention_mode(self, mode: str) -> None:
        self._state.mode = check_mode(mode)

    def set_selection_policy(self, policy: SelectionPolicy | None) -> None:
        """Replace the selection in sparse mode (evaluation): policy(layer_idx, q [B,T,Hq,D], k
        [B,T,G,D], q_idx, k_idx, sel) -> block_idx int32 [B, G, T, K] (q_idx, k_idx None
        without an index branch); None: the indexer's selection."""
        self._state.policy = check_policy(policy)


class MSAWrappedModel(HFModelWrapper):
    """An HF causal LM with MSA index branches; an `msakit.models.interface.MSAModel`.

    `MSAWrappedModel(hf_model, settings)` adds the index branches to a plain HF model in place;
    an HF model that already has them (loaded from a saved MSA folder) is wrapped as it is
    (settings None)."""

    has_indexer = True
    _state: MSAState

    def __init__(self, hf_model: nn.Module, settings: MSASettings | None = None, *, seed: int | None = 0) -> None:
        if attached(hf_model, STATE_KEY) is None:
            if settings is None:
                raise ValueError("settings are required for an HF model without index branches")
            add_index_branches(hf_model, settings, seed=seed)
        elif settings is not None:
            raise ValueError("the HF model already has index branches: pass settings=None")
        super().__init__(hf_model, attached(hf_model, STATE_KEY))
        self.settings = self._state.settings
        self.adapter: FamilyAdapter = self._state.adapter  # the wrapped model's family

    @property
    def msa_config(self) -> MSAConfig:
        """The converted layers' shape and selection settings (every converted layer has the same)."""
        return self._state.cfg

    def msa_attention_modules(self) -> list[nn.Module]:
        """The attention modules that have an index branch, in layer order."""
        attns = self.adapter.attention_modules(self.hf)
        return [attns[i] for i in self.settings.layers]

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def wrap(cls, hf_model: nn.Module, *, index_head_dim=None, block_size=None, topk=None, local_blocks=None,
             init_blocks=None, rotary_dim=None, layers=None, seed: int = 0) -> "MSAWrappedModel":
        """Add index branches to `hf_model` with the given settings; unset ones default to
        index_head_dim = head_dim, block 128, top-16, local 1, init 0, rotary_dim = min(64, Di / 2)."""
        cfg = hf_model.config
        adapter = adapter_for(hf_model)
        head_dim = adapter.attention_shape(cfg).head_dim
        di = index_head_dim if index_head_dim is not None else head_dim
        rot = rotary_dim if rotary_dim is not None else min(64, di // 2, head_dim) // 2 * 2
        settings = MSASettings(
            index_head_dim=di,
            selection=Selection(DEFAULT_BLOCK_SIZE if block_size is None else block_size,
                                DEFAULT_TOPK if topk is None else topk,
                                1 if local_blocks is None else local_blocks, 0 if init_blocks is None else init_blocks),
            rotary_dim=rot,
            rope_theta=adapter.rope_theta(cfg), rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
            layers=None if layers is None else sorted(set(layers)), mode="dense",
        )
        return cls(hf_model, settings, seed=seed)

    def set_kl_tokens(self, tokens: str) -> None:
        """The index KL over the "selected" tokens (default) or over "all" causal tokens."""
        self._state.cfg = dataclasses.replace(self._state.cfg, kl_tokens=check_kl_tokens(tokens))

    def index_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The index branches' parameters (name as in named_parameters(), parameter)."""
        return index_parameters(self)

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
    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None, compute_kl: bool = True,
                return_attn_inputs: bool = False, output_hidden_states: bool = False, *,
                cache: KVCacheProtocol | None = None, logits_to_keep: int = 0) -> M3Output:
        """input_ids [B, T] -> M3Output (the contract of `msakit.models.interface`; no MoE:
        expert_load is [0, 0]).  With `cache` (generation) every converted layer writes the new
        positions' keys into it and attends what it holds."""
        n_layers = len(self.adapter.decoder_layers(self.hf))
        if cache is not None and len(self.settings.layers) != n_layers:
            raise ValueError("a cached forward needs an index branch in every layer (settings.layers)")
        call = begin_forward(input_ids, labels, positions, cu_seqlens, compute_kl, return_attn_inputs, cache,
                             logits_to_keep)
        st = self._state
        st.begin(call, input_ids.device)
        try:
            out = self.hf(input_ids=input_ids, position_ids=call.positions, use_cache=False,
                          output_hidden_states=output_hidden_states, logits_to_keep=logits_to_keep)
            kls, inputs = st.kls, st.inputs
        finally:
            st.end()
        return end_forward(call, out.logits, labels=labels, kls=kls,
                           attn_inputs=[inputs.get(i) for i in range(n_layers)],
                           hidden_states=list(out.hidden_states) if output_hidden_states else None)

    # -- I/O ---------------------------------------------------------------------------------
    def save_pretrained(self, path: str | os.PathLike[str], *, tokenizer: Any = None, **kwargs: Any) -> None:
        """An HF folder that transformers loads once msakit is imported: every weight (index
        branches included, M3 names under the attention modules) as HF writes it, config.json
        with model_type "msakit_<family>" and the settings under "msakit_msa", and the tokenizer
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
        folder = Path(path)
        if not is_msa_folder(folder):
            raise ValueError(f"{folder} is not a saved MSA model (config.json model_type 'msakit_<family>')")
        register_transformers()
        return cls(load_hf_model(folder, device, dtype, strict=True))
