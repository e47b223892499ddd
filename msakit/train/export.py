"""Exporting a run's model: the newest checkpoint of a run folder -- the single-file layout of a
run on one process or the sharded DCP checkpoint of a run on several -- (or a checkpoint, or a
model folder) written as a model folder in the single-file safetensors layout (config.json +
model.safetensors or shards + index, tokenizer.json), which `msakit generate`, `msakit eval
--model`, `train --init`, `convert` and transformers (once msakit is imported) read."""

from __future__ import annotations

from pathlib import Path

import torch

from msakit.train.folders import (check_new_out, folder_kind, load_model_folder, model_folder, save_model_folder,
                                  tokenizer_beside)

__all__ = ["export_model"]


def export_model(source: str | Path, out: str | Path, *, dtype: torch.dtype | None = None) -> Path:
    """Write the model of `source` (run folder, checkpoint or model folder) with its tokenizer into
    the new or empty folder `out` (weights in `dtype`; default as stored); returns `out`.  Every
    problem (a missing or damaged source, a drafter, an `out` holding anything) is a ValueError /
    FileNotFoundError before anything is written."""
    source, out = Path(source), Path(out)
    check_new_out(out)
    folder = model_folder(source)
    if folder_kind(folder) == "drafter":
        raise ValueError(f"{source} is a DSpark drafter: its checkpoints are already drafter folders")
    tok = tokenizer_beside(source)
    model = load_model_folder(folder, dtype=dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    return save_model_folder(model, tok, out)
