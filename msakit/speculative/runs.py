"""Drafter training runs in a run folder: a new DSpark drafter for a trained target
(`train_drafter_run`) and the continuation of one from its checkpoint (`resume_drafter_run`).

A run records its target, data settings and regeneration pool in its checkpoints (each a drafter
folder: config.json + model.safetensors, with the trainer state), so a resume replays the same
data.  As for `msakit.train.runs`, every user error is raised as ValueError / FileNotFoundError
before anything is written, and a fresh run that fails before its first checkpoint leaves
nothing behind.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from msakit.models import M3ForCausalLM
from msakit.speculative.config import DSparkConfig
from msakit.speculative.drafter import DSparkDrafter
from msakit.speculative.train import DrafterTrainConfig, DrafterTrainer, mix_streams, regenerate_pool
from msakit.train.data import PackedRows, TokenStream
from msakit.train.folders import (check_context, check_new_out, folder_kind, loading, model_folder, new_run_dir,
                                  resume_dir)
from msakit.train.runs import DEFAULT_CONTEXT, DataOptions, Log, open_resume, prepare, say
from msakit.train.tokenizer import Tokenizer

__all__ = ["DrafterRun", "RegenPool", "drafter_config", "load_target", "resume_drafter_run", "target_folder",
           "train_drafter_run", "POOL_FILE"]

DRAFTER_COMMAND = "train-drafter"  # the command whose runs these are (the run folder's marker)
POOL_FILE = "regen_pool.npz"  # OUT/regen_pool.npz: the target-written rows of a run with a pool


@dataclass
class RegenPool:
    """Rows the target writes once before training (half T 0.7 / top-p 0.8 / top-k 20, half
    greedy) from their first `prompt_tokens` tokens, mixed into the corpus as `share` of the rows."""

    rows: int
    share: float = 0.5
    prompt_tokens: int = 32


@dataclass
class DrafterRun:
    """A finished (or stopped) drafter run: its trainer and the target it was trained for."""

    trainer: DrafterTrainer
    target: Path


def target_folder(path: Path) -> Path:
    """The model folder of a target (run folder, checkpoint or model folder), refusing a drafter."""
    folder = model_folder(path, "target")
    if folder_kind(folder) == "drafter":
        raise ValueError(f"the target {path} is a DSpark drafter; pass the model the drafter is for")
    return folder


def load_target(folder: Path, device) -> M3ForCausalLM:
    with loading(folder, "the target"):
        return M3ForCausalLM.from_pretrained(folder, device=device)


def _target_tokenizer(tokenizer: str | Path | None, folder: Path, target: Path) -> Tokenizer:
    if tokenizer:
        return Tokenizer.load(tokenizer)
    for cand in (folder / "tokenizer.json", target / "tokenizer.json"):
        if cand.is_file():
            return Tokenizer.load(cand)
    raise FileNotFoundError(f"no tokenizer.json beside the target {target}; pass --tokenizer")


def drafter_config(target_config: Any, *, size: str = "small", config: str | Path | None = None,
                   overrides: Mapping[str, Any] | None = None) -> DSparkConfig:
    """The drafter's config: a DSpark config.json (`config`) or the `size` preset for the target,
    with `overrides` (DSparkConfig fields), checked against the target."""
    cfg = DSparkConfig.from_pretrained(config) if config else DSparkConfig.for_target(target_config, size)
    cfg = cfg.replace(**overrides) if overrides else cfg
    cfg.check_target(target_config)
    return cfg


def _with_pool(meta: dict, target, rows: PackedRows, out: Path, device, *, resuming: bool, log: Log) -> PackedRows:
    """The training rows, with the target-written pool mixed in when the run uses one (written
    once and saved beside the run, so a resume sees the same rows)."""
    spec = meta.get("regen_pool")
    if not spec:
        return rows
    path = out / POOL_FILE
    if path.is_file():
        with np.load(path, allow_pickle=False) as z:
            pool = TokenStream(z["tokens"].astype(np.int32), z["doc_starts"].astype(np.int64),
                               [f"regen/{i}" for i in range(len(z["doc_starts"]) - 1)], [])
    else:
        if resuming:
            raise FileNotFoundError(f"the run's regeneration pool {path} is missing; cannot resume the same run")
        log(f"regenerating {spec['rows']} rows with the target ...")
        pool = regenerate_pool(target.to(device), rows, spec["rows"], spec["prompt_tokens"], device=device)
        out.mkdir(parents=True, exist_ok=True)
        np.savez(path, tokens=pool.tokens, doc_starts=pool.doc_starts)
    return PackedRows(mix_streams(rows.stream, pool, spec["share"]), rows.context, rows.pad_id)


def _fit(trainer: DrafterTrainer, folder: Path, time_budget: float | None, log: Log) -> None:
    dc, cfg = trainer.drafter.config, trainer.cfg
    n = sum(p.numel() for p in trainer.drafter.parameters())
    log(f"drafter: {n / 1e6:.2f}M parameters, {dc.num_hidden_layers} layers, taps {dc.target_layer_ids}, "
        f"block {dc.draft_block_size}, Markov rank {dc.markov_rank}; target {folder} on {trainer.device}; "
        f"{cfg.steps} steps x {cfg.batch_size} rows x {cfg.anchors} anchors")
    trainer.fit(max_seconds=time_budget)


def train_drafter_run(out: Path, target: str | Path, *, train: DrafterTrainConfig, data: DataOptions,
                      size: str = "small", config: str | Path | None = None,
                      overrides: Mapping[str, Any] | None = None, tokenizer: str | Path | None = None,
                      regen_pool: RegenPool | None = None, device: torch.device | str = "cpu",
                      cache_dir: str | None = None, progress: bool = True, time_budget: float | None = None,
                      log: Log = say) -> DrafterRun:
    """Train a DSpark drafter for the frozen `target` (run folder, checkpoint or model folder) in
    the new run folder `out`: the drafter of `drafter_config(size, config, overrides)`, on the
    corpus of `data` (`data.context` None: 512 tokens or the target's positions) encoded by the
    target's tokenizer (or `tokenizer`), with `regen_pool` rows written by the target mixed in;
    `time_budget` fits the steps into that many seconds."""
    out = Path(out)
    check_new_out(out)
    target_path = Path(target)
    folder = target_folder(target_path)
    model = load_target(folder, device)
    # everything is validated before the (slower) data preparation
    dcfg = drafter_config(model.config, size=size, config=config, overrides=overrides)
    tok = _target_tokenizer(tokenizer, folder, target_path)
    if tok.vocab_size > model.config.vocab_size:
        raise ValueError(f"the tokenizer has {tok.vocab_size} tokens but the target's vocabulary is "
                         f"{model.config.vocab_size}")
    if data.context is None:
        data = dataclasses.replace(data, context=min(DEFAULT_CONTEXT, model.config.max_position_embeddings))
    check_context(model.config, data.context)
    data.check()
    meta: dict[str, Any] = {"target": str(target_path.resolve()), "data": data.to_dict()}
    prompts = [train.regen_prompt_tokens] if train.regenerate else []
    if regen_pool:
        prompts.append(regen_pool.prompt_tokens)
    for n in prompts:
        if not 1 <= n < data.context:
            raise ValueError(f"--regen-prompt-tokens must be in [1, context={data.context}), got {n}")
    if regen_pool:
        meta["regen_pool"] = dataclasses.asdict(regen_pool)
    with new_run_dir(out, DRAFTER_COMMAND):  # a fresh run that fails before its first checkpoint leaves nothing behind
        pd = prepare(data, tokenizer=tok, cache_dir=cache_dir, log=log)
        torch.manual_seed(train.seed)
        drafter = DSparkDrafter(dcfg)
        rows = _with_pool(meta, model, pd.train, out, device, resuming=False, log=log)
        trainer = DrafterTrainer(model, drafter, train, rows, pd.val, out_dir=out, device=device, tokenizer=tok,
                                 progress=progress, meta=meta)
        _fit(trainer, folder, time_budget, log)
    return DrafterRun(trainer, target_path)


def resume_drafter_run(out: Path, *, target: str | Path | None = None, checkpoint: Path | None = None,
                       steps: int | None = None, tokenizer: str | Path | None = None,
                       device: torch.device | str = "cpu", cache_dir: str | None = None, progress: bool = True,
                       time_budget: float | None = None, log: Log = say) -> DrafterRun | None:
    """Continue a drafter run from `checkpoint` (default: run folder `out`'s latest) with its
    recorded target (`target` where it records none; a `target` other than the recorded one is
    refused), data and settings, to `steps` (default: its own).  None when the run has already reached its steps.  `out` is held (its marker must name
    a drafter run) while the run continues."""
    out = Path(out)
    with resume_dir(out, checkpoint, DRAFTER_COMMAND, (DRAFTER_COMMAND,)):
        return _resume(out, target=target, checkpoint=checkpoint, steps=steps, tokenizer=tokenizer, device=device,
                       cache_dir=cache_dir, progress=progress, time_budget=time_budget, log=log)


def _resume(out: Path, *, target: str | Path | None, checkpoint: Path | None, steps: int | None,
            tokenizer: str | Path | None, device: torch.device | str, cache_dir: str | None, progress: bool,
            time_budget: float | None, log: Log) -> DrafterRun | None:
    point = open_resume(out, checkpoint, DrafterTrainConfig.from_dict, steps=steps, drafter=True, log=log)
    if point is None:
        return None
    ck, state, cfg = point
    meta = state.get("meta", {})
    recorded = meta.get("target")
    if recorded is None and target is None:
        raise ValueError(f"{ck} records no target; give the target (TARGET) with --resume")
    if recorded is not None and target is not None and Path(target).resolve() != Path(recorded).resolve():
        raise ValueError(f"the run's target is {recorded}; resume it without TARGET (or with that one), "
                         f"not {target}")
    target_path = Path(recorded if recorded is not None else target)
    folder = target_folder(target_path)
    model = load_target(folder, device)
    tok = _target_tokenizer(tokenizer, folder, target_path)
    pd = prepare(DataOptions.from_dict(meta["data"]), tokenizer=tok, cache_dir=cache_dir, log=log)
    drafter = DSparkDrafter(DSparkConfig.from_pretrained(ck))
    rows = _with_pool(meta, model, pd.train, out, device, resuming=True, log=log)
    trainer = DrafterTrainer(model, drafter, cfg, rows, pd.val, out_dir=out, device=device, tokenizer=tok,
                             progress=progress, meta=meta)
    trainer.resume(ck)
    log(f"resumed {ck} at step {trainer.step}")
    _fit(trainer, folder, time_budget, log)
    return DrafterRun(trainer, target_path)
