"""Dense -> MSA conversion (the paper's "near-lossless conversion from pretrained GQA checkpoints").

Two sources:

- msakit's own `M3ForCausalLM` whose config has dense-attention layers (sparse_attention_freq 0):
  those layers get a freshly initialised index branch and their freq becomes 1.  Every other
  weight is copied, so in "dense" mode the converted model computes exactly what it did before.
- HF causal LMs of a registered family (`msakit.models.adapters`: llama, mistral, qwen2, qwen3,
  and any family added by one adapter file), loaded through `transformers` from a local folder:
  `msakit.models.hf.MSAWrappedModel` keeps the HF model and its own attention math and gives
  each converted layer an index branch (see `msakit.models.hf`).

Both return a model in "dense" mode with the `msakit.models.interface.MSAModel` interface.
`load_for_conversion(path)` picks the loader by config.json's model_type;
`init_index_from_qk(model)` starts the index branches from the main q/k projections;
`apply_rope_scaling(model, "yarn:4")` sets an HF model's rope scaling (YaRN past the native context).
`is_converted(model)` says whether a model already has every index branch a conversion would add
(a warmed model: stage 2 continues it), and `set_selection(model, ...)` changes an MSA model's
selection settings (block size, top-k, forced initial blocks; no weight depends on them).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from msakit.config_io import read_config_json
from msakit.models.adapters import FamilyAdapter, find_family, supported_model_types
from msakit.models.config import M3_MODEL_TYPES
from msakit.models.hf import (DEFAULT_BLOCK_SIZE, DEFAULT_TOPK, MSAWrappedModel, is_msa_folder, load_hf_model,
                              normal_init)
from msakit.models.io import ModelFolderError, reading
from msakit.models.sizes import check_selection_fits, max_positions
from msakit.models.modeling import M3ForCausalLM
from msakit.nn.attention import INDEX_MODULES
from msakit.nn.norm import GemmaRMSNorm

__all__ = [
    "INDEX_INITS",
    "apply_rope_scaling",
    "convert_dense_to_msa",
    "init_index_from_qk",
    "is_converted",
    "load_for_conversion",
    "set_selection",
]

INDEX_INITS = ("random", "qk")


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------


def load_for_conversion(path: str | os.PathLike[str], device: Any = None, dtype: torch.dtype | None = None) -> nn.Module:
    """Load a model folder: msakit / MiniMax-M3 (`M3ForCausalLM`), a saved `MSAWrappedModel`, or
    an HF model of a registered family (through transformers, offline).  Decided by config.json's
    model_type.  The one model loader of the commands: a damaged or non-finite folder raises
    `msakit.models.io.ModelFolderError` naming the file (a missing one FileNotFoundError)."""
    folder = Path(path)
    raw, cfg_path = read_config_json(folder / "config.json", "config.json")
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    with reading(folder, "the model"):
        if is_msa_folder(folder):
            return MSAWrappedModel.from_pretrained(folder, device=device, dtype=dtype)
        if model_type in M3_MODEL_TYPES:
            return M3ForCausalLM.from_pretrained(folder, device=device, dtype=dtype)
        if not isinstance(model_type, str) or find_family(model_type) is None:
            raise ModelFolderError(f"{cfg_path}: model_type {model_type!r} is not supported for conversion "
                                   f"(msakit/MiniMax-M3: {', '.join(M3_MODEL_TYPES)}; HF: "
                                   f"{', '.join(supported_model_types())})")
        return load_hf_model(folder, device, dtype)


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
    the main q/k projections; HF models then default to the dims the main RoPE rotates)."""
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
    cfg = getattr(model, "config", None)
    bs = block_size or getattr(cfg, "index_block_size", None) or DEFAULT_BLOCK_SIZE
    check_selection_fits(bs, topk or getattr(cfg, "index_topk_blocks", None) or DEFAULT_TOPK, max_positions(cfg))
    if isinstance(model, M3ForCausalLM):
        if rotary_dim is not None and rotary_dim != model.config.rotary_dim:
            raise ValueError(f"rotary_dim={rotary_dim}: an M3 index branch uses the main branch's partial RoPE "
                             f"(rotary_dim={model.config.rotary_dim})")
        new = _convert_m3(model, **opts)
    elif (family := _hf_family(model)) is not None:
        if index_init == "qk" and rotary_dim is None:
            rotary_dim = family.rotary_dim(model.config)
        new = MSAWrappedModel.wrap(model, rotary_dim=rotary_dim, **opts)
    else:
        raise ValueError(f"cannot convert a {type(model).__name__}: expected an M3ForCausalLM, an HF causal LM "
                         f"({', '.join(supported_model_types())}) or a model folder")
    if index_init == "qk":
        init_index_from_qk(new)
    return new


