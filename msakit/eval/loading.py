"""Loading what `run_eval` takes from a model folder: the model, prepared for the policies asked
for, and its tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from msakit.eval.hf_policy import HFPolicyModel
from msakit.eval.runner import EvalConfig, parse_policy
from msakit.models.convert import apply_rope_scaling, convert_dense_to_msa, load_for_conversion
from msakit.models.interface import SparseModel
from msakit.models.io import read_tokenizer_file

__all__ = ["load_eval_model", "load_eval_tokenizer"]


def load_eval_tokenizer(model_dir: Path, path: str | Path | None = None, *, beside: Path | None = None):
    """The `tokenizers.Tokenizer` of `path` (a tokenizer.json; default the model folder's, else
    the one in folder `beside`, e.g. the run folder holding the model); ModelFolderError naming
    the file when it cannot be read."""
    tok = Path(path).expanduser() if path else Path(model_dir) / "tokenizer.json"
    if not path and not tok.is_file() and beside is not None:
        tok = Path(beside) / "tokenizer.json"
    if not tok.is_file():
        raise FileNotFoundError(f"no tokenizer at {tok}: give --tokenizer PATH/tokenizer.json")
    return read_tokenizer_file(tok)


def load_eval_model(model_dir: Path, cfg: EvalConfig, *, device: Any, dtype: Any, init_blocks: int = 0,
                    log: Callable[[str], None] = print, rope_scaling: str | None = None) -> Any:
    """Load the model folder.  A plain HF model runs window / oracle policies through
    `HFPolicyModel`; with the msa policy it gets an untrained index branch at the budget
    (seeded by cfg.seed) instead.  `rope_scaling` ("yarn:4") scales the RoPE of an HF-backed model
    past its native context (`msakit.models.convert.apply_rope_scaling`)."""
    model = load_for_conversion(model_dir, device=device, dtype=dtype)
    if rope_scaling:
        log(f"rope scaling {apply_rope_scaling(model, rope_scaling)}")
    kinds = {parse_policy(p)[0] for p in cfg.policies}
    sparse = bool(kinds - {"dense", "last"})
    if sparse and not isinstance(model, SparseModel) and "msa" not in kinds:
        log(f"running the policies on the HF model's attention ({cfg.budget}; no index branch)")
        model = HFPolicyModel(model, block_size=cfg.budget.block_size, topk=cfg.budget.topk, init_blocks=init_blocks)
    elif sparse and not isinstance(model, SparseModel):
        log(f"adding an untrained index branch ({cfg.budget}, init_blocks {init_blocks}, seed {cfg.seed})")
        model = convert_dense_to_msa(model, block_size=cfg.budget.block_size, topk=cfg.budget.topk,
                                     init_blocks=init_blocks, seed=cfg.seed, device=device, dtype=dtype)
    model.to(device=device, dtype=dtype)
    model.eval()
    return model
