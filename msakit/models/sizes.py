"""Sizes judged against the model and the device before any work: the memory a device has free,
and one-line refusals (ValueError naming the option) for batches, sample counts and selection
settings that cannot fit the device or mean nothing for the model.

    available_memory("cuda:0")                      # free bytes (CUDA's free memory, the host's MemAvailable)
    check_memory(need, device, "--batch-size 8 x 4096 tokens")
    check_batch_fits(model.config, rows=8, context=4096, device="cpu", backward=True)
    check_selection_fits(block_size=128, topk=16, positions=32768)

The activation estimate is `msakit.cost.activation_bytes` (a lower bound: logits and hidden
states), so a refusal is certain and an acceptance is not a promise.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable

import torch

from msakit.cost import ModelShape, activation_bytes

__all__ = ["available_memory", "format_bytes", "check_memory", "shape_of", "check_batch_fits",
           "check_selection_fits", "max_positions"]


def available_memory(device: torch.device | str) -> int | None:
    """Free bytes on `device`: CUDA's free memory, the host's MemAvailable; None if unknown."""
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


def format_bytes(n: float) -> str:
    """Bytes as decimal GB (TB from 1e12)."""
    return f"{n / 1e12:,.2f} TB" if n >= 1e12 else f"{n / 1e9:,.2f} GB"


def check_memory(need: float, device: torch.device | str, what: str, *,
                 available: Callable[[Any], int | None] = available_memory) -> None:
    """ValueError "`what` needs at least NEED on DEVICE but AVAIL are available" when `need`
    bytes exceed what `device` has free (nothing is checked where that is unknown)."""
    avail = available(device)
    if avail is not None and need > avail:
        raise ValueError(f"{what} needs at least {format_bytes(need)} on {torch.device(device)} but "
                         f"{format_bytes(avail)} are available")


def shape_of(config: Any) -> ModelShape:
    """The `msakit.cost.ModelShape` of a model's config: an `M3Config` (its `to_shape`), a
    transformers config or a config dict."""
    if hasattr(config, "to_shape"):
        return config.to_shape()
    return ModelShape.from_config(config.to_dict() if hasattr(config, "to_dict") else config)


def check_batch_fits(config: Any, rows: int, context: int, device: torch.device | str, *, backward: bool,
                     option: str = "--batch-size", available: Callable[[Any], int | None] = available_memory) -> None:
    """ValueError naming `option` when `rows` x `context` tokens through the model of `config`
    need more activation memory than `device` has free (`msakit.cost.activation_bytes`, a lower
    bound; `backward`: a training step); nothing is checked for a config `msakit.cost` cannot read."""
    try:
        shape = shape_of(config)
    except (ValueError, KeyError, TypeError, AttributeError):
        return  # a config msakit.cost does not read: its loader or the model reports the problem
    need = activation_bytes(shape, int(rows) * int(context), backward=backward)
    step = "a training step" if backward else "a forward"
    check_memory(need, device, f"{option} {rows:,} ({rows:,} x {context:,} tokens: the logits and hidden states of "
                               f"{step}, a lower bound)", available=available)


def max_positions(config: Any) -> int | None:
    """The model's max_position_embeddings (None when its config has none)."""
    n = getattr(config, "max_position_embeddings", None)
    return int(n) if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def check_selection_fits(block_size: int, topk: int, positions: int | None, *, block_option: str = "--block-size",
                         topk_option: str = "--topk") -> None:
    """ValueError naming the option when blocks of `block_size` tokens are longer than the
    model's `positions`, or `topk` blocks per query are more than `positions` hold (nothing is
    checked without `positions`)."""
    if positions is None:
        return
    if block_size > positions:
        raise ValueError(f"{block_option} {block_size:,} is longer than the model's {positions:,} positions "
                         "(max_position_embeddings): a block must fit the context")
    blocks = math.ceil(positions / block_size)
    if topk > blocks:
        raise ValueError(f"{topk_option} {topk:,} exceeds the {blocks:,} blocks of {block_size} tokens in the model's "
                         f"{positions:,} positions (max_position_embeddings)")
