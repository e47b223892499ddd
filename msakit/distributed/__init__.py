"""Several processes: launch from the torchrun environment, FSDP2, context-parallel MSA, DCP checkpoints.

Built on torch.distributed only (process groups, `DeviceMesh`, `fully_shard`,
`torch.distributed.checkpoint`).  See docs/distributed.md for the design, its numbers and the
commands.

- `launch`: ranks / devices / seeds from the environment, the (dp, cp) mesh, fit checks, `setup_distributed`
- `fsdp`: FSDP2 wrapping of M3ForCausalLM, gradient averaging without FSDP
- `cp`: context-parallel MSA (`ContextParallel`, `cp_msa_attention`)
- `step`: one rank's share of a training step's loss
- `checkpoint`: sharded DCP checkpoints, conversion to / from safetensors
- the command-line flags (--cp, --fsdp, --activation-checkpointing) live in `msakit.commands.options`
"""

from __future__ import annotations

from msakit.distributed.cp import (
    ChunkLayout,
    CommStats,
    ContextParallel,
    GatherSequence,
    chunk_layout,
    comm_bytes_per_layer,
    cp_msa_attention,
)
from msakit.distributed.launch import DistEnv, Parallel, check_fit, init_distributed, make_parallel, print0

__all__ = [
    "ChunkLayout",
    "CommStats",
    "ContextParallel",
    "GatherSequence",
    "chunk_layout",
    "comm_bytes_per_layer",
    "cp_msa_attention",
    "DistEnv",
    "Parallel",
    "check_fit",
    "init_distributed",
    "make_parallel",
    "print0",
]
