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

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from msakit import ops
from msakit.models.config import M3_MODEL_TYPES
from msakit.models.modeling import M3ForCausalLM, M3Output, document_segments, lm_loss, segment_positions
from msakit.nn.attention import MODES, MSAConfig, msa_attend, selection_info
from msakit.nn.norm import GemmaRMSNorm
from msakit.nn.rope import apply_partial_rope, rope_cos_sin

__all__ = [
    "HF_MODEL_TYPES",
    "MSASettings",
    "MSAWrappedModel",
    "convert_dense_to_msa",
    "load_for_conversion",
    "register_hf_attention",
]

HF_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
MSA_FILE = "msakit_msa.json"
INDEX_WEIGHTS = "msakit_index.safetensors"
ATTN_IMPL = "msakit_msa"
_INDEX_KEYS = ("index_q_proj", "index_k_proj", "index_q_norm", "index_k_norm")


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
    if (folder / MSA_FILE).is_file():
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
    topk_blocks: int | None = None,
    local_blocks: int | None = None,
    init_blocks: int | None = None,
    rotary_dim: int | None = None,
    layers: Sequence[int] | None = None,
    seed: int = 0,
    device: Any = None,
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """Add MSA index branches to a dense model; returns a model in "dense" mode whose outputs
    equal the source's.  Unset sizes default to the source config's (msakit) or to
    index_head_dim = head_dim, block 128, top-16, local 1, init 0, rotary_dim = min(64, Di / 2) (HF).
    `layers`: which layers get an index branch (default every dense-attention layer)."""
    for name, val, lo in (("index_head_dim", index_head_dim, 1), ("block_size", block_size, 1),
                          ("topk_blocks", topk_blocks, 1), ("local_blocks", local_blocks, 0),
                          ("init_blocks", init_blocks, 0), ("rotary_dim", rotary_dim, 0)):
        if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < lo):
            raise ValueError(f"{name} must be an integer >= {lo} (or None for the default), got {val!r}")
    model = model_or_path
    if isinstance(model_or_path, (str, os.PathLike)):
        model = load_for_conversion(model_or_path, device=device, dtype=dtype)
    if isinstance(model, MSAWrappedModel):
        raise ValueError("the model already has MSA index branches (an MSAWrappedModel)")
    opts = dict(index_head_dim=index_head_dim, block_size=block_size, topk_blocks=topk_blocks,
                local_blocks=local_blocks, init_blocks=init_blocks, layers=layers, seed=seed)
    if isinstance(model, M3ForCausalLM):
        if rotary_dim is not None and rotary_dim != model.config.rotary_dim:
            raise ValueError(f"rotary_dim={rotary_dim}: an M3 index branch uses the main branch's partial RoPE "
                             f"(rotary_dim={model.config.rotary_dim})")
        return _convert_m3(model, **opts)
    if _is_hf_causal_lm(model):
        return MSAWrappedModel.wrap(model, rotary_dim=rotary_dim, **opts)
    raise ValueError(f"cannot convert a {type(model).__name__}: expected an M3ForCausalLM, an HF causal LM "
                     f"({', '.join(HF_MODEL_TYPES)}) or a model folder")


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
    model: M3ForCausalLM, *, index_head_dim, block_size, topk_blocks, local_blocks, init_blocks, layers, seed
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
                     ("index_topk_blocks", topk_blocks), ("index_local_blocks", local_blocks),
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
    fresh = [n for n in missing if any(f".self_attn.{k}." in n for k in _INDEX_KEYS)]
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
    """Index-branch settings of an `MSAWrappedModel` (saved as msakit_msa.json)."""

    index_head_dim: int
    block_size: int = 128
    topk_blocks: int = 16
    local_blocks: int = 1
    init_blocks: int = 0
    rotary_dim: int = 64
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    layers: list[int] | None = None
    mode: str = "dense"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "MSASettings":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


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

    def __init__(self, sel: MSAConfig) -> None:
        self.sel = sel
        self.mode = "dense"
        self.compute_kl = False
        self.want_inputs = False
        self.segments: list[tuple[int, int]] = []
        self.positions: torch.Tensor | None = None
        self.kls: list[torch.Tensor] = []
        self.inputs: dict[int, dict[str, Any]] = {}
        self.policy: Callable[..., torch.Tensor] | None = None  # `MSAWrappedModel.set_selection_policy`


