"""What `msakit train`, `msakit convert` and `msakit generate` do (argument groups + entry points).

Every user error (a bad option value, missing or unreadable data, a corrupt or mismatching
checkpoint, an unsupported config, a model too large for the device, an empty corpus, a context
beyond the model's positions, an output folder that is not empty) is raised as ValueError /
FileNotFoundError / PermissionError before anything is written, so the CLI prints one line and
exits with status 2 and nothing is overwritten.  Option values are checked when the command line
is parsed (`Number`, `DEVICE`); checks that need the model or the checkpoint run before the data
are prepared.  A value the user gave is used or refused, never replaced by a default.

A fresh run writes only into an empty or new ``--out`` (`new_run_dir`); when it fails or is
interrupted before its first complete checkpoint, what it wrote is removed again, so the same
command can simply be run again.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from msakit.train.corpus import DEFAULT_LONG_MIN_TOKENS, DEFAULT_VAL_FRACTION

DEFAULT_CONTEXT = 512
TRAIN_BYTES_PER_PARAM = 16  # float32 weights (4) + gradients (4) + AdamW moments (8)
HOST_BYTES_PER_PARAM = 4  # the model is built in float32 on the host before it moves to the device


# ----------------------------------------------------------------------------- option types
class Number:
    """An argparse ``type``: a finite int or float within bounds, refused at parse time
    (argparse prints one line and exits with status 2).  ``lo`` / ``hi`` are inclusive unless
    ``lo_open`` / ``hi_open``."""

    def __init__(self, kind: type, lo: float | None = None, hi: float | None = None, *,
                 lo_open: bool = False, hi_open: bool = False) -> None:
        if kind not in (int, float):
            raise ValueError(f"kind must be int or float, got {kind!r}")
        self.kind, self.lo, self.hi, self.lo_open, self.hi_open = kind, lo, hi, lo_open, hi_open
        self.__name__ = kind.__name__  # what argparse calls the type in its messages

    def describe(self) -> str:
        what = "an integer" if self.kind is int else "a number"
        if self.lo is not None and self.hi is not None:
            return f"{what} in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{what} {'>' if self.lo_open else '>='} {self.lo:g}"
        if self.hi is not None:
            return f"{what} {'<' if self.hi_open else '<='} {self.hi:g}"
        return f"a finite {'integer' if self.kind is int else 'number'}"

    def __call__(self, text: str) -> int | float:
        try:
            v = self.kind(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected {self.describe()}, got {text!r}") from None
        ok = math.isfinite(v)
        if ok and self.lo is not None:
            ok = v > self.lo if self.lo_open else v >= self.lo
        if ok and self.hi is not None:
            ok = v < self.hi if self.hi_open else v <= self.hi
        if not ok:
            raise argparse.ArgumentTypeError(f"expected {self.describe()}, got {text!r}")
        return v

    def invalid_examples(self) -> list[str]:
        """Values this type refuses (for tests): not a number, NaN / inf, just outside each bound."""
        out = ["x"] + (["nan", "inf", "-inf"] if self.kind is float else ["1.5"])
        step = 1 if self.kind is int else 1e-3
        if self.lo is not None:
            out.append(repr(self.kind(self.lo)) if self.lo_open else repr(self.kind(self.lo - step)))
        if self.hi is not None:
            out.append(repr(self.kind(self.hi)) if self.hi_open else repr(self.kind(self.hi + step)))
        return out

    def __repr__(self) -> str:
        return f"Number({self.describe()})"


POS_INT = Number(int, 1)
NONNEG_INT = Number(int, 0)
SEED = Number(int, 0, 2**63 - 1)
POS_FLOAT = Number(float, 0, lo_open=True)
NONNEG_FLOAT = Number(float, 0)


class DeviceArg:
    """An argparse ``type`` for ``--device``: auto, cpu, cuda or cuda:N (refused at parse time
    otherwise; CUDA's availability is checked when the command starts)."""

    __name__ = "device"
    _PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")

    def __call__(self, text: str) -> str:
        if not self._PATTERN.fullmatch(text):
            raise argparse.ArgumentTypeError(f"expected cpu, cuda, cuda:N or auto, got {text!r}")
        return text

    def invalid_examples(self) -> list[str]:
        return ["tpu", "cuda:x", "gpu"]


DEVICE = DeviceArg()


def add_device_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", type=DEVICE, default="auto", help="cpu, cuda, cuda:N or auto (cuda when available)")


# ----------------------------------------------------------------------------- argument groups
def add_data_args(p: argparse.ArgumentParser, *, vocab: bool = True) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data", nargs="+", metavar="PATH", default=None,
                   help="extra files or folders for the corpus (beside the standard library's sources)")
    g.add_argument("--no-stdlib", action="store_true", help="leave Python's standard library out of the corpus")
    if vocab:
        g.add_argument("--vocab-size", type=Number(int, 257), default=4096, metavar="N", help="BPE vocabulary size")
    g.add_argument("--tokenizer", metavar="PATH", help="use this tokenizer.json instead of training one")
    g.add_argument("--context", type=Number(int, 2), default=None, metavar="N",
                   help=f"tokens per row (default {DEFAULT_CONTEXT}, at most the model's max_position_embeddings)")
    g.add_argument("--val-fraction", type=Number(float, 0, 1, hi_open=True), default=DEFAULT_VAL_FRACTION,
                   metavar="F", help="share of files (by path hash) held out for validation")
    g.add_argument("--long-min-tokens", type=NONNEG_INT, default=DEFAULT_LONG_MIN_TOKENS, metavar="N",
                   help="files with at least N tokens are held out for long-context evaluation (0: none)")
    g.add_argument("--max-train-tokens", type=POS_INT, default=None, metavar="N",
                   help="encode only the first N training tokens (of the hash-shuffled files; default all)")
    g.add_argument("--cache-dir", metavar="DIR", help="tokenizer / token cache (default $MSAKIT_CACHE or ~/.cache/msakit)")


