"""M3-style models: `M3Config` (HF config.json in and out, presets), `M3ForCausalLM`, safetensors
I/O under the HF MiniMax-M3 names, and dense -> MSA conversion.

Interface shared with training (`msakit.train`) and speculative decoding (`msakit.speculative`)::

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
    model.generate(input_ids, max_new_tokens, temperature=1.0, top_k=None, top_p=None, generator=None, streamer=None)
    out = model(new_ids, cache=cache, taps=None, logits_to_keep=0)   # decoding: a msakit.cache.KVCacheProtocol
                                             # (new positions written, attention over what it holds); out.taps

Conversion: `convert_dense_to_msa(model_or_path, ...)` and `load_for_conversion(path)` in
`msakit.models.convert` (imported lazily: it needs `transformers` only for HF models).

Config I/O (`read_config_json`, `write_config_json`, `load_config_file` and the field readers
`get_field`, `get_int_field`, `check_fixed_fields`, `get_rotary_dim`) is defined in the
torch-free `msakit.config_io`, which `msakit.cost` also uses, and re-exported here.
"""

from msakit import config_io
from msakit.config_io import (check_fixed_fields, get_field, get_int_field, get_rotary_dim, load_config_file,
                              read_config_json, write_config_json)
from msakit.models.config import M3_MODEL_TYPES, PRESETS, M3Config
from msakit.models.modeling import M3DecoderLayer, M3ForCausalLM, M3Model, M3Output, parameter_counts

__all__ = [
    "M3Config",
    "M3ForCausalLM",
    "M3Model",
    "M3DecoderLayer",
    "M3Output",
    "PRESETS",
    "M3_MODEL_TYPES",
    "parameter_counts",
    *config_io.__all__,
    "convert_dense_to_msa",
    "load_for_conversion",
]


def __getattr__(name: str):
    if name in ("convert_dense_to_msa", "load_for_conversion", "MSAWrappedModel"):
        from msakit.models import convert

        return getattr(convert, name)
    raise AttributeError(f"module 'msakit.models' has no attribute {name!r}")