def _capture_hidden(module: nn.Module, args: tuple, kwargs: dict) -> None:
    h = kwargs.get("hidden_states", args[0] if args else None)
    module.__dict__["_msakit_hidden"] = h


def _index_project(module: nn.Module, hidden: torch.Tensor, positions: torch.Tensor, sel: MSAConfig):
    B, T, _ = hidden.shape
    h = hidden.detach()  # stop-gradient: the KL never reaches the backbone through the indexer input
    G, Di = sel.num_kv_heads, sel.index_dim
    q_idx = module.index_q_norm(module.index_q_proj(h).view(B, T, G, Di))
    k_idx = module.index_k_norm(module.index_k_proj(h).view(B, T, 1, Di))
    cos, sin = rope_cos_sin(positions, sel.rotary_dim, sel.rope_theta)
    return apply_partial_rope(q_idx, cos, sin), apply_partial_rope(k_idx, cos, sin).squeeze(2)


def _msa_attention_interface(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention interface "msakit_msa": HF's q/k/v [B, H, T, D] after RoPE."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    st: _CallState | None = module.__dict__.get("_msakit_state")
    hidden = module.__dict__.pop("_msakit_hidden", None)
    layer = module.__dict__.get("_msakit_layer")
    if st is None or layer is None or hidden is None:  # not converted: HF's own SDPA math
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if query.shape[2] != key.shape[2]:
        raise ValueError("MSAWrappedModel does not run with an HF KV cache (call it with use_cache=False)")
    q = query.transpose(1, 2).contiguous()
    k = key.transpose(1, 2).contiguous()
    v = value.transpose(1, 2).contiguous()
    T = q.shape[1]
    positions = st.positions if st.positions is not None else torch.arange(T, device=q.device).unsqueeze(0)
    segments = st.segments or [(0, T)]  # the HF model called directly, not through the wrapper
    q_idx, k_idx = _index_project(module, hidden, positions, st.sel)
    sel = st.sel
    select = None
    if st.policy is not None and st.mode == "sparse":
        if len(segments) > 1:
            raise ValueError("a selection policy takes one unpacked sequence per row")
        select = lambda qi, ki: st.policy(layer, q, k, qi, ki, sel)  # noqa: E731
    if st.mode == "dense" and len(segments) == 1:
        o, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        kl = bidx = None
        if st.compute_kl or st.want_inputs:
            with torch.no_grad():
                bidx = ops.index_topk(q_idx, k_idx, block_size=sel.block_size, topk=sel.topk,
                                      local_blocks=sel.local_blocks, init_blocks=sel.init_blocks)
            if st.compute_kl:
                kl = ops.index_kl_loss(q, k, q_idx, k_idx, bidx, block_size=sel.block_size, softmax_scale=scaling)
    else:
        o, kl, bidx = msa_attend(q, k, v, q_idx, k_idx, sel, mode=st.mode, compute_kl=st.compute_kl,
                                 need_block_idx=st.want_inputs, segments=segments, softmax_scale=scaling,
                                 select=select)
    if kl is not None:
        st.kls.append(kl)
    if st.want_inputs:
        st.inputs[layer] = dict(q=q.detach(), k=k.detach(), q_idx=q_idx.detach(), k_idx=k_idx.detach(), block_idx=bidx,
                                **selection_info(sel, segments))
    return o, None


_registered: set[str] = set()


def register_hf_attention(name: str, fn: Callable[..., Any]) -> None:
    """Registers `fn` as the transformers attention implementation `name` (`attn_implementation`),
    once per name: `fn(module, query, key, value, attention_mask, **kwargs) -> (out, weights)`."""
    if name not in _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(name, fn)
        _registered.add(name)


class MSAWrappedModel(nn.Module):
    """An HF causal LM with MSA index branches; `M3ForCausalLM`'s training interface."""

    def __init__(self, hf_model: nn.Module, settings: MSASettings, *, seed: int | None = 0) -> None:
        super().__init__()
        register_hf_attention(ATTN_IMPL, _msa_attention_interface)
        cfg = hf_model.config
        if cfg.model_type not in HF_MODEL_TYPES:
            raise ValueError(f"HF model_type {cfg.model_type!r} is not supported (supported: {', '.join(HF_MODEL_TYPES)})")
        if getattr(cfg, "use_sliding_window", False) or (getattr(cfg, "sliding_window", None) and cfg.model_type == "mistral"):
            raise ValueError("sliding-window attention is not supported by the MSA wrapper")
        self.hf = hf_model
        self.settings = settings
        n_layers = len(hf_model.model.layers)
        heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        if settings.layers is None:
            settings.layers = list(range(n_layers))
        bad = [i for i in settings.layers if not 0 <= i < n_layers]
        if bad:
            raise ValueError(f"layers {bad} out of range (the model has {n_layers})")
        if settings.rotary_dim > head_dim:
            raise ValueError(f"rotary_dim={settings.rotary_dim} exceeds head_dim={head_dim}")
        self.sel = MSAConfig(
            hidden_size=cfg.hidden_size, num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
            index_dim=settings.index_head_dim, rotary_dim=settings.rotary_dim, rope_theta=settings.rope_theta,
            rms_norm_eps=settings.rms_norm_eps, block_size=settings.block_size, topk=settings.topk_blocks,
            local_blocks=settings.local_blocks, init_blocks=settings.init_blocks,
        )
        self._state = _CallState(self.sel)
        H, G, Di = cfg.hidden_size, kv, settings.index_head_dim
        fresh: list[torch.Tensor] = []
        self._hooks = []
        for i in settings.layers:
            attn = hf_model.model.layers[i].self_attn
            w = attn.q_proj.weight
            attn.index_q_proj = nn.Linear(H, G * Di, bias=False, device=w.device, dtype=w.dtype)
            attn.index_k_proj = nn.Linear(H, Di, bias=False, device=w.device, dtype=w.dtype)
            attn.index_q_norm = GemmaRMSNorm(Di, settings.rms_norm_eps).to(device=w.device, dtype=w.dtype)
            attn.index_k_norm = GemmaRMSNorm(Di, settings.rms_norm_eps).to(device=w.device, dtype=w.dtype)
            fresh += [attn.index_q_proj.weight, attn.index_k_proj.weight]
            attn.__dict__["_msakit_state"] = self._state
            attn.__dict__["_msakit_layer"] = i
            self._hooks.append(attn.register_forward_pre_hook(_capture_hidden, with_kwargs=True))
        if seed is not None:
            _normal_init(fresh, float(getattr(cfg, "initializer_range", 0.02)), seed)
        hf_model.set_attn_implementation(ATTN_IMPL)
        self.set_attention_mode(settings.mode)

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def wrap(cls, hf_model: nn.Module, *, index_head_dim=None, block_size=None, topk_blocks=None, local_blocks=None,
             init_blocks=None, rotary_dim=None, layers=None, seed: int = 0) -> "MSAWrappedModel":
        cfg = hf_model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        di = index_head_dim if index_head_dim is not None else head_dim
        rot = rotary_dim if rotary_dim is not None else min(64, di // 2, head_dim) // 2 * 2
        settings = MSASettings(
            index_head_dim=di, block_size=block_size if block_size is not None else 128,
            topk_blocks=topk_blocks if topk_blocks is not None else 16,
            local_blocks=1 if local_blocks is None else local_blocks,
            init_blocks=init_blocks if init_blocks is not None else 0, rotary_dim=rot,
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
        if enabled:
            self.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            self.hf.gradient_checkpointing_disable()

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
    ) -> M3Output:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must have shape [B, T], got {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        segments = document_segments(cu_seqlens, B, T)
        position_ids = positions
        if position_ids is None and len(segments) > 1:
            position_ids = segment_positions(segments, T, input_ids.device)
        st = self._state
        st.compute_kl, st.want_inputs, st.segments = compute_kl, return_attn_inputs, segments
        st.positions = position_ids if position_ids is not None else torch.arange(T, device=input_ids.device).unsqueeze(0)
        st.kls, st.inputs = [], {}
        try:
            out = self.hf(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                          output_hidden_states=output_hidden_states)
            kls, inputs = st.kls, st.inputs
        finally:
            st.kls, st.inputs, st.positions, st.segments = [], {}, None, []
            st.compute_kl = st.want_inputs = False
        logits = out.logits
        kl = torch.stack([x.float() for x in kls]).sum() if kls else torch.zeros((), device=logits.device)
        loss = lm_loss(logits, labels, segments) if labels is not None else None
        attn_inputs = None
        if return_attn_inputs:
            attn_inputs = [inputs.get(i) for i in range(len(self.hf.model.layers))]
        return M3Output(
            logits=logits, loss=loss, kl=kl, expert_load=torch.zeros(0, 0, device=logits.device),
            attn_inputs=attn_inputs, hidden_states=list(out.hidden_states) if output_hidden_states else None,
        )

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, generator: torch.Generator | None = None,
                 streamer: Callable[[torch.Tensor], Any] | None = None, eos_token_id: Any = None) -> torch.Tensor:
        """Sampling by recomputing the sequence each step (no KV cache for the wrapper)."""
        from msakit.generate import generate_uncached

        return generate_uncached(self, input_ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                 generator=generator, streamer=streamer, eos_token_id=eos_token_id)

    # -- I/O ---------------------------------------------------------------------------------
    def _index_state(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.hf.state_dict().items() if any(f".self_attn.{n}." in k for n in _INDEX_KEYS)}

    def save_pretrained(self, path: str | os.PathLike[str], **kwargs: Any) -> None:
        """The HF model as HF writes it (without the index branch) + msakit_index.safetensors
        (index weights under the M3 names) + msakit_msa.json (settings)."""
        from safetensors.torch import save_file

        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        index = self._index_state()
        rest = {k: v for k, v in self.hf.state_dict().items() if k not in index}
        self.hf.save_pretrained(str(folder), state_dict=rest, **kwargs)
        save_file({k: v.detach().to("cpu", copy=True).contiguous() for k, v in index.items()},
                  str(folder / INDEX_WEIGHTS), metadata={"format": "pt"})
        (folder / MSA_FILE).write_text(json.dumps(self.settings.to_dict(), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], device: Any = None, dtype: torch.dtype | None = None) -> "MSAWrappedModel":
        from safetensors.torch import load_file

        folder = Path(path)
        settings = MSASettings.from_dict(json.loads((folder / MSA_FILE).read_text(encoding="utf-8")))
        hf = _load_hf(folder, device, dtype)
        model = cls(hf, settings, seed=None)
        tensors = load_file(str(folder / INDEX_WEIGHTS))
        own = model._index_state()
        missing, unexpected = set(own) - set(tensors), set(tensors) - set(own)
        if missing or unexpected:
            raise ValueError(f"{folder / INDEX_WEIGHTS} does not match the model: missing {sorted(missing)[:6]}, "
                             f"unexpected {sorted(unexpected)[:6]}")
        with torch.no_grad():
            for k, t in tensors.items():
                if tuple(t.shape) != tuple(own[k].shape):
                    raise ValueError(f"{k}: checkpoint shape {list(t.shape)} but model {list(own[k].shape)}")
                own[k].copy_(t)
        return model