def add_optim_args(p: argparse.ArgumentParser, **defaults: Any) -> None:
    d = {**_OPTIM_DEFAULTS, **defaults}
    p.set_defaults(optim_defaults=d)
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=POS_INT, default=None, metavar="N", help=f"optimizer steps (default {d['steps']})")
    g.add_argument("--batch-size", type=POS_INT, default=d["batch_size"], metavar="N", help="rows per step")
    g.add_argument("--lr", type=POS_FLOAT, default=d["lr"], help="peak learning rate (AdamW)")
    g.add_argument("--min-lr-ratio", type=Number(float, 0, 1), default=0.1, metavar="F",
                   help="final lr / peak lr (cosine)")
    g.add_argument("--lr-warmup-steps", type=NONNEG_INT, default=None, metavar="N",
                   help=f"linear lr warm-up (default {d['lr_warmup_steps']}, scaled down for runs shorter than "
                        f"{d['steps']} steps)")
    g.add_argument("--warmup-steps", type=NONNEG_INT, default=None, metavar="N",
                   help=f"full-attention warm-up steps before sparse attention is switched on (default "
                        f"{d['dense_warmup_steps']}, scaled down for runs shorter than {d['steps']} steps)")
    g.add_argument("--kl-coef", type=NONNEG_FLOAT, default=1.0, metavar="LAMBDA", help="weight of the indexer KL terms")
    g.add_argument("--kl-every", type=POS_INT, default=d["kl_every"], metavar="N",
                   help="compute the indexer KL every N-th step (1 = always; larger saves CPU time)")
    g.add_argument("--routing-bias-rate", type=NONNEG_FLOAT, default=1e-3, metavar="R", help="MoE balancing bias step")
    g.add_argument("--grad-clip", type=NONNEG_FLOAT, default=1.0, help="gradient-norm clip (0 = no clipping)")
    g.add_argument("--weight-decay", type=NONNEG_FLOAT, default=0.1, help="AdamW weight decay of the matrices")
    g.add_argument("--log-every", type=POS_INT, default=10, metavar="N", help="steps per metrics.jsonl record")
    g.add_argument("--eval-every", type=POS_INT, default=d["eval_every"], metavar="N", help="steps per evaluation")
    g.add_argument("--eval-rows", type=NONNEG_INT, default=d["eval_rows"], metavar="N",
                   help="validation rows per evaluation (0 = no evaluation)")
    g.add_argument("--save-every", type=POS_INT, default=d["save_every"], metavar="N", help="steps per checkpoint")
    g.add_argument("--keep", type=NONNEG_INT, default=2, metavar="N", help="checkpoints kept (0 = keep all)")
    g.add_argument("--seed", type=SEED, default=0, help="seed of the initialisation and the data order")
    g.add_argument("--doc-attention", action="store_true",
                   help="keep attention inside documents (packed rows through the cu_seqlens path)")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each decoder layer (the first steps compile; evaluation stays eager)")
    add_device_arg(g)
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


_OPTIM_DEFAULTS = dict(steps=1000, batch_size=8, lr=3e-3, lr_warmup_steps=20, dense_warmup_steps=300, kl_every=1,
                       eval_every=100, save_every=200, eval_rows=32)


def _scaled(default: int, steps: int, default_steps: int) -> int:
    """A warm-up default for a run of `steps` steps: kept for runs at least `default_steps` long,
    scaled in proportion below (at least 1 step when the default is not 0)."""
    if steps >= default_steps or default == 0:
        return default
    return max(1, round(default * steps / default_steps))


def _n(k: int, noun: str) -> str:
    return f"{k} {noun}{'' if k == 1 else 's'}"


