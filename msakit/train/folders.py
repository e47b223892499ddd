"""Run folders and model folders: what a run may write into, what a folder holds, loading and
saving models with their tokenizers.

A fresh run writes only into an empty or new folder (`new_run_dir`, through
`msakit.run_folder.claim`: the folder is marked with the command and locked while the run
lasts); when it fails or is interrupted before its first complete checkpoint, what it wrote is
removed again, so the same run can simply be started again.  A resumed run takes only a folder
marked by a command it continues (`resumed_run_dir`).  Every problem with a folder (missing, not empty, corrupt, the wrong
kind) is raised as ValueError / FileNotFoundError (`CheckpointError` is a ValueError) before
anything is written.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ContextManager, Iterator, Sequence

from msakit.models.adapters import MSA_PREFIX, find_family
from msakit.models.convert import load_for_conversion
from msakit.run_folder import RunClaim, check_fresh, claim
from msakit.train import checkpoint as ckpt_mod
from msakit.train.tokenizer import Tokenizer
from msakit.train.trainer import SHARDED_DIR

MODEL_DIR = "model"  # RUN/model: the converted model at the end of a conversion run (weights + tokenizer)


# ----------------------------------------------------------------------------- run folders
TRAIN_COMMANDS = ("train", "convert")  # the commands whose runs `msakit train/convert --resume` continue


def holds_checkpoint(out: Path) -> bool:
    """Whether run folder `out` holds a checkpoint: a complete one under checkpoints/, or any
    sharded (multi-rank) one."""
    sharded = out / SHARDED_DIR
    return ckpt_mod.find_checkpoint(out) is not None or (sharded.is_dir() and any(sharded.iterdir()))


def check_new_out(out: Path) -> None:
    """RunFolderError unless `out` may take a fresh run (`msakit.run_folder.check_fresh`: missing
    or empty, held by no other process); a folder with a checkpoint but no marker is a run too."""
    check_fresh(out, legacy=holds_checkpoint)


def new_run_dir(out: Path, command: str) -> ContextManager[RunClaim]:
    """A fresh run of `command` in `out` (`msakit.run_folder.claim`: refused unless missing or
    empty; marked and locked while it runs); when the body fails or is interrupted before a
    checkpoint exists, everything the run wrote is removed."""
    return claim(out, command, legacy=holds_checkpoint, keep=holds_checkpoint)


def resumed_run_dir(out: Path, command: str, accepts: Sequence[str]) -> ContextManager[RunClaim]:
    """Continuing the run in `out` (`msakit.run_folder.claim` with resume: its marker must name one
    of `accepts`; a folder holding a checkpoint but no marker is taken as such a run); locked
    while it runs."""
    return claim(out, command, resume=True, accepts=accepts, legacy=holds_checkpoint)


def run_folder_of(ckpt: Path) -> Path:
    """The run folder a checkpoint lies in (``RUN/checkpoints/step-N``, ``RUN/sharded/step-N`` -> RUN),
    else its folder."""
    ck = Path(ckpt)
    return ck.parent.parent if ck.parent.name in (ckpt_mod.CKPT_DIR, ckpt_mod.SHARDED_DIR) else ck.parent


def resume_dir(out: Path, checkpoint: Path | None, command: str, accepts: Sequence[str]) -> ContextManager[RunClaim]:
    """The claim of a resumed run's folder `out`: the run's own folder (`checkpoint` None, or one
    of `out`'s checkpoints) is continued (`resumed_run_dir`); a checkpoint of another folder is
    continued into `out` as a fresh run (`new_run_dir`: a new or empty folder)."""
    if checkpoint is not None:
        ck = ckpt_mod.resolve_checkpoint(checkpoint)
        if os.path.abspath(run_folder_of(ck)) != os.path.abspath(out):
            return new_run_dir(out, command)
    return resumed_run_dir(out, command, accepts)


# ----------------------------------------------------------------------------- model folders
def model_folder(path: Path, what: str = "model") -> Path:
    """A checkpoint / run folder (verified against its manifest) or a plain model folder; `what`
    names it in the error for a missing path."""
    if not path.exists():
        raise FileNotFoundError(f"{what} not found: {path}")
    ck = ckpt_mod.find_checkpoint(path)
    if ck is not None:
        ckpt_mod.verify_checkpoint(ck)
        return ck
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no checkpoint or config.json in {path}")
    return path


def folder_kind(folder: Path) -> str:
    """What a model folder holds, from its config.json: "drafter" (a DSpark drafter), "hf-dense"
    (an HF model without MSA index branches) or "model" (anything else msakit loads)."""
    try:
        raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return "model"  # the loader reports the problem
    if not isinstance(raw, dict):
        return "model"
    text = raw.get("text_config", raw)
    if isinstance(text, dict) and any(str(k).startswith("dspark_") for k in text):
        return "drafter"
    mt = raw.get("model_type")
    if isinstance(mt, str) and not mt.startswith(MSA_PREFIX) and find_family(mt) is not None:
        return "hf-dense"  # a saved MSA model says "msakit_<family>"
    return "model"


@contextmanager
def loading(folder: Path, what: str = "the model") -> Iterator[None]:
    """Around loading `what` from `folder`: the errors of a damaged folder (safetensors,
    transformers) become one CheckpointError line."""
    try:
        yield
    except (ValueError, FileNotFoundError):
        raise
    except Exception as e:
        raise ckpt_mod.CheckpointError(f"cannot load {what} in {folder}: {str(e).splitlines()[0]}") from None


def load_model_folder(folder: Path, device=None, dtype=None):
    """Any model folder msakit can train: an M3 checkpoint, a converted (wrapped) HF model
    (weights in `dtype`, a torch dtype; default the loader's)."""
    with loading(folder):
        return load_for_conversion(folder, device=device, dtype=dtype)


def tokenizer_beside(path: Path) -> Tokenizer:
    """The tokenizer.json saved beside a model (in its checkpoint or model folder, or in `path`);
    an HF tokenizer without a known end-of-text token takes the config's eos_token_id."""
    folder = model_folder(path)
    for cand in (folder / "tokenizer.json", path / "tokenizer.json"):
        if cand.is_file():
            eos = None
            cfgp = folder / "config.json"
            if cfgp.is_file():
                try:
                    e = json.loads(cfgp.read_text()).get("eos_token_id")
                    eos = e[0] if isinstance(e, list) and e else (e if isinstance(e, int) else None)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    pass
            try:
                return Tokenizer.load(cand)
            except ValueError:
                if eos is None:
                    raise
                return Tokenizer.load(cand, eos_id=eos)
    raise FileNotFoundError(f"no tokenizer.json beside {path}; pass --tokenizer")


def save_model_folder(model, tokenizer, folder: Path) -> Path:
    """`model.save_pretrained` + the tokenizer into `folder` (what `msakit eval --model` and
    `msakit generate` take), written beside it first and then put in its place whole."""
    folder = Path(folder)
    tmp = folder.with_name(f".tmp-{folder.name}-{os.getpid()}")
    old = folder.with_name(f".old-{folder.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        tokenizer.save(tmp)
        if folder.exists():
            os.rename(folder, old)
        os.rename(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return folder


def check_context(model_config: Any, context: int) -> None:
    maxpos = getattr(model_config, "max_position_embeddings", None)
    if maxpos is not None and context > int(maxpos):
        raise ValueError(f"context {context} is longer than the model's max_position_embeddings ({maxpos})")


def check_vocab(model, tok) -> None:
    V = getattr(model.config, "vocab_size", None)
    if V is not None and tok.vocab_size > int(V):
        raise ValueError(f"the tokenizer has {tok.vocab_size} tokens but the model's vocabulary is {V}")
