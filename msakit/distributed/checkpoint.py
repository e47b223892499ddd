"""Sharded checkpoints through `torch.distributed.checkpoint` (DCP), and conversion to and from
msakit's single-file safetensors layout (`save_pretrained` / `from_pretrained`).

A sharded checkpoint is a folder:

    <dir>/.metadata, __<rank>_0.distcp   DCP: {"model": ..., "optim": ...} by parameter name (FQN)
    <dir>/config.json                    the model's config (HF names)
    <dir>/state.json                     what the caller adds (trainer step, loader position ...)

Every rank writes its own shards; DCP records the global shape of each tensor, so the folder loads
on any number of ranks (resharding on load), with FSDP2 or without, and on one process without
a process group.  Writes go to `<dir>.tmp` and are renamed when every rank has finished, so an
interrupted save never leaves a folder that looks complete.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from msakit.models import M3Config, M3ForCausalLM
from msakit.models.io import is_dcp_folder, load_dcp_weights

__all__ = ["save_sharded", "load_sharded", "load_model_only", "read_state", "is_sharded_checkpoint",
           "has_optimizer_state", "dcp_to_pretrained", "pretrained_to_dcp", "STATE_FILE"]

STATE_FILE = "state.json"


def _distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd}


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    return is_dcp_folder(path)


def save_sharded(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 state: dict | None = None) -> Path:
    """Save model (and optimizer) shards of every rank into the folder `path` (collective)."""
    import torch.distributed.checkpoint as dcp

    final = Path(path)
    tmp = final.with_name(final.name + ".tmp")
    if _rank() == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier()
    sd = _state_dicts(model, optimizer)
    dcp.save(sd, checkpoint_id=str(tmp), no_dist=not _distributed())
    if _rank() == 0:
        cfg = getattr(model, "config", None)
        if cfg is not None and hasattr(cfg, "save"):
            cfg.save(tmp)
        (tmp / STATE_FILE).write_text(json.dumps(state or {}, indent=1))
    _barrier()
    if _rank() == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    _barrier()
    return final


def read_state(path: str | os.PathLike) -> dict:
    """The `state` dict saved beside the shards."""
    p = Path(path) / STATE_FILE
    if not is_sharded_checkpoint(path) or not p.is_file():
        raise FileNotFoundError(f"not a sharded msakit checkpoint (no .metadata / {STATE_FILE}): {path}")
    return json.loads(p.read_text())


def load_sharded(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load a sharded checkpoint saved on any number of ranks into `model` (and `optimizer`), sharded
    or not (collective when a process group exists).  Returns the saved `state` dict."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    state = read_state(path)
    if optimizer is not None and not has_optimizer_state(path):
        optimizer = None  # a converted model folder: the optimizer starts fresh
    sd = _state_dicts(model, optimizer)
    dcp.load(sd, checkpoint_id=str(path), no_dist=not _distributed())
    if optimizer is None:
        set_model_state_dict(model, sd["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return state


def has_optimizer_state(path: str | os.PathLike) -> bool:
    """Whether the sharded checkpoint holds optimizer state (not one made by `pretrained_to_dcp`)."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(path)).read_metadata()
    return any(k.startswith("optim.") for k in meta.state_dict_metadata)


def dcp_to_pretrained(path: str | os.PathLike, out: str | os.PathLike, *, dtype: torch.dtype | None = None) -> Path:
    """Sharded checkpoint -> a `save_pretrained` folder (config.json + safetensors), on one process."""

    read_state(path)
    cfg = M3Config.from_pretrained(Path(path))
    model = M3ForCausalLM(cfg, init=False)
    load_model_only(path, model)
    if dtype is not None:
        model.to(dtype)
    model.save_pretrained(out)
    return Path(out)


def load_model_only(path: str | os.PathLike, model: nn.Module) -> None:
    """The model's weights of a sharded checkpoint into an unsharded model, without a process group
    (`msakit.models.io.load_dcp_weights`)."""
    load_dcp_weights(model, path)


def pretrained_to_dcp(folder: str | os.PathLike, path: str | os.PathLike, *, state: dict | None = None) -> Path:
    """A `save_pretrained` folder -> a sharded checkpoint without optimizer state (to continue training
    on many ranks from a single-file model), on one process."""

    model = M3ForCausalLM.from_pretrained(folder)
    final = Path(path)
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp), no_dist=True)
    model.config.save(tmp)
    (tmp / STATE_FILE).write_text(json.dumps(state or {}, indent=1))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final