def optim_config(args: argparse.Namespace, warn: Callable[[str], None] | None = None):
    """The TrainConfig the options ask for.  Defaults of the two warm-ups are scaled to a short
    run (so that a 10-step run still reaches sparse attention) and said so; a warm-up the user
    gave is used as given, with a warning when it covers the whole run."""
    from msakit.train.trainer import TrainConfig

    d = args.optim_defaults
    warn = warn or (lambda msg: print(f"msakit {getattr(args, 'command', '')}: note: {msg}", file=sys.stderr))
    train = getattr(args, "train", "all")
    max_tokens = getattr(args, "max_tokens", None)
    steps = args.steps if args.steps is not None else d["steps"]
    if args.steps is None and max_tokens is not None:  # the schedule spans the token budget
        per_step = args.batch_size * (args.context if args.context is not None else DEFAULT_CONTEXT)
        steps = -(-max_tokens // per_step)
        warn(f"--max-tokens {max_tokens} without --steps: {_n(steps, 'step')} of {per_step} tokens")
    scaled = []
    if train == "index":  # the whole run is the dense warm-up of the index branch
        warm = steps
    elif args.warmup_steps is not None:
        warm = args.warmup_steps
        if warm >= steps:
            warn(f"--warmup-steps {warm} >= {steps} steps: the run never switches to sparse attention")
    else:
        warm = _scaled(d["dense_warmup_steps"], steps, d["steps"])
        if warm != d["dense_warmup_steps"]:
            scaled.append(f"full attention for {_n(warm, 'step')} (--warmup-steps)")
    if args.lr_warmup_steps is not None:
        lr_warm = args.lr_warmup_steps
        if lr_warm > steps:
            warn(f"--lr-warmup-steps {lr_warm} > {steps} steps: the learning rate never reaches --lr")
    else:
        lr_warm = _scaled(d["lr_warmup_steps"], steps, d["steps"])
        if lr_warm != d["lr_warmup_steps"]:
            scaled.append(f"lr warm-up {_n(lr_warm, 'step')} (--lr-warmup-steps)")
    if scaled:
        warn(f"{steps} steps (< {d['steps']}): default warm-ups scaled to the run: {', '.join(scaled)}")
    return TrainConfig(
        steps=steps, batch_size=args.batch_size, lr=args.lr, min_lr_ratio=args.min_lr_ratio,
        lr_warmup_steps=lr_warm, weight_decay=args.weight_decay, grad_clip=args.grad_clip,
        kl_coef=args.kl_coef, kl_every=args.kl_every, dense_warmup_steps=warm, routing_bias_rate=args.routing_bias_rate,
        log_every=args.log_every, eval_every=args.eval_every, eval_rows=args.eval_rows, save_every=args.save_every,
        keep_checkpoints=args.keep, seed=args.seed, doc_attention=args.doc_attention,
        compile=bool(getattr(args, "compile", False)),
        train=train, index_lr=getattr(args, "index_lr", None), kl_tokens=getattr(args, "kl_tokens", "selected"),
    )


def data_options(args: argparse.Namespace, context: int) -> dict:
    """The data settings a run records (and a resume replays)."""
    return {
        "data": [str(Path(d)) for d in (args.data or [])],
        "stdlib": not args.no_stdlib,
        "vocab_size": getattr(args, "vocab_size", None),
        "context": context,
        "val_fraction": args.val_fraction,
        "long_min_tokens": args.long_min_tokens,
        "max_train_tokens": args.max_train_tokens,
    }


def check_data_options(opts: dict) -> None:
    """ValueError for data settings no corpus can satisfy (also for settings read from a checkpoint)."""
    if opts["context"] is not None and opts["context"] < 2:
        raise ValueError(f"--context must be at least 2, got {opts['context']}")
    if not 0 <= opts["val_fraction"] < 1:
        raise ValueError(f"--val-fraction must be in [0, 1), got {opts['val_fraction']}")
    if opts["max_train_tokens"] is not None and opts["max_train_tokens"] < 1:
        raise ValueError("--max-train-tokens must be positive")
    if not opts["stdlib"] and not opts["data"]:
        raise ValueError("empty corpus: --no-stdlib given and no --data paths")
    for d in opts["data"]:
        if not Path(d).exists():
            raise FileNotFoundError(f"--data path not found: {d}")


def prepare(opts: dict, *, tokenizer=None, cache_dir=None, log=print):
    from msakit.train.data import prepare_data

    check_data_options(opts)
    if opts["vocab_size"] is None and tokenizer is None:
        raise ValueError("no vocabulary size and no tokenizer: one of them is needed to prepare the data")
    t0 = time.time()
    kw = {} if opts["vocab_size"] is None else {"vocab_size": opts["vocab_size"]}
    pd = prepare_data(opts["data"] or None, stdlib=opts["stdlib"], context=opts["context"], tokenizer=tokenizer,
                      cache_dir=cache_dir, val_fraction=opts["val_fraction"], long_min_tokens=opts["long_min_tokens"],
                      max_train_tokens=opts["max_train_tokens"], **kw)
    log(f"data: {pd.summary()} ({time.time() - t0:.1f}s)")
    return pd


# ----------------------------------------------------------------------------- run folders
def holds_checkpoint(out: Path) -> bool:
    """Whether run folder `out` holds a checkpoint: a complete one under checkpoints/, or any
    sharded (multi-rank) one."""
    from msakit.train import checkpoint as ckpt_mod
    from msakit.train import trainer as trainer_mod

    sharded = out / getattr(trainer_mod, "SHARDED_DIR", "sharded")
    return ckpt_mod.find_checkpoint(out) is not None or (sharded.is_dir() and any(sharded.iterdir()))


def check_new_out(out: Path, what: str = "run") -> None:
    """ValueError unless `out` is missing or an empty folder (nothing is ever overwritten)."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a folder")
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return
    if holds_checkpoint(out):
        raise ValueError(f"{out} already holds a {what}; pass --resume to continue it or choose another --out")
    n = f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}"
    raise ValueError(f"--out {out} is not empty ({n}, e.g. {entries[0]!r}) and holds no complete "
                     "checkpoint to resume; choose another --out or empty it")


def first_missing_ancestor(path: Path) -> Path | None:
    """The topmost of `path` and its parents that does not exist (what creating `path` creates)."""
    p = Path(os.path.abspath(path))
    top = None
    while not p.exists():
        top = p
        if p.parent == p:
            break
        p = p.parent
    return top


def remove_created(out: Path, created: Path | None) -> None:
    """Undo a fresh run's writes: remove `created` (the folders the run created) or, when `out`
    already existed (empty), everything inside it."""
    if created is not None:
        shutil.rmtree(created, ignore_errors=True)
    elif out.is_dir():
        for e in out.iterdir():
            if e.is_dir() and not e.is_symlink():
                shutil.rmtree(e, ignore_errors=True)
            else:
                e.unlink(missing_ok=True)


@contextmanager
def new_run_dir(out: Path, what: str = "run") -> Iterator[None]:
    """A fresh run in `out` (refused unless missing or empty); when the body fails or is
    interrupted before a checkpoint exists, everything the run wrote is removed."""
    check_new_out(out, what)
    created = first_missing_ancestor(out)
    try:
        yield
    except BaseException:
        if not holds_checkpoint(out):
            remove_created(out, created)
        raise


def run_folder_of(ckpt: Path) -> Path:
    """The run folder a checkpoint lies in (``RUN/checkpoints/step-N`` -> RUN), else its folder."""
    from msakit.train.checkpoint import CKPT_DIR

    ck = Path(ckpt)
    return ck.parent.parent if ck.parent.name == CKPT_DIR else ck.parent


# what may change when a run is resumed: where and how it runs (not what it trains)
RESUME_OPTIONS = frozenset({"out", "resume", "steps", "device", "no_progress", "cache_dir",
                            "cp", "fsdp", "activation_checkpointing", "max_tokens", "time_budget", "compile"})


def check_resume_options(args: argparse.Namespace, allowed: frozenset = RESUME_OPTIONS) -> None:
    """With --resume the run's recorded settings apply: refuse options that would be ignored."""
    given = sorted(set(getattr(args, "given", ())) - allowed)
    if given:
        names = ", ".join("--" + g.replace("_", "-") for g in given)
        ok = ", ".join("--" + g.replace("_", "-") for g in sorted(allowed) if hasattr(args, g))
        raise ValueError(f"{names}: a resumed run keeps the settings recorded in its checkpoint; with --resume only "
                         f"{ok} apply")


# ----------------------------------------------------------------------------- model helpers
def check_context(model_config: Any, context: int) -> None:
    maxpos = getattr(model_config, "max_position_embeddings", None)
    if maxpos is not None and context > int(maxpos):
        raise ValueError(f"context {context} is longer than the model's max_position_embeddings ({maxpos})")


def model_config(preset: str | None, config_path: str | None, vocab_size: int, *, attention: str = "msa", **overrides):
    from msakit.models import M3Config

    if config_path:
        p = Path(config_path)
        if not p.exists():
            raise FileNotFoundError(f"config not found: {config_path}")
        cfg = M3Config.from_pretrained(p)
        cfg = cfg.replace(vocab_size=vocab_size, **overrides)
    else:
        cfg = M3Config.preset(preset if preset is not None else "tiny", vocab_size=vocab_size, **overrides)
    if attention == "dense":  # a plain GQA model (no index branch): the source for `msakit convert`
        cfg = cfg.replace(sparse_attention_freq=[0] * cfg.num_hidden_layers)
    return cfg


def available_memory(device) -> int | None:
    """Free bytes on `device`: CUDA's free memory, the host's MemAvailable; None if unknown."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return int(free)
    if dev.type != "cpu":
        return None
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def _gb(n: float) -> str:
    return f"{n / 1e12:,.2f} TB" if n >= 1e12 else f"{n / 1e9:,.2f} GB"


def check_fits(n_params: int, device, *, available: Callable[[Any], int | None] = available_memory,
               bytes_per_param: int = TRAIN_BYTES_PER_PARAM) -> None:
    """ValueError when training `n_params` parameters cannot fit: `bytes_per_param` per parameter
    on `device` (default TRAIN_BYTES_PER_PARAM: float32 weights, gradients and AdamW moments;
    the weights' size alone for a frozen backbone; activations not counted) and, off the CPU, the
    float32 model on the host where it is built first."""
    import torch

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
                             f"{_gb(need)} on {d} ({why}) but {_gb(avail)} are available")


def config_params(cfg) -> int:
    """Parameter count of an M3Config (msakit.cost's exact count), without building the model."""
    from msakit.cost import total_params

    return int(total_params(cfg.to_shape()))


def load_model_folder(folder: Path, device=None, dtype=None):
    """Any model folder msakit can train: an M3 checkpoint, a converted (wrapped) HF model
    (weights in `dtype`, a torch dtype; default the loader's)."""
    from msakit.models.convert import load_for_conversion
    from msakit.train import checkpoint as ckpt_mod

    try:
        return load_for_conversion(folder, device=device, dtype=dtype)
    except (ValueError, FileNotFoundError):
        raise
    except Exception as e:  # safetensors / transformers errors on a damaged folder
        raise ckpt_mod.CheckpointError(f"cannot load the model in {folder}: {str(e).splitlines()[0]}") from None


def folder_kind(folder: Path) -> str:
    """What a model folder holds, from its config.json: "drafter" (a DSpark drafter), "hf-dense"
    (an HF model without MSA index branches) or "model" (anything else msakit loads)."""
    from msakit.models.convert import HF_MODEL_TYPES

    try:
        raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return "model"  # the loader reports the problem
    if not isinstance(raw, dict):
        return "model"
    text = raw.get("text_config", raw)
    if isinstance(text, dict) and any(str(k).startswith("dspark_") for k in text):
        return "drafter"
    if raw.get("model_type") in HF_MODEL_TYPES:  # a saved MSA model says "msakit_<family>"
        return "hf-dense"
    return "model"


def summary_line(trainer, t0: float) -> str:
    """The run's last state: step, last train loss (this session's or the log's), validation, recall."""
    from msakit.train import checkpoint as ckpt_mod
    from msakit.train.trainer import METRICS_FILE, read_metrics

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


# ----------------------------------------------------------------------------- msakit train
def start_processes(args: argparse.Namespace, command: str):
    """(parallel or None, device, is this rank 0) of a train / convert run: joins torchrun's
    process group when the environment names one and checks --cp and the batch against it.
    Refuses --resume on several processes."""
    from msakit.distributed.args import is_main, setup_distributed
    from msakit.train.trainer import resolve_device

    parallel = setup_distributed(args)
    if parallel is not None and args.resume:
        raise ValueError(f"--resume of a run on several processes is not supported by `msakit {command}` yet: "
                         "resume it with msakit.distributed.checkpoint.load_sharded")
    device = parallel.env.device if parallel is not None else resolve_device(args.device)
    return parallel, device, is_main(parallel)


def run_train(args: argparse.Namespace) -> int:
    import torch

    from msakit.distributed.args import rank0_first, trainer_kwargs
    from msakit.train.tokenizer import Tokenizer
    from msakit.train.trainer import Trainer

    t0 = time.time()
    out = Path(args.out)
    parallel, device, main_rank = start_processes(args, "train")
    if args.resume:
        return resume_run(args, device)
    if main_rank:
        check_new_out(out)
    given = set(getattr(args, "given", ()))
    if args.init and given & {"preset", "config", "attention"}:
        raise ValueError("--init takes the model (and its architecture) from its folder: --preset, --config and "
                         "--attention do not apply")
    if args.tokenizer and "vocab_size" in given:
        raise ValueError("--tokenizer gives the vocabulary: --vocab-size does not apply")
    context = args.context if args.context is not None else DEFAULT_CONTEXT
    opts = data_options(args, context)
    check_data_options(opts)
    cfg = optim_config(args)
    tok = Tokenizer.load(args.tokenizer) if args.tokenizer else None
    # the model: validated (config, context, size) before the (slower) data preparation
    if args.init:
        init = model_folder(Path(args.init))
        _check_folder_fits(init, device)
        model = load_model_folder(init)
        if tok is None:
            tok = tokenizer_beside(Path(args.init))
        check_context(model.config, opts["context"])
    else:
        cfg0 = model_config(args.preset, args.config, tok.vocab_size if tok else args.vocab_size,
                            attention=args.attention)
        check_context(cfg0, opts["context"])
        check_fits(config_params(cfg0), device)
    with new_run_dir(out) if main_rank else contextlib.nullcontext():
        with rank0_first(parallel):  # rank 0 trains the tokenizer / fills the cache first
            pd = prepare(opts, tokenizer=tok, cache_dir=args.cache_dir)
        tok = pd.tokenizer
        if not args.init:
            mcfg = model_config(args.preset, args.config, tok.vocab_size, attention=args.attention)
            from msakit.models import M3ForCausalLM

            torch.manual_seed(args.seed)
            model = M3ForCausalLM(mcfg)
        check_vocab(model, tok)
        meta = {"kind": "train", "data": opts, "preset": args.preset, "config": args.config, "init": args.init,
                "long_files": [f.name for f in pd.corpus.long]}
        trainer = Trainer(model, cfg, pd.train, pd.val, out_dir=out, device=device, tokenizer=tok,
                          progress=not args.no_progress, meta=meta, **trainer_kwargs(args, parallel))
        if main_rank:
            tok.save(out)
            _print_model_line(trainer)
        trainer.fit()
    if main_rank:
        print(summary_line(trainer, t0))
    return 0


def _check_folder_fits(folder: Path, device, bytes_per_param: int = TRAIN_BYTES_PER_PARAM) -> None:
    """check_fits for a model folder, counted from its config.json (when msakit.cost reads it)."""
    from msakit.cost import ModelShape, total_params

    try:
        n = total_params(ModelShape.from_config(folder))
    except (ValueError, FileNotFoundError):
        return  # the loader reports an unreadable config
    check_fits(int(n), device, bytes_per_param=bytes_per_param)


def _print_model_line(trainer) -> None:
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
    print(f"model: {params} on {trainer.device}; {c.steps} steps ({plan}), batch {c.batch_size} x "
          f"{trainer.train_rows.context} tokens", flush=True)


def resume_run(args: argparse.Namespace, device) -> int:
    """`train --resume` / `convert --resume`: continue a run from its checkpoint (the run folder's
    latest, or the checkpoint named) with the recorded data order and settings; only --steps (to
    train further), --out, --device, --cache-dir and --no-progress may be given."""
    from msakit.train import checkpoint as ckpt_mod
    from msakit.train.tokenizer import Tokenizer
    from msakit.train.trainer import TrainConfig, Trainer

    t0 = time.time()
    check_resume_options(args)
    out = Path(args.out)
    point = open_resume(args, out, TrainConfig.from_dict)
    if point is None:
        return 0
    ck, state, cfg = point
    if getattr(args, "compile", False):  # how the run executes, not what it trains
        cfg = dataclasses.replace(cfg, compile=True)
    meta = state.get("meta", {})
    opts = meta.get("data")
    if not opts:
        raise ckpt_mod.CheckpointError(f"{ck} does not record its data settings; cannot resume")
    tok = Tokenizer.load(ck)
    pd = prepare(opts, tokenizer=tok, cache_dir=args.cache_dir)
    model = load_model_folder(ck, dtype=torch_dtype(meta.get("dtype", "float32")))
    conversion = meta.get("kind") == "convert"
    trainer = Trainer(model, cfg, pd.train, pd.val, out_dir=out, device=device, tokenizer=tok,
                      progress=not args.no_progress, meta=meta, eval_both_modes=conversion,
                      activation_checkpointing=bool(getattr(args, "activation_checkpointing", False)))
    trainer.resume(ck, load_weights=lambda _: None)
    if not (out / "tokenizer.json").is_file():
        tok.save(out)
    print(f"resumed {ck} at step {trainer.step}")
    _print_model_line(trainer)
    trainer.fit(max_tokens=getattr(args, "max_tokens", None), budget_s=getattr(args, "time_budget", None))
    print(summary_line(trainer, t0))
    if conversion:
        print(f"model: {save_model_folder(trainer.model, tok, out / MODEL_DIR)}")
    return 0


def open_resume(args: argparse.Namespace, out: Path, parse_config: Callable[[dict], Any], *,
                drafter: bool = False) -> tuple[Path, dict, Any] | None:
    """For --resume: the checkpoint (the run folder's latest, or the one named; verified), its
    trainer state and its config with --steps applied; None, after saying so, when the run has
    already reached its steps.  A drafter checkpoint is refused unless `drafter`, and the other
    way round; continuing into another --out needs a new or empty one."""
    from msakit.train import checkpoint as ckpt_mod

    src = out if args.resume is True else Path(args.resume)
    ck = ckpt_mod.resolve_checkpoint(src)
    state, _, _, _ = ckpt_mod.load_checkpoint_state(ck)  # verifies the manifest
    is_drafter = state.get("kind") == "dspark-drafter"
    if is_drafter != drafter:
        raise ckpt_mod.CheckpointError(f"{ck} is a drafter checkpoint; resume it with `msakit train-drafter --resume`"
                                       if is_drafter else f"{ck} is not a drafter checkpoint")
    if os.path.abspath(run_folder_of(ck)) != os.path.abspath(out):
        check_new_out(out)  # continuing into another folder: a new, empty one
    cfg = parse_config(state["config"])
    step = int(state["step"])
    if args.steps is not None:
        if args.steps < step:
            raise ValueError(f"--steps {args.steps} is below the checkpoint's step {step}")
        cfg.steps = args.steps
    if step >= cfg.steps:
        print(f"nothing to train: {ck} is at step {step} of {cfg.steps}; pass --steps N (N > {step}) to train "
              "further")
        return None
    return ck, state, cfg


def check_vocab(model, tok) -> None:
    V = getattr(model.config, "vocab_size", None)
    if V is not None and tok.vocab_size > int(V):
        raise ValueError(f"the tokenizer has {tok.vocab_size} tokens but the model's vocabulary is {V}")


def model_folder(path: Path, what: str = "model") -> Path:
    """A checkpoint / run folder (verified against its manifest) or a plain model folder; `what`
    names it in the error for a missing path."""
    from msakit.train import checkpoint as ckpt_mod

    if not path.exists():
        raise FileNotFoundError(f"{what} not found: {path}")
    ck = ckpt_mod.find_checkpoint(path)
    if ck is not None:
        ckpt_mod.verify_checkpoint(ck)
        return ck
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no checkpoint or config.json in {path}")
    return path


def tokenizer_beside(path: Path):
    from msakit.train.tokenizer import Tokenizer

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


# ----------------------------------------------------------------------------- msakit convert
MODEL_DIR = "model"  # RUN/model: the converted model at the end of a conversion run (weights + tokenizer)
DTYPES = ("float32", "bfloat16")  # --dtype of `msakit convert`
# what `--train index` leaves unused (the backbone is frozen, attention dense, the KL the only loss)
_NOT_WITH_INDEX = {"warmup_steps": "attention stays dense for the whole index warm-up",
                   "kl_coef": "the KL is the only loss",
                   "kl_every": "the KL is the only loss, computed every step",
                   "routing_bias_rate": "the backbone (its routing bias included) is frozen"}


def torch_dtype(name: str):
    """The torch dtype of a --dtype name (DTYPES)."""
    import torch

    if name not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return getattr(torch, name)


def check_convert_options(args: argparse.Namespace) -> None:
    """ValueError naming the option for a combination `msakit convert` cannot honour."""
    given = set(getattr(args, "given", ()))
    train = getattr(args, "train", "index")
    budget = getattr(args, "time_budget", None)
    if budget is not None and not (math.isfinite(budget) and budget > 0):
        raise ValueError(f"--time-budget must be a positive number of seconds, got {budget!r}")
    mt = getattr(args, "max_tokens", None)
    if mt is not None and mt < 1:
        raise ValueError(f"--max-tokens must be positive, got {mt}")
    if train == "index":
        bad = [k for k in _NOT_WITH_INDEX if k in given]
        if bad:
            k = bad[0]
            raise ValueError(f"--{k.replace('_', '-')} does not apply with --train index ({_NOT_WITH_INDEX[k]}); "
                             "use --train all for the full recipe")
        if "lr" in given and "index_lr" in given:
            raise ValueError("--lr and --index-lr: with --train index only the index branch trains; give one of them")
    ib, topk = getattr(args, "init_blocks", None), getattr(args, "topk", None)
    if ib is not None and topk is not None and ib + 1 > topk:
        raise ValueError(f"--init-blocks {ib} plus the query's own block exceed --topk {topk}")


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


def run_convert(args: argparse.Namespace) -> int:
    from msakit.distributed.args import rank0_first, trainer_kwargs
    from msakit.models import M3ForCausalLM
    from msakit.models.convert import convert_dense_to_msa
    from msakit.train.tokenizer import Tokenizer
    from msakit.train.trainer import Trainer

    t0 = time.time()
    out = Path(args.out)
    check_convert_options(args)
    parallel, device, main_rank = start_processes(args, "convert")
    if args.resume:  # a conversion continues as a training run
        return resume_run(args, device)
    if args.source is None:
        raise ValueError("SOURCE is required (the dense model to convert), unless --resume continues a conversion")
    train = getattr(args, "train", "index")
    if train == "index" and parallel is not None:
        raise ValueError("--train index runs in one process (no torchrun, --cp or --fsdp yet)")
    if main_rank:
        check_new_out(out)
    folder = model_folder(Path(args.source))
    if folder_kind(folder) == "drafter":
        raise ValueError(f"{args.source} is a DSpark drafter, not a model to convert")
    tok = Tokenizer.load(args.tokenizer) if args.tokenizer else tokenizer_beside(Path(args.source))
    opts = data_options(args, args.context if args.context is not None else DEFAULT_CONTEXT)
    opts["vocab_size"] = tok.vocab_size
    check_data_options(opts)
    cfg = optim_config(args)
    dtype_name = getattr(args, "dtype", "float32")
    dtype = torch_dtype(dtype_name)
    _check_folder_fits(folder, device, dtype.itemsize if train == "index" else TRAIN_BYTES_PER_PARAM)
    src = load_model_folder(folder, dtype=dtype)
    model = convert_dense_to_msa(src, index_head_dim=args.index_dim, block_size=args.block_size,
                                 topk=args.topk, init_blocks=getattr(args, "init_blocks", None),
                                 index_init=getattr(args, "index_init", "random"), seed=args.seed)
    check_context(model.config, opts["context"])
    check_vocab(model, tok)
    if getattr(args, "compile", False) and not isinstance(model, M3ForCausalLM):
        raise ValueError("--compile compiles msakit's decoder layers; a converted HF model has none "
                         "(train it without --compile)")
    with new_run_dir(out) if main_rank else contextlib.nullcontext():
        with rank0_first(parallel):  # rank 0 fills the data cache first
            pd = prepare(opts, tokenizer=tok, cache_dir=args.cache_dir)
        meta = {"kind": "convert", "data": opts, "source": str(args.source), "dtype": dtype_name,
                "index_init": getattr(args, "index_init", "random"), "long_files": [f.name for f in pd.corpus.long]}
        trainer = Trainer(model, cfg, pd.train, pd.val, out_dir=out, device=device, tokenizer=tok,
                          progress=not args.no_progress, meta=meta, eval_both_modes=True,
                          **trainer_kwargs(args, parallel))
        if main_rank:
            tok.save(out)
        before_d = trainer.evaluate(mode="dense", recall_rows=0, compute_kl=False)["loss"]
        before_s = trainer.evaluate(mode="sparse", recall_rows=0, compute_kl=False)["loss"]
        say = print if main_rank else (lambda *a, **k: None)
        if cfg.train == "index":
            over = "every causal token" if cfg.kl_tokens == "all" else "the selected tokens"
            plan = f"index-branch warm-up (backbone frozen, full attention, KL over {over}) for {cfg.steps} steps"
        else:
            plan = (f"indexer warm-up (dense) for {cfg.dense_warmup_steps} steps, then sparse to step {cfg.steps}")
        say(f"converted {folder}: validation loss dense {before_d:.3f}, sparse with the untrained indexer "
            f"{before_s:.3f}; {plan}", flush=True)
        if main_rank:
            _print_model_line(trainer)
        trainer.fit(max_tokens=getattr(args, "max_tokens", None), budget_s=getattr(args, "time_budget", None))
    ev = trainer.last_eval or {}
    if ev.get("step") == trainer.step and "val_loss_dense" in ev and "val_loss_sparse" in ev:
        after_d, after_s = ev["val_loss_dense"], ev["val_loss_sparse"]
    else:
        after_d = trainer.evaluate(mode="dense", recall_rows=0, compute_kl=False)["loss"]
        after_s = trainer.evaluate(mode="sparse", recall_rows=0, compute_kl=False)["loss"]
    say(f"after conversion: validation loss dense {after_d:.3f}, sparse {after_s:.3f}")
    say(summary_line(trainer, t0))
    if main_rank:
        mdir = save_model_folder(trainer.model, tok, out / MODEL_DIR)
        say(f"model: {mdir} (msakit eval --model {mdir}; msakit generate {mdir})")
    say(f"continue training: msakit convert --resume --out {out} --steps N (or msakit train --resume --out {out})")
    return 0


# ----------------------------------------------------------------------------- msakit generate
class TextStreamer:
    """`streamer(tokens [B])` for `model.generate`: decodes row 0 incrementally to a text stream
    (holding back an incomplete UTF-8 sequence until its last byte arrives); stops at EOS.
    `push(token)` feeds one token id (what the speculative streamer adapter calls)."""

    def __init__(self, tokenizer, stream=None, eos_id: int | None = None) -> None:
        self.tok = tokenizer
        self.stream = stream if stream is not None else sys.stdout
        self.eos_id = eos_id
        self.ids: list[int] = []
        self.printed = 0
        self.done = False

    def __call__(self, tokens) -> None:
        self.push(int(tokens.reshape(-1)[0]))

    def push(self, t: int) -> None:
        if self.done:
            return
        if self.eos_id is not None and t == self.eos_id:
            self.done = True
            return
        self.ids.append(t)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return
        self.stream.write(text[self.printed:])
        self.stream.flush()
        self.printed = len(text)

    def text(self) -> str:
        return self.tok.decode(self.ids)


def load_drafter(path: Path, device):
    """A DSpark drafter from a drafter run folder (its latest checkpoint), checkpoint or folder."""
    from msakit.speculative import DSparkDrafter
    from msakit.train import checkpoint as ckpt_mod

    folder = model_folder(path, "drafter")
    if folder_kind(folder) != "drafter":
        raise ValueError(f"--drafter {path} is not a DSpark drafter (train one with `msakit train-drafter`)")
    try:
        return DSparkDrafter.from_pretrained(folder, device=device)
    except (ValueError, FileNotFoundError):
        raise
    except Exception as e:  # safetensors errors on a damaged folder
        raise ckpt_mod.CheckpointError(f"cannot load the drafter in {folder}: {str(e).splitlines()[0]}") from None


def run_generate(args: argparse.Namespace) -> int:
    import torch

    from msakit.generate import generate
    from msakit.train.metrics import autocast_for
    from msakit.train.tokenizer import Tokenizer
    from msakit.train.trainer import resolve_device

    if args.prompt is not None and args.prompt_file is not None:
        raise ValueError("give --prompt or --prompt-file, not both")
    prompt = args.prompt
    if args.prompt_file is not None:
        prompt = Path(args.prompt_file).read_text(encoding="utf-8", errors="replace")
    if prompt is None:
        prompt = ""
    compile_step = bool(getattr(args, "compile", False))
    if compile_step and args.drafter:
        raise ValueError("--compile compiles plain decoding's step; it does not take --drafter")
    device = resolve_device(args.device)
    folder = model_folder(Path(args.checkpoint))
    kind = folder_kind(folder)
    if kind == "drafter":
        raise ValueError(f"{args.checkpoint} is a DSpark drafter, not a model: pass the target model as CHECKPOINT "
                         f"and this folder as --drafter")
    if kind == "hf-dense":
        raise ValueError(f"{args.checkpoint} is a dense HF model without MSA index branches: convert it first "
                         f"(`msakit convert {args.checkpoint} --out RUN`), then `msakit generate RUN`")
    tok = Tokenizer.load(args.tokenizer) if args.tokenizer else tokenizer_beside(Path(args.checkpoint))
    drafter = load_drafter(Path(args.drafter), device) if args.drafter else None
    model = load_model_folder(folder, device=device)
    check_vocab(model, tok)
    if compile_step:
        from msakit.generate import paged_supported
        from msakit.models import M3ForCausalLM

        why = "it is a converted HF model (contiguous cache)" if not isinstance(model, M3ForCausalLM) \
            else paged_supported(model)
        if why is not None:
            raise ValueError(f"--compile needs an msakit model on the paged cache: {why}")
    if drafter is not None:
        drafter.config.check_target(model.config)
    model.set_attention_mode(args.mode)
    ids = tok.encode(prompt) if prompt else []
    if not ids:
        ids = [tok.eos_id]  # an empty prompt starts a new document
    check_context(model.config, len(ids) + args.max_new_tokens)
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    x = torch.tensor([ids], dtype=torch.long, device=device)
    sys.stdout.write(prompt)
    sys.stdout.flush()
    streamer = TextStreamer(tok, sys.stdout, eos_id=tok.eos_id)
    sample = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, generator=gen,
                  eos_token_id=tok.eos_id)
    with torch.no_grad(), autocast_for(device):
        if drafter is None:
            generate(model, x, args.max_new_tokens, streamer=streamer, **sample,
                           **({"compile": True} if compile_step else {}))
        else:
            from msakit.speculative import speculative_generate

            def push_rows(rows: list[list[int]]) -> None:
                for t in rows[0]:
                    streamer.push(int(t))

            _, stats = speculative_generate(model, drafter, x, args.max_new_tokens, streamer=push_rows,
                                            return_stats=True, **sample)
    sys.stdout.write("\n")
    sys.stdout.flush()
    if drafter is not None and stats.row_rounds:
        print(f"speculative decoding: accepted length {stats.accepted_length:.2f} tokens per target forward "
              f"({stats.rounds} rounds, {stats.accepted_drafts} of {stats.verified_drafts} drafts accepted)",
              file=sys.stderr)
    return 0
