"""Training runs in a run folder: a new run (`train_run`: a model from a preset, a config or a
model folder), a conversion run (`convert_run`: a dense model gets MSA index branches, which then
train), and the continuation of either from its checkpoint (`resume_run`).

Every user error (missing or unreadable data, a corrupt or mismatching checkpoint, an unsupported
config, a model too large for the device, an empty corpus, a context beyond the model's
positions, a run folder that is not empty) is raised as ValueError / FileNotFoundError /
PermissionError before anything is written; checks that need the model run before the data are
prepared.  A run records its data settings and recipe in its checkpoints, so that `resume_run`
continues it with the same data order and settings.  Progress lines go to `log` (rank 0 only on
several processes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from msakit.cost import ModelShape, total_params
from msakit.distributed.launch import Parallel, is_main, rank0_first
from msakit.models import M3Config, M3ForCausalLM
from msakit.models.convert import convert_dense_to_msa, is_converted, set_selection
from msakit.models.sizes import available_memory, check_batch_fits, format_bytes
from msakit.train import checkpoint as ckpt_mod
from msakit.train.corpus import DEFAULT_LONG_MIN_TOKENS, DEFAULT_VAL_FRACTION, user_files
from msakit.train.data import Batch, PackedRows, PreparedData, encode_files, eval_batches, prepare_data
from msakit.train.folders import (MODEL_DIR, TRAIN_COMMANDS, check_context, check_new_out, check_vocab, folder_kind,
                                  load_model_folder, model_folder, new_run_dir, resume_dir, save_model_folder,
                                  tokenizer_beside)
from msakit.train.jsonl import append_metrics
from msakit.train.lora import merge_lora
from msakit.train.metrics import msa_selections
from msakit.train.tokenizer import Tokenizer
from msakit.train.trainer import METRICS_FILE, TrainConfig, Trainer, config_from_dict, read_metrics

DEFAULT_CONTEXT = 512
TRAIN_BYTES_PER_PARAM = 16  # float32 weights (4) + gradients (4) + AdamW moments (8)
HOST_BYTES_PER_PARAM = 4  # the model is built in float32 on the host before it moves to the device
DTYPES = ("float32", "bfloat16")  # weight dtypes of a conversion run

Log = Callable[[str], None]
say = functools.partial(print, flush=True)  # the default `log`


def _quiet(msg: str) -> None:
    pass


# ----------------------------------------------------------------------------- data
@dataclass
class DataOptions:
    """The data settings a run records (and a resume replays): the corpus (extra paths, the
    standard library or not), the BPE vocabulary to train (None: the tokenizer given decides),
    tokens per row (None: the run's default), the validation / long-document hold-outs and an
    optional cap on the training tokens."""

    data: list[str] = field(default_factory=list)
    stdlib: bool = True
    vocab_size: int | None = None
    context: int | None = DEFAULT_CONTEXT
    val_fraction: float = DEFAULT_VAL_FRACTION
    long_min_tokens: int = DEFAULT_LONG_MIN_TOKENS
    max_train_tokens: int | None = None

    def check(self) -> None:
        """ValueError for settings no corpus can satisfy (also for settings read from a checkpoint)."""
        if self.context is not None and self.context < 2:
            raise ValueError(f"--context must be at least 2, got {self.context}")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.max_train_tokens is not None and self.max_train_tokens < 1:
            raise ValueError("--max-train-tokens must be positive")
        if not self.stdlib and not self.data:
            raise ValueError("empty corpus: --no-stdlib given and no --data paths")
        for d in self.data:
            if not Path(d).exists():
                raise FileNotFoundError(f"--data path not found: {d}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DataOptions":
        return config_from_dict(cls, d)


def _with_context(opts: DataOptions) -> DataOptions:
    return opts if opts.context is not None else dataclasses.replace(opts, context=DEFAULT_CONTEXT)


def prepare(opts: DataOptions, *, tokenizer: Tokenizer | None = None, cache_dir: str | None = None,
            log: Log = print) -> PreparedData:
    """The corpus, tokenizer and packed rows of `opts` (`msakit.train.data.prepare_data`)."""
    opts.check()
    if opts.vocab_size is None and tokenizer is None:
        raise ValueError("no vocabulary size and no tokenizer: one of them is needed to prepare the data")
    t0 = time.time()
    kw = {} if opts.vocab_size is None else {"vocab_size": opts.vocab_size}
    pd = prepare_data(opts.data or None, stdlib=opts.stdlib, context=opts.context, tokenizer=tokenizer,
                      cache_dir=cache_dir, val_fraction=opts.val_fraction, long_min_tokens=opts.long_min_tokens,
                      max_train_tokens=opts.max_train_tokens, **kw)
    log(f"data: {pd.summary()} ({time.time() - t0:.1f}s)")
    return pd


# ----------------------------------------------------------------------------- models and their size
def model_config(preset: str | None, config_path: str | None, vocab_size: int, *, attention: str = "msa",
                 **overrides) -> M3Config:
    """The M3Config of a preset or a config.json (or its folder), at `vocab_size`; attention
    "dense": a plain GQA model without index branches (the source of a conversion)."""
    if config_path:
        p = Path(config_path)
        if not p.exists():
            raise FileNotFoundError(f"config not found: {config_path}")
        cfg = M3Config.from_pretrained(p)
        cfg = cfg.replace(vocab_size=vocab_size, **overrides)
    else:
        cfg = M3Config.preset(preset if preset is not None else "tiny", vocab_size=vocab_size, **overrides)
    if attention == "dense":
        cfg = cfg.replace(sparse_attention_freq=[0] * cfg.num_hidden_layers)
    return cfg


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a conversion run's weight dtype name (DTYPES)."""
    if name not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return getattr(torch, name)


def check_fits(n_params: int, device, *, available: Callable[[Any], int | None] = available_memory,
               bytes_per_param: int = TRAIN_BYTES_PER_PARAM) -> None:
    """ValueError when training `n_params` parameters cannot fit: `bytes_per_param` per parameter
    on `device` (default TRAIN_BYTES_PER_PARAM: float32 weights, gradients and AdamW moments;
    the weights' size alone for a frozen backbone; activations not counted) and, off the CPU, the
    float32 model on the host where it is built first."""
    dev = torch.device(device)
    why = ("weights, gradients and AdamW moments in float32" if bytes_per_param == TRAIN_BYTES_PER_PARAM
           else "the frozen weights")
    needs = [(dev, n_params * bytes_per_param, f"{why}, {bytes_per_param} bytes per parameter; activations not "
              "counted")]
    if dev.type != "cpu":
        needs.append((torch.device("cpu"), n_params * HOST_BYTES_PER_PARAM,
                      "the float32 model is built on the host first"))
    for d, need, why in needs:
        avail = available(d)
        if avail is not None and need > avail:
            raise ValueError(f"the model has {n_params / 1e9:,.1f}B parameters: training it needs at least "
                             f"{format_bytes(need)} on {d} ({why}) but {format_bytes(avail)} are available")


def config_params(cfg: M3Config) -> int:
    """Parameter count of an M3Config (msakit.cost's exact count), without building the model."""
    return int(total_params(cfg.to_shape()))


def check_folder_fits(folder: Path, device, bytes_per_param: int = TRAIN_BYTES_PER_PARAM) -> None:
    """check_fits for a model folder, counted from its config.json (when msakit.cost reads it)."""
    try:
        n = total_params(ModelShape.from_config(folder))
    except (ValueError, FileNotFoundError):
        return  # the loader reports an unreadable config
    check_fits(int(n), device, bytes_per_param=bytes_per_param)


# ----------------------------------------------------------------------------- what a run says
def summary_line(trainer: Trainer, t0: float) -> str:
    """The run's last state: step, last train loss (this session's or the log's), validation, recall."""
    ev = trainer.last_eval or {}
    hist = trainer.history
    last = hist[-1] if hist else None
    if last is None or not ev:
        recs = read_metrics(trainer.out_dir / METRICS_FILE)
        if last is None:
            last = next((r for r in reversed(recs) if r.get("kind") == "train"), None)
        if not ev:
            ev = next((r for r in reversed(recs) if r.get("kind") == "eval"), {})
    msg = f"done: step {trainer.step}"
    if last is not None and last.get("loss") is not None:
        msg += f", train loss {last['loss']:.3f}"
    elif last is not None and last.get("kl") is not None:  # only the index branch trained
        msg += f", train index KL {last['kl']:.4f}"
    if "val_loss" in ev:
        msg += f", val loss {ev['val_loss']:.3f}"
    if ev.get("recall_per_layer"):
        r = ev["recall_per_layer"]
        o = ev["oracle_per_layer"]
        msg += f", indexer recall {sum(r) / len(r):.3f} (oracle {sum(o) / len(o):.3f})"
    ck = ckpt_mod.find_checkpoint(trainer.out_dir)
    return f"{msg}; {time.time() - t0:.0f}s; checkpoint {ck}"


def model_line(trainer: Trainer) -> str:
    """The model's size and the run's plan (steps, attention, batch)."""
    n = sum(p.numel() for p in trainer.model.parameters())
    c = trainer.cfg
    dense = min(c.dense_warmup_steps, c.steps)
    params = f"{n / 1e6:.2f}M parameters"
    if c.train == "index":
        ni = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        params += f" ({ni / 1e6:.3f}M trained: the index branches; the rest frozen)"
        plan = "full attention, the index branch by the KL alone"
    elif getattr(trainer.model.config, "num_sparse_layers", None) == 0:
        plan = "full attention: no MSA layers"
    else:
        plan = f"full attention for the first {dense}, sparse for {c.steps - dense}"
    return (f"model: {params} on {trainer.device}; {c.steps} steps ({plan}), batch {c.batch_size} x "
            f"{trainer.train_rows.context} tokens")


def dense_selection_note(trainer: Trainer) -> str | None:
    """The note for a run whose sparse steps are dense in fact: every MSA layer's selection keeps
    every block of the run's context (`Selection.covers`), so "sparse" attention attends every
    key.  None when the run has no sparse steps or a selection that selects."""
    c, context = trainer.cfg, trainer.train_rows.context
    if c.train == "index" or c.dense_warmup_steps >= c.steps:
        return None
    sels = msa_selections(trainer.model)
    if not sels or not all(s.covers(context) for s in sels):
        return None
    s = sels[0]
    return (f"note: the selection (top-{s.topk} blocks of {s.block_size} = {s.keys} tokens) covers the whole "
            f"context of {context} tokens: the sparse steps attend every key, the same as dense attention; a "
            f"context longer than {s.keys} tokens (or a smaller top-k / block) makes them sparse")


def describe_run(trainer: Trainer, log: Log) -> None:
    """Say the model and the run's plan (`model_line`), and once, where it applies, that its
    sparse attention is dense (`dense_selection_note`)."""
    log(model_line(trainer))
    note = dense_selection_note(trainer)
    if note:
        log(note)


@dataclass
class RunResult:
    """A finished (or stopped) run: its trainer and, for a conversion run, the model folder saved
    at its end (weights + tokenizer: what `msakit eval --model` and `msakit generate` take)."""

    trainer: Trainer
    model_dir: Path | None = None


# ----------------------------------------------------------------------------- a new run
def train_run(out: Path, *, train: TrainConfig, data: DataOptions, preset: str | None = "tiny",
              config: str | None = None, attention: str = "msa", init: str | None = None,
              tokenizer: str | None = None, device: torch.device | str = "cpu", parallel: Parallel | None = None,
              fsdp: bool = False, activation_checkpointing: bool = False, cache_dir: str | None = None,
              progress: bool = True, log: Log = say, ready: Callable[[], None] | None = None) -> RunResult:
    """Train a model in the new (missing or empty) run folder `out`: from the weights of model
    folder `init`, or a fresh model of `preset` / `config` (a config.json or its folder) at the
    vocabulary of `tokenizer` (a tokenizer.json; default: one trained on the data at
    `data.vocab_size`).  The model is checked (context, size on `device`) before the data are
    prepared (`ready()` is called once the run folder is held); a run that fails before its first
    checkpoint leaves nothing behind."""
    t0 = time.time()
    out = Path(out)
    data = _with_context(data)
    main_rank = is_main(parallel)
    if main_rank:
        check_new_out(out)
    data.check()
    tok = Tokenizer.load(tokenizer) if tokenizer else None
    if init:
        init_dir = model_folder(Path(init))
        check_folder_fits(init_dir, device)
        model = load_model_folder(init_dir)
        if tok is None:
            tok = tokenizer_beside(Path(init))
        check_context(model.config, data.context)
    else:
        cfg0 = model_config(preset, config, tok.vocab_size if tok else data.vocab_size, attention=attention)
        check_context(cfg0, data.context)
        check_fits(config_params(cfg0), device)
    check_batch_fits(model.config if init else cfg0, train.batch_size // (parallel.dp if parallel else 1), data.context,
                     device, backward=True)
    with new_run_dir(out, "train") if main_rank else contextlib.nullcontext():
        if ready is not None:  # once the folder is held: a refused run prints its one error line alone
            ready()
        with rank0_first(parallel):  # rank 0 trains the tokenizer / fills the cache first
            pd = prepare(data, tokenizer=tok, cache_dir=cache_dir, log=log)
        tok = pd.tokenizer
        if not init:
            torch.manual_seed(train.seed)
            model = M3ForCausalLM(model_config(preset, config, tok.vocab_size, attention=attention))
        check_vocab(model, tok)
        meta = {"kind": "train", "data": data.to_dict(), "preset": preset, "config": config, "init": init,
                "long_files": [f.name for f in pd.corpus.long]}
        trainer = Trainer(model, train, pd.train, pd.val, out_dir=out, device=device, tokenizer=tok,
                          progress=progress, meta=meta, parallel=parallel, fsdp=fsdp,
                          activation_checkpointing=activation_checkpointing)
        if main_rank:
            tok.save(out)
            describe_run(trainer, log)
        trainer.fit()
    if main_rank:
        log(summary_line(trainer, t0))
    return RunResult(trainer)


# ----------------------------------------------------------------------------- a conversion run
def training_budget(time_budget: float | None, t0: float, t_val: float, log: Log) -> float | None:
    """The seconds the training loop of a run started at `t0` may take for the whole run to end
    within `time_budget` seconds: what has passed (loading, data, the first validation) and one
    more validation (`t_val` seconds: the last step's) are taken off; at least one step runs."""
    if time_budget is None:
        return None
    left = time_budget - (time.time() - t0) - t_val
    if left <= 0:
        log(f"note: --time-budget {time_budget:g}s is spent before training ({time.time() - t0:.0f}s passed, a "
            f"validation takes {t_val:.0f}s): one step")
        return 1e-9
    return left


def convert_run(source: str | Path, out: Path, *, train: TrainConfig, data: DataOptions, tokenizer: str | None = None,
                dtype: str = "float32", index_dim: int | None = None, block_size: int | None = None,
                topk: int | None = None, init_blocks: int | None = None, index_init: str = "random",
                max_tokens: int | None = None, time_budget: float | None = None, short_context: int | None = None,
                short_context_data: Sequence[str | os.PathLike] | None = None, device: torch.device | str = "cpu", parallel: Parallel | None = None, fsdp: bool = False,
                activation_checkpointing: bool = False, cache_dir: str | None = None, progress: bool = True,
                log: Log = say, ready: Callable[[], None] | None = None) -> RunResult:
    """Convert the dense model in `source` (an msakit run / checkpoint folder or an HF model
    folder) to MSA (`msakit.models.convert.convert_dense_to_msa`: index branches of `index_dim`,
    blocks of `block_size`, `topk` per query, `init_blocks` forced; None: the model's or the
    defaults) and train it in the new run folder `out` by `train` (`train.train` "index": the
    index branches alone by the KL, backbone frozen; "all": every parameter), in weights of
    `dtype` (DTYPES).  Everything is checked, and the model converted, before the run folder is held,
    `ready()` is called and the data are prepared.  Stops at `train.steps`, after `max_tokens` tokens or
    `time_budget` seconds, and saves the converted model (weights + tokenizer) in OUT/model.

    A source that is already converted (`msakit.models.convert.is_converted`: a warmed model's
    folder) is trained on as it is -- its index branches are the starting point, none is added or
    re-initialised (stage 2 of the recipe: `train.train` "all", `train.dense_warmup_steps` 0);
    `block_size` / `topk` / `init_blocks` then change its selection (`set_selection`), and
    `index_dim` or `index_init` "qk" are refused.  `train.lora_rank` > 0: the backbone trains
    through LoRA adapters, merged into OUT/model at the end.  `short_context` N: the validation
    loss over rows of N tokens (the same held-out documents, or the files and folders of
    `short_context_data`: another corpus, so that the check sees what training on this one costs
    elsewhere) is measured before and after training and reported with its relative change (a
    "short_context" record in metrics.jsonl)."""
    t0 = time.time()
    out = Path(out)
    main_rank = is_main(parallel)
    if train.train == "index" and parallel is not None:
        raise ValueError("--train index runs in one process (no torchrun, --cp or --fsdp yet)")
    if main_rank:
        check_new_out(out)
    folder = model_folder(Path(source))
    if folder_kind(folder) == "drafter":
        raise ValueError(f"{source} is a DSpark drafter, not a model to convert")
    tok = Tokenizer.load(tokenizer) if tokenizer else tokenizer_beside(Path(source))
    data = dataclasses.replace(_with_context(data), vocab_size=tok.vocab_size)
    data.check()
    torch_dt = torch_dtype(dtype)
    check_folder_fits(folder, device, torch_dt.itemsize if train.train == "index" else TRAIN_BYTES_PER_PARAM)
    if short_context is not None and not 2 <= short_context <= data.context:
        raise ValueError(f"--short-context must be between 2 and --context {data.context}, got {short_context}")
    if short_context_data and short_context is None:
        raise ValueError("--short-context-data needs --short-context N (the row length to measure)")
    short_files = user_files(short_context_data) if short_context_data else None  # missing paths fail here
    src = load_model_folder(folder, dtype=torch_dt)
    warmed = is_converted(src)
    if warmed:  # stage 2 (or a longer warm-up): the model's own index branches go on training
        if index_dim is not None or index_init != "random":
            raise ValueError(f"{source} is already an MSA model: its index branches are the starting point "
                             "(--index-dim and --index-init apply to a dense source)")
        model = src
        if (block_size, topk, init_blocks) != (None, None, None):
            set_selection(model, block_size=block_size, topk=topk, init_blocks=init_blocks)
        model.set_attention_mode("dense")
    else:
        model = convert_dense_to_msa(src, index_head_dim=index_dim, block_size=block_size, topk=topk,
                                     init_blocks=init_blocks, index_init=index_init, seed=train.seed)
    check_context(model.config, data.context)
    check_vocab(model, tok)
    check_batch_fits(model.config, train.batch_size // (parallel.dp if parallel else 1), data.context, device,
                     backward=True)
    if train.compile and not isinstance(model, M3ForCausalLM):
        raise ValueError("--compile compiles msakit's decoder layers; a converted HF model has none "
                         "(train it without --compile)")
    say_ = log if main_rank else _quiet
    with new_run_dir(out, "convert") if main_rank else contextlib.nullcontext():
        if ready is not None:  # once the folder is held: a refused run prints its one error line alone
            ready()
        with rank0_first(parallel):  # rank 0 fills the data cache first
            pd = prepare(data, tokenizer=tok, cache_dir=cache_dir, log=log)
        meta = {"kind": "convert", "data": data.to_dict(), "source": str(source), "dtype": dtype,
                "index_init": "warmed" if warmed else index_init, "long_files": [f.name for f in pd.corpus.long]}
        trainer = Trainer(model, train, pd.train, pd.val, out_dir=out, device=device, tokenizer=tok,
                          progress=progress, meta=meta, eval_both_modes=True, parallel=parallel, fsdp=fsdp,
                          activation_checkpointing=activation_checkpointing)
        if main_rank:
            tok.save(out)
        short = None
        if short_context is not None:
            stream = pd.val.stream if short_files is None else encode_files(
                tok, short_files, max_tokens=short_context * train.eval_rows, cache_dir=cache_dir)
            if len(stream) == 0:
                raise ValueError(f"--short-context-data: no tokens in {', '.join(map(str, short_context_data))}")
            short = eval_batches(PackedRows(stream, short_context, pd.val.pad_id), train.batch_size, train.eval_rows)
        short_before = short_losses(trainer, short)
        t_val = time.time()
        before_d = trainer.evaluate(mode="dense", recall_rows=0, compute_kl=False)["loss"]
        before_s = trainer.evaluate(mode="sparse", recall_rows=0, compute_kl=False)["loss"]
        t_val = time.time() - t_val
        if train.train == "index":
            over = "every causal token" if train.kl_tokens == "all" else "the selected tokens"
            plan = f"index-branch warm-up (backbone frozen, full attention, KL over {over}) for {train.steps} steps"
        else:
            plan = f"indexer warm-up (dense) for {train.dense_warmup_steps} steps, then sparse to step {train.steps}"
        if train.lora_rank:
            plan += f", the backbone through LoRA of rank {train.lora_rank}"
        what = (f"continuing the MSA model {folder} (its own index branches): validation loss dense {before_d:.3f}, "
                f"sparse {before_s:.3f}" if warmed else
                f"converted {folder}: validation loss dense {before_d:.3f}, sparse with the untrained indexer "
                f"{before_s:.3f}")
        say_(f"{what}; {plan}")
        describe_run(trainer, say_)
        trainer.fit(max_tokens=max_tokens, budget_s=training_budget(time_budget, t0, t_val, say_))
    ev = trainer.last_eval or {}
    if ev.get("step") == trainer.step and "val_loss_dense" in ev and "val_loss_sparse" in ev:
        after_d, after_s = ev["val_loss_dense"], ev["val_loss_sparse"]
    else:
        after_d = trainer.evaluate(mode="dense", recall_rows=0, compute_kl=False)["loss"]
        after_s = trainer.evaluate(mode="sparse", recall_rows=0, compute_kl=False)["loss"]
    say_(f"after conversion: validation loss dense {after_d:.3f}, sparse {after_s:.3f}")
    if short is not None:
        rec = short_context_record(trainer.step, short_context, short, short_before, short_losses(trainer, short))
        rec["data"] = "validation files" if short_files is None else [str(p) for p in short_context_data]
        if main_rank:
            append_metrics(out, rec)
        say_(short_context_line(rec))
    say_(summary_line(trainer, t0))
    if merge_lora(trainer.model):
        say_(f"merged the LoRA adapters (rank {train.lora_rank}) into the backbone")
    mdir = save_model_folder(trainer.model, tok, out / MODEL_DIR) if main_rank else None
    return RunResult(trainer, mdir)


# ----------------------------------------------------------------------------- short-context quality
SHORT_CONTEXT_BAR = 0.5  # the recipe's bar: stage 2 raises the short-context loss by at most this many percent


def short_losses(trainer: Trainer, batches: list[Batch] | None) -> dict[str, float] | None:
    """The validation loss over `batches` (short rows) in dense and in sparse mode (None: no batches)."""
    if batches is None:
        return None
    return {m: trainer.evaluate(mode=m, batches=batches, recall_rows=0, compute_kl=False)["loss"]
            for m in ("dense", "sparse")}


def short_context_record(step: int, context: int, batches: list[Batch], before: dict[str, float],
                         after: dict[str, float]) -> dict:
    """The metrics record of the short-context check at `step`: the losses over `batches` (rows
    of `context` tokens) before and after the run and the relative change of each (percent; the
    recipe's bar `SHORT_CONTEXT_BAR` on the sparse one)."""
    change = {m: 100.0 * (after[m] - before[m]) / before[m] for m in before}
    return {"kind": "short_context", "step": step, "context": context,
            "rows": sum(int(b.input_ids.shape[0]) for b in batches), "before": before, "after": after, "change_pct": change, "bar_pct": SHORT_CONTEXT_BAR,
            "within_bar": change["sparse"] <= SHORT_CONTEXT_BAR}


def short_context_line(rec: dict) -> str:
    """One line of a short-context record."""
    b, a, c = rec["before"], rec["after"], rec["change_pct"]
    verdict = "within" if rec["within_bar"] else "OVER"
    data = rec.get("data", "validation files")
    what = "validation loss" if data == "validation files" else f"loss on {', '.join(data)}"
    return (f"short-context {what} ({rec['context']} tokens): sparse {b['sparse']:.4f} -> {a['sparse']:.4f} "
            f"({c['sparse']:+.2f}%, {verdict} the bar of +{rec['bar_pct']}%), dense {b['dense']:.4f} -> "
            f"{a['dense']:.4f} ({c['dense']:+.2f}%)")


# ----------------------------------------------------------------------------- resuming
def open_resume(out: Path, checkpoint: Path | None, parse_config: Callable[[dict], Any], *, steps: int | None = None,
                drafter: bool = False, log: Log = say) -> tuple[Path, dict, Any] | None:
    """The checkpoint to continue a run from (`checkpoint`, or run folder `out`'s latest;
    verified), its trainer state and its config (by `parse_config`) with `steps` applied; None,
    after saying so, when the run has already reached its steps.  A drafter checkpoint is refused
    unless `drafter`, and the other way round.  The caller holds `out` (`msakit.train.folders.
    resume_dir`: the run's own folder, or a new or empty one for another folder's checkpoint)."""
    ck = ckpt_mod.resolve_checkpoint(out if checkpoint is None else checkpoint)
    state, _, _, _ = ckpt_mod.load_checkpoint_state(ck)  # verifies the manifest
    is_drafter = state.get("kind") == "dspark-drafter"
    if is_drafter != drafter:
        raise ckpt_mod.CheckpointError(f"{ck} is a drafter checkpoint; resume it with `msakit train-drafter --resume`"
                                       if is_drafter else f"{ck} is not a drafter checkpoint")
    cfg = parse_config(state["config"])
    step = int(state["step"])
    if steps is not None:
        if steps < step:
            raise ValueError(f"--steps {steps} is below the checkpoint's step {step}")
        cfg.steps = steps
    if step >= cfg.steps:
        log(f"nothing to train: {ck} is at step {step} of {cfg.steps}; pass --steps N (N > {step}) to train "
            "further")
        return None
    return ck, state, cfg


def resume_run(out: Path, *, checkpoint: Path | None = None, steps: int | None = None,
               device: torch.device | str = "cpu", compile: bool = False, activation_checkpointing: bool = False,
               max_tokens: int | None = None, time_budget: float | None = None, cache_dir: str | None = None,
               progress: bool = True, log: Log = say, command: str = "train", parallel: Parallel | None = None,
               fsdp: bool = False) -> RunResult | None:
    """Continue a training or conversion run from `checkpoint` (default: run folder `out`'s
    latest, single-file or sharded) with its recorded data order and settings, to `steps`
    (default: its own); how it runs (`device`, `compile`, `activation_checkpointing`,
    `max_tokens`, `time_budget`, the processes of `parallel` and `fsdp`) may change: a sharded
    checkpoint resumes on any number of processes (DCP reshards it).  None when the run has
    already reached its steps.  A conversion run saves its model in OUT/model again at the end.
    `out` is held for `command` by the main process (its marker must name a training or
    conversion run, `TRAIN_COMMANDS`) while the run continues."""
    out = Path(out)
    hold = resume_dir(out, checkpoint, command, TRAIN_COMMANDS) if is_main(parallel) else contextlib.nullcontext()
    with hold:
        return _resume_run(out, checkpoint=checkpoint, steps=steps, device=device, compile=compile,
                           activation_checkpointing=activation_checkpointing, max_tokens=max_tokens,
                           time_budget=time_budget, cache_dir=cache_dir, progress=progress, log=log,
                           parallel=parallel, fsdp=fsdp)


def _resume_run(out: Path, *, checkpoint: Path | None, steps: int | None, device: torch.device | str, compile: bool,
                activation_checkpointing: bool, max_tokens: int | None, time_budget: float | None,
                cache_dir: str | None, progress: bool, log: Log, parallel: Parallel | None,
                fsdp: bool) -> RunResult | None:
    t0 = time.time()
    main_rank = is_main(parallel)
    log = log if main_rank else _quiet
    point = open_resume(out, checkpoint, TrainConfig.from_dict, steps=steps, log=log)
    if point is None:
        return None
    ck, state, cfg = point
    if compile:  # how the run executes, not what it trains
        cfg = dataclasses.replace(cfg, compile=True)
    meta = state.get("meta", {})
    if not meta.get("data"):
        raise ckpt_mod.CheckpointError(f"{ck} does not record its data settings; cannot resume")
    tok = Tokenizer.load(ck)
    with rank0_first(parallel):  # rank 0 fills the data cache first
        pd = prepare(DataOptions.from_dict(meta["data"]), tokenizer=tok, cache_dir=cache_dir, log=log)
    model = load_model_folder(ck, dtype=torch_dtype(meta.get("dtype", "float32")))
    conversion = meta.get("kind") == "convert"
    trainer = Trainer(model, cfg, pd.train, pd.val, out_dir=out, device=device, tokenizer=tok,
                      progress=progress, meta=meta, eval_both_modes=conversion, parallel=parallel, fsdp=fsdp,
                      activation_checkpointing=activation_checkpointing)
    trainer.resume(ck, load_weights=lambda _: None)
    if main_rank and not (out / "tokenizer.json").is_file():
        tok.save(out)
    log(f"resumed {ck} at step {trainer.step}")
    describe_run(trainer, log)
    trainer.fit(max_tokens=max_tokens, budget_s=training_budget(time_budget, t0, 0.0, log))
    log(summary_line(trainer, t0))
    mdir = save_model_folder(trainer.model, tok, out / MODEL_DIR) if conversion and main_rank else None
    return RunResult(trainer, mdir)
