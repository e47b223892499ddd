"""MSA's selection settings: `Selection`, the one object every config carries, and its checks."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from ..checks import check_positive_int

__all__ = ["SCORE_DTYPES", "Selection", "check_selection"]

SCORE_DTYPES = (None, "fp8")


def check_selection(block_size: int, topk: int, local_blocks: int, init_blocks: int) -> None:
    """Raise ValueError (naming the argument) unless the four settings make a valid selection."""
    check_positive_int("block_size", block_size)
    check_positive_int("topk", topk)
    check_positive_int("local_blocks", local_blocks)
    check_positive_int("init_blocks", init_blocks, minimum=0)
    if topk < local_blocks + init_blocks:
        raise ValueError(
            f"topk={topk} must be >= local_blocks + init_blocks = {local_blocks} + {init_blocks}: "
            "the forced blocks must fit in the selection"
        )


_BUDGET = re.compile(r"^block(\d+)-top(\d+)$")


@dataclass(frozen=True)
class Selection:
    """MSA's selection settings, the one object every config carries (checked on construction by
    `check_selection`).  `str(sel)` is its key budget, "block<block_size>-top<topk>", which
    `Selection.parse` reads back (with the default forcing)."""

    block_size: int = 128  # tokens per key block (the selection block)
    topk: int = 16  # blocks kept per (batch, group, query)
    local_blocks: int = 1  # the query's own block and the ones just before it, always kept
    init_blocks: int = 0  # the sequence's first blocks, always kept
    score_dtype: str | None = None  # index scores in the inputs' dtype (None) or "fp8"

    def __post_init__(self) -> None:
        check_selection(self.block_size, self.topk, self.local_blocks, self.init_blocks)
        if self.score_dtype not in SCORE_DTYPES:
            raise ValueError(f"score_dtype must be one of {SCORE_DTYPES}, got {self.score_dtype!r}")

    @property
    def keys(self) -> int:
        """Keys each query attends at most: topk * block_size."""
        return self.topk * self.block_size

    def covers(self, context: int) -> bool:
        """Whether every query of a `context`-token sequence keeps all the blocks it sees (topk >=
        the context's blocks): sparse attention is then exactly dense attention."""
        return self.topk * self.block_size >= context

    def replace(self, **changes) -> "Selection":
        """A copy with some settings changed (checked again)."""
        return dataclasses.replace(self, **changes)

    def __str__(self) -> str:
        return f"block{self.block_size}-top{self.topk}"

    @classmethod
    def parse(cls, text: str, **forcing) -> "Selection":
        """'block64-top8' -> Selection(64, 8, **forcing)."""
        m = _BUDGET.match(str(text).strip())
        if not m:
            raise ValueError(f"a selection budget looks like 'block64-top8', got {text!r}")
        return cls(int(m.group(1)), int(m.group(2)), **forcing)