def is_converted(model: nn.Module) -> bool:
    """True for a model that already has the index branches a conversion would add: an
    `MSAWrappedModel`, or an `M3ForCausalLM` whose every layer is MSA (what `convert_dense_to_msa`
    makes of a dense one).  Such a model is trained on from its own index weights (stage 2 of the
    conversion recipe), not converted again."""
    if isinstance(model, MSAWrappedModel):
        return True
    return isinstance(model, M3ForCausalLM) and model.config.num_sparse_layers == model.config.num_hidden_layers


def set_selection(model: nn.Module, *, block_size: int | None = None, topk: int | None = None,
                  init_blocks: int | None = None) -> None:
    """Change the selection settings of every MSA layer of `model` (an `MSAWrappedModel` or an
    `M3ForCausalLM` with MSA layers) in place and in its config (what `save_pretrained` writes):
    blocks of `block_size`, `topk` blocks per query, `init_blocks` leading blocks forced (None:
    unchanged).  No weight depends on them.  ValueError naming the setting when the selection
    cannot be made (top-k below the forced and local blocks, a block longer than the positions)."""
    for name, val, lo in (("block_size", block_size, 1), ("topk", topk, 1), ("init_blocks", init_blocks, 0)):
        if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < lo):
            raise ValueError(f"{name} must be an integer >= {lo} (or None: unchanged), got {val!r}")
    if isinstance(model, MSAWrappedModel):
        old = model.settings.selection
    elif isinstance(model, M3ForCausalLM) and model.msa_layers():
        old = model.config.selection
    else:
        raise ValueError(f"set_selection takes an MSA model (MSAWrappedModel or M3ForCausalLM with MSA layers), "
                         f"got {type(model).__name__}")
    sel = dataclasses.replace(old, **{k: v for k, v in (("block_size", block_size), ("topk", topk),
                                                         ("init_blocks", init_blocks)) if v is not None})
    if sel.topk < sel.local_blocks + sel.init_blocks:
        raise ValueError(f"topk {sel.topk} is below the {sel.local_blocks} local + {sel.init_blocks} initial blocks "
                         "every query selects")
    check_selection_fits(sel.block_size, sel.topk, max_positions(model.config))
    if isinstance(model, MSAWrappedModel):
        model.settings.selection = sel  # the settings save_pretrained writes (shared with the layers' state)
        model._state.cfg = dataclasses.replace(model.msa_config, selection=sel)  # what the layers select by
        return
    model.config = model.config.replace(index_block_size=sel.block_size, index_topk_blocks=sel.topk,
                                        index_init_blocks=sel.init_blocks)
    if getattr(model.model, "config", None) is not None:
        model.model.config = model.config
    for attn in model.msa_layers():
        attn.cfg = dataclasses.replace(attn.cfg, selection=sel)


def _hf_family(model: Any) -> FamilyAdapter | None:
    """The family adapter of an HF causal LM, or None (not an HF model, or no adapter)."""
    mt = getattr(getattr(model, "config", None), "model_type", None)
    return find_family(mt) if isinstance(model, nn.Module) and isinstance(mt, str) else None


