"""What the commands share: the argparse types (refused values never reach a command), the option
groups (data, training, several GPUs, --device), and their translation into the library's
settings (`data_options`, `optim_config`, `start_processes`).

Option values are checked when the command line is parsed (`Number`, `DEVICE`); combinations of
options (what `--resume` allows, what a recipe leaves unused) are checked by the commands before
they call the library.  A value the user gave is used or refused, never replaced by a default.
"""

from __future__ import annotations

import argparse
import functools
import math
import re
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from msakit.distributed.launch import Parallel, is_main, setup_distributed
from msakit.train.corpus import DEFAULT_LONG_MIN_TOKENS, DEFAULT_VAL_FRACTION
from msakit.train.runs import DEFAULT_CONTEXT, DataOptions
from msakit.train.trainer import TrainConfig, resolve_device


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


def add_device_arg(p: Any) -> None:
    """--device on a parser or an argument group."""
    p.add_argument("--device", type=DEVICE, default="auto", help="cpu, cuda, cuda:N or auto (cuda when available)")


# ----------------------------------------------------------------------------- option groups
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


_OPTIM_DEFAULTS = dict(steps=1000, batch_size=8, lr=3e-3, lr_warmup_steps=20, dense_warmup_steps=300, kl_every=1,
                       eval_every=100, save_every=200, eval_rows=32)


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


def add_distributed_args(p: argparse.ArgumentParser) -> None:
    """--cp, --fsdp, --activation-checkpointing (`msakit train` / `convert` under torchrun)."""
    g = p.add_argument_group("several GPUs (launch with torchrun --nproc-per-node N -m msakit ...)")
    g.add_argument("--cp", type=POS_INT, default=1, metavar="N",
                   help="context-parallel size: each sequence is split over N ranks (default 1); "
                        "the data-parallel size is the world size / N")
    g.add_argument("--fsdp", action="store_true",
                   help="shard weights, gradients and optimizer state over the ranks (FSDP2)")
    g.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each decoder layer in backward (less memory, ~1/3 more compute)")


def add_resume_arg(p: argparse.ArgumentParser, help_: str) -> None:
    p.add_argument("--resume", nargs="?", const=True, default=None, metavar="CKPT", help=help_)


# ----------------------------------------------------------------------------- options -> settings
def given(args: argparse.Namespace) -> set[str]:
    """The dests of the options the command line named (`msakit.cli.main` records them)."""
    return set(getattr(args, "given", ()))


def resume_from(args: argparse.Namespace) -> Path | None:
    """--resume's checkpoint: None for the run folder's latest (a bare --resume)."""
    return None if args.resume is True else Path(args.resume)


def check_resume_options(args: argparse.Namespace, allowed: frozenset) -> None:
    """With --resume the run's recorded settings apply: refuse options that would be ignored."""
    extra = sorted(given(args) - allowed)
    if extra:
        names = ", ".join("--" + g.replace("_", "-") for g in extra)
        ok = ", ".join("--" + g.replace("_", "-") for g in sorted(allowed) if hasattr(args, g))
        raise ValueError(f"{names}: a resumed run keeps the settings recorded in its checkpoint; with --resume only "
                         f"{ok} apply")


def data_options(args: argparse.Namespace, context: int | None) -> DataOptions:
    """The data settings of the options (`context` None: the library's default for the model)."""
    return DataOptions(data=[str(Path(d)) for d in (args.data or [])], stdlib=not args.no_stdlib,
                       vocab_size=getattr(args, "vocab_size", None), context=context, val_fraction=args.val_fraction,
                       long_min_tokens=args.long_min_tokens, max_train_tokens=args.max_train_tokens)


def _scaled(default: int, steps: int, default_steps: int) -> int:
    """A warm-up default for a run of `steps` steps: kept for runs at least `default_steps` long,
    scaled in proportion below (at least 1 step when the default is not 0)."""
    if steps >= default_steps or default == 0:
        return default
    return max(1, round(default * steps / default_steps))


def _n(k: int, noun: str) -> str:
    return f"{k} {noun}{'' if k == 1 else 's'}"


def note(args: argparse.Namespace, msg: str) -> None:
    """Says `msg` on stderr as a note of the command."""
    print(f"msakit {getattr(args, 'command', '')}: note: {msg}", file=sys.stderr)


def optim_config(args: argparse.Namespace, warn: Callable[[str], None] | None = None) -> TrainConfig:
    """The TrainConfig the options ask for.  Defaults of the two warm-ups are scaled to a short
    run (so that a 10-step run still reaches sparse attention) and said so (to `warn`; default
    `note`); a warm-up the user gave is used as given, with a warning when it covers the whole
    run."""
    d = args.optim_defaults
    warn = warn or functools.partial(note, args)
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


def deferred_notes(args: argparse.Namespace) -> tuple[TrainConfig, Callable[[], None]]:
    """`optim_config` with its notes held back: (the config, a function that says them), so that
    a command refused by the library's checks prints its one error line alone."""
    notes: list[str] = []
    cfg = optim_config(args, warn=notes.append)

    def say() -> None:
        for msg in notes:
            note(args, msg)

    return cfg, say


def start_processes(args: argparse.Namespace) -> tuple[Parallel | None, torch.device, bool]:
    """(parallel or None, device, is this rank 0) of a train / convert run: joins torchrun's
    process group when the environment names one and checks --cp and the batch against it."""
    parallel = setup_distributed(cp=args.cp, fsdp=args.fsdp, device=args.device, batch_size=args.batch_size)
    device = parallel.env.device if parallel is not None else resolve_device(args.device)
    return parallel, device, is_main(parallel)
