"""Command-line flags of multi-process training and their setup, for `msakit train` / `convert`.

    torchrun --nproc-per-node 8 -m msakit train --preset small --fsdp --cp 2 ...

`add_distributed_args(parser)` adds --cp, --fsdp and --activation-checkpointing;
`setup_distributed(args)` joins the torchrun process group and returns a `Parallel` (None for a
plain one-process run without those flags); `trainer_kwargs` are the Trainer's arguments;
`rank0_first` lets rank 0 do a step (data preparation, tokenizer training, writing caches) before
the others, which then read its results.
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch.distributed as dist

from msakit.distributed.launch import Parallel, init_distributed, make_parallel

__all__ = ["add_distributed_args", "setup_distributed", "trainer_kwargs", "rank0_first", "is_main"]


def add_distributed_args(p: argparse.ArgumentParser, *, positive_int: Callable[[str], int] = int) -> None:
    """--cp, --fsdp, --activation-checkpointing; `positive_int` is the argparse type of --cp (the
    CLI passes its bounded integer type, so 0 is refused while parsing)."""
    g = p.add_argument_group("several GPUs (launch with torchrun --nproc-per-node N -m msakit ...)")
    g.add_argument("--cp", type=positive_int, default=1, metavar="N",
                   help="context-parallel size: each sequence is split over N ranks (default 1); "
                        "the data-parallel size is the world size / N")
    g.add_argument("--fsdp", action="store_true",
                   help="shard weights, gradients and optimizer state over the ranks (FSDP2)")
    g.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each decoder layer in backward (less memory, ~1/3 more compute)")


def setup_distributed(args: argparse.Namespace, *, batch_size: int | None = None) -> Parallel | None:
    """Join the torchrun process group (when the environment names one) and build the (dp, cp) mesh.

    Returns None for a one-process run without --cp / --fsdp (the Trainer's plain path).  Raises
    ValueError for a world size that does not fit --cp or the global batch, on every rank."""
    cp = getattr(args, "cp", 1)
    fsdp = getattr(args, "fsdp", False)
    env = init_distributed(getattr(args, "device", None))
    if not env.distributed:
        if cp != 1 or fsdp:
            raise ValueError("--cp and --fsdp need several processes: launch with "
                             "`torchrun --nproc-per-node N -m msakit ...`")
        return None
    bs = batch_size if batch_size is not None else getattr(args, "batch_size", None)
    return make_parallel(env, cp, batch_size=bs)


def trainer_kwargs(args: argparse.Namespace, parallel: Parallel | None) -> dict[str, Any]:
    """The Trainer's keyword arguments for these flags."""
    return dict(parallel=parallel, fsdp=bool(getattr(args, "fsdp", False)),
                activation_checkpointing=bool(getattr(args, "activation_checkpointing", False)))


def is_main(parallel: Parallel | None) -> bool:
    return parallel is None or parallel.env.is_main


@contextmanager
def rank0_first(parallel: Parallel | None) -> Iterator[None]:
    """Rank 0 runs the body first; the other ranks wait for it, then run the body themselves."""
    multi = parallel is not None and parallel.env.distributed and dist.is_initialized()
    if multi and not parallel.env.is_main:
        dist.barrier()
    yield
    if multi and parallel.env.is_main:
        dist.barrier()
