"""Models: `M3Config` (HF config.json in and out, presets), `M3ForCausalLM`, safetensors I/O under
the HF MiniMax-M3 names, the declared model interface, and dense -> MSA conversion.

- `msakit.models.interface`: what training, evaluation, generation and speculative decoding may
  call on a model (`SparseModel` < `SelectionModel` < `MSAModel`), `M3Output` and the forward
  contract's shared pieces (documents, positions, LM loss, output assembly);
- `msakit.models.modeling`: `M3ForCausalLM`, an `MSAModel`::

    cfg = M3Config.preset("tiny")            # "small", "minimax-m3", "minimax-m3.1-flash"; M3Config.from_pretrained(path)
    model = M3ForCausalLM(cfg)               # initialised in __init__ (model.reset_parameters() again)
    out = model(input_ids,                   # [B, T] int64
                labels=None,                 # [B, T]: HF convention (== input_ids, shifted inside; -100 ignored)
                positions=None,              # [B, T] or None
                cu_seqlens=None,             # int32 [ndocs + 1], B == 1: documents of a packed batch
                compute_kl=True,             # each MSA layer's indexer KL term
                return_attn_inputs=False)    # out.attn_inputs: per layer dict(q, k, q_idx, k_idx, block_idx), detached
    out.logits, out.loss, out.kl, out.expert_load   # [B,T,V]; mean CE or None; sum of layer KLs; [n_moe, E]
    model.set_attention_mode("dense" | "sparse")
    model.update_routing_bias(out.expert_load, rate=1e-3)
    model.save_pretrained(dir); M3ForCausalLM.from_pretrained(dir, device=None, dtype=None)
    out = model(new_ids, cache=cache, taps=None, logits_to_keep=0)   # decoding: a msakit.cache.KVCacheProtocol
                                             # (new positions written, attention over what it holds); out.taps

- `msakit.models.convert`: `convert_dense_to_msa(model_or_path, ...)`, `load_for_conversion(path)`,
  `init_index_from_qk(model)`;
- `msakit.models.hf`: MSA on HF causal LMs (`MSAWrappedModel`, an `MSAModel`), family-agnostic;
- `msakit.models.adapters`: one adapter per HF family (where the attention lives, its shape,
  the q/k projections, unsupported variants) and their registry;
- `msakit.models.hooks`: attaching msakit to modules it did not build (state, class swaps,
  keyed hooks, the one transformers attention function) -- used by `hf`, evaluation policies
  and QAT.

Config I/O (`read_config_json`, `write_config_json`, `load_config_file` and the field readers
`get_field`, `get_int_field`, `check_fixed_fields`, `get_rotary_dim`) is defined in the
torch-free `msakit.config_io`, which `msakit.cost` also uses, and re-exported here.
"""

from msakit import config_io
from msakit.config_io import (check_fixed_fields, get_field, get_int_field, get_rotary_dim, load_config_file,
                              read_config_json, write_config_json)
from msakit.models.config import M3_MODEL_TYPES, PRESETS, M3Config
from msakit.models.convert import convert_dense_to_msa, load_for_conversion
from msakit.models.hf import MSAWrappedModel
from msakit.models.interface import M3Output, MSAModel, SelectionModel, SparseModel
from msakit.models.modeling import M3DecoderLayer, M3ForCausalLM, M3Model, parameter_counts

__all__ = [
    "M3Config",
    "M3ForCausalLM",
    "M3Model",
    "M3DecoderLayer",
    "M3Output",
    "MSAModel",
    "SelectionModel",
    "SparseModel",
    "PRESETS",
    "M3_MODEL_TYPES",
    "parameter_counts",
    *config_io.__all__,
    "convert_dense_to_msa",
    "load_for_conversion",
    "MSAWrappedModel",
]