# ---------------------------------------------------------------------------------------------
# msakit M3 models
# ---------------------------------------------------------------------------------------------


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
    normal_init(projs, new_cfg.initializer_range, seed)
    with torch.no_grad():
        for n in fresh:
            if "_norm." in n:
                params[n].zero_()
    new.set_attention_mode("dense")
    new.train(model.training)
    return new


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
    head_dim; for HF models the index RoPE should rotate what the main RoPE rotates (the family
    adapter's `rotary_dim`, which `convert_dense_to_msa(index_init="qk")` picks).  An HF model's
    q/k projection weights and norms come from its family adapter (`qk_weights`, `qk_norms`: a
    fused QKV projection is split there)."""
    if isinstance(model, MSAWrappedModel):
        attns = model.msa_attention_modules()
        sel = model.msa_config
        qk = [model.adapter.qk_weights(a) for a in attns]
        norms = [model.adapter.qk_norms(a) for a in attns]
    elif isinstance(model, M3ForCausalLM):
        attns = model.msa_layers()
        if not attns:
            raise ValueError("the model has no MSA layers")
        sel = attns[0].cfg
        qk = [(a.q_proj.weight, a.k_proj.weight) for a in attns]
        norms = [(a.q_norm, a.k_norm) for a in attns]
    else:
        raise ValueError(f"init_index_from_qk takes an MSAWrappedModel or an M3ForCausalLM, got {type(model).__name__}")
    Hq, G, D, Di = sel.num_heads, sel.num_kv_heads, sel.head_dim, sel.index_dim
    if Di != D:
        raise ValueError(f"init_index_from_qk needs index_head_dim == head_dim, got {Di} and {D}")
    for attn, (wq, wk), main_norms in zip(attns, qk, norms):
        attn.index_q_proj.weight.copy_(wq.float().view(G, Hq // G, D, -1).mean(1).reshape(G * D, -1))
        attn.index_k_proj.weight.copy_(wk.float().view(G, D, -1).mean(0))
        for norm, index in zip(main_norms, (attn.index_q_norm, attn.index_k_norm)):
            if isinstance(norm, GemmaRMSNorm):
                index.weight.copy_(norm.weight)
            elif isinstance(getattr(norm, "weight", None), torch.Tensor) and norm.weight.shape == index.weight.shape:
                index.weight.copy_(norm.weight.float() - 1.0)  # HF RMSNorm scales by weight, Gemma's by 1 + weight
            else:
                index.weight.zero_()


# ---------------------------------------------------------------------------------------------
# RoPE scaling (contexts past the native one)
# ---------------------------------------------------------------------------------------------

ROPE_SCALINGS = ("yarn", "linear", "dynamic")


def rope_scaling_dict(spec: str, native: int) -> dict[str, Any]:
    """"yarn:4" or "yarn:4:32768" -> transformers' rope-scaling dict ({"rope_type": "yarn", "factor": 4.0,
    "original_max_position_embeddings": 32768}; the native context `native` when not given)."""
    parts = str(spec).split(":")
    if len(parts) not in (2, 3) or parts[0] not in ROPE_SCALINGS:
        raise ValueError(f"rope scaling must be TYPE:FACTOR[:NATIVE] with TYPE one of {', '.join(ROPE_SCALINGS)}, "
                         f"got {spec!r}")
    try:
        factor = float(parts[1])
        orig = int(parts[2]) if len(parts) == 3 else int(native)
    except ValueError:
        raise ValueError(f"rope scaling {spec!r}: FACTOR must be a number and NATIVE an integer") from None
    if not (factor > 1.0 and factor < 1e6) or orig < 1:
        raise ValueError(f"rope scaling {spec!r}: FACTOR must be > 1 and NATIVE >= 1")
    return {"rope_type": parts[0], "type": parts[0], "factor": factor, "original_max_position_embeddings": orig}


def apply_rope_scaling(model: nn.Module, spec: str) -> dict[str, Any]:
    """Give an HF-backed model (a transformers causal LM, `MSAWrappedModel`, an eval wrapper with
    ``.hf``) the rope scaling `spec` ("yarn:4": YaRN, factor 4, over the config's native positions),
    as transformers does when config.json holds it: the config's ``rope_scaling`` (and
    ``rope_parameters``, keeping rope_theta) are set, ``max_position_embeddings`` becomes factor x
    native, and every rotary-embedding module is rebuilt from the config.  The main attention then
    runs HF's own scaled RoPE (MSA's handlers receive q and k after it); the index branch keeps its
    own unscaled partial RoPE.  Saving the model writes the scaling into config.json.  Returns the
    scaling dict."""
    hf = getattr(model, "hf", model)
    cfg = getattr(hf, "config", None)
    if cfg is None or not hasattr(cfg, "max_position_embeddings"):
        raise ValueError(f"rope scaling needs an HF model with a config, got {type(model).__name__}")
    held = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if held.get("rope_type", held.get("type", "default")) != "default":
        raise ValueError(f"the model already has rope scaling {held}")
    scaling = rope_scaling_dict(spec, cfg.max_position_embeddings)
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    params.setdefault("rope_theta", float(getattr(cfg, "rope_theta", 10000.0)))
    params.update(scaling)
    if hasattr(cfg, "rope_parameters"):  # transformers 5: rope_scaling is its deprecated alias
        cfg.rope_parameters = params
    else:
        cfg.rope_scaling = params
    cfg.max_position_embeddings = int(scaling["original_max_position_embeddings"] * scaling["factor"])
    rebuilt = 0
    for name, mod in list(hf.named_modules()):
        if type(mod).__name__.endswith("RotaryEmbedding") and hasattr(mod, "inv_freq"):
            new = type(mod)(config=cfg).to(mod.inv_freq.device)
            parent = hf.get_submodule(name.rsplit(".", 1)[0]) if "." in name else hf
            setattr(parent, name.rsplit(".", 1)[-1], new)
            rebuilt += 1
    if not rebuilt:
        raise ValueError(f"no rotary-embedding module found in {type(hf).__name__}")
    return scaling
