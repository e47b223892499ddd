"""Launch: ranks, devices and seeds from the torchrun environment; the (dp, cp) device mesh.

`torchrun --nproc-per-node N -m msakit train ...` sets RANK, WORLD_SIZE, LOCAL_RANK (and
MASTER_ADDR / MASTER_PORT); a plain `python -m msakit train` sets none of them and runs as one
process without a process group.  On CUDA each process takes the GPU of its local rank and NCCL;
on CPU it uses gloo.  Ranks form a 2-D mesh (dp, cp), row-major: the ranks of one cp group are
consecutive (one host, the fastest links), rank = dp_rank * cp + cp_rank.
"""

from __future__ import annotations

import datetime
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

__all__ = ["DistEnv", "Parallel", "env_ranks", "init_distributed", "make_parallel", "check_fit", "rank_seed",
           "print0", "setup_distributed", "is_main", "rank0_first", "DEFAULT_TIMEOUT_S"]

DEFAULT_TIMEOUT_S = 600


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw in (None, ""):
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def env_ranks() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from RANK / WORLD_SIZE / LOCAL_RANK ((0, 1, 0) when unset)."""
    rank, world, local = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1), _env_int("LOCAL_RANK", 0)
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"RANK={rank} and WORLD_SIZE={world} do not fit (need 0 <= RANK < WORLD_SIZE)")
    return rank, world, local


@dataclass
class DistEnv:
    """This process: its rank among `world_size`, its local rank on the host, its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None: one process, no process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def init_distributed(device: str | torch.device | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> DistEnv:
    """Join the process group the environment describes (idempotent) and pick the device.

    device: None / "auto" (the local rank's GPU when CUDA is available, else CPU), "cpu", "cuda"
    (the local rank's GPU).  Every collective of the group times out after `timeout_s` seconds
    instead of hanging."""
    rank, world, local = env_ranks()
    name = "auto" if device in (None, "") else str(device)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} requested but CUDA is not available")
        if dev.index is None:
            if local >= torch.cuda.device_count():
                raise ValueError(f"LOCAL_RANK={local} but only {torch.cuda.device_count()} GPUs are visible")
            dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    if dist.is_initialized():
        return DistEnv(dist.get_rank(), dist.get_world_size(), local, dev, dist.get_backend())
    if world == 1 and "MASTER_ADDR" not in os.environ:
        return DistEnv(0, 1, 0, dev, None)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    kw: dict[str, Any] = dict(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    if dev.type == "cuda":
        kw["device_id"] = dev
    dist.init_process_group(**kw)
    return DistEnv(dist.get_rank(), dist.get_world_size(), local, dev, backend)


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank `rank` for per-rank randomness (the model's initialisation and the data
    order use `seed` itself, the same on every rank)."""
    return int(seed) + 1_000_003 * int(rank)


def print0(*args: Any, **kwargs: Any) -> None:
    """print on rank 0 only (every rank when no process group exists)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs)


def check_fit(world_size: int, cp: int, *, batch_size: int | None = None) -> int:
    """The data-parallel size dp = world_size / cp, or ValueError when the world size does not
    fit the context-parallel size or the global batch."""
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"--cp must be a positive integer, got {cp!r}")
    if world_size % cp:
        raise ValueError(f"the world size {world_size} is not a multiple of --cp {cp}")
    dp = world_size // cp
    if batch_size is not None and batch_size % dp:
        raise ValueError(f"--batch-size {batch_size} is not a multiple of the data-parallel size {dp} "
                         f"(world size {world_size} / cp {cp})")
    return dp


@dataclass
class Parallel:
    """How this process takes part: its env, the data-parallel and context-parallel sizes and groups."""

    env: DistEnv
    dp: int
    cp: int
    dp_rank: int
    cp_rank: int
    mesh: Any = None  # DeviceMesh (dp, cp) or None for one process
    fsdp_mesh: Any = None  # 1-D DeviceMesh over every rank (what fully_shard shards over)

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def cp_group(self) -> Any:
        return self.mesh.get_group("cp") if self.mesh is not None else None

    @property
    def dp_group(self) -> Any:
        return self.mesh.get_group("dp") if self.mesh is not None else None

    def batch_rows(self, batch_size: int) -> slice:
        """This rank's rows of a global batch of `batch_size` rows."""
        per = batch_size // self.dp
        return slice(self.dp_rank * per, (self.dp_rank + 1) * per)


def make_parallel(env: DistEnv, cp: int = 1, *, batch_size: int | None = None) -> Parallel:
    """The (dp, cp) mesh of the process group (collective: every rank calls it)."""
    dp = check_fit(env.world_size, cp, batch_size=batch_size)
    if not env.distributed:
        return Parallel(env, dp=1, cp=1, dp_rank=0, cp_rank=0)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(env.device.type, (dp, cp), mesh_dim_names=("dp", "cp"))
    fsdp_mesh = init_device_mesh(env.device.type, (env.world_size,), mesh_dim_names=("fsdp",))
    return Parallel(env, dp=dp, cp=cp, dp_rank=env.rank // cp, cp_rank=env.rank % cp, mesh=mesh, fsdp_mesh=fsdp_mesh)


def setup_distributed(*, cp: int = 1, fsdp: bool = False, device: str | torch.device | None = None,
                      batch_size: int | None = None) -> Parallel | None:
    """Join the torchrun process group (when the environment names one) and build the (dp, cp) mesh.

    Returns None for a one-process run without context parallelism or FSDP (the Trainer's plain
    path).  Raises ValueError for a world size that does not fit `cp` or the global batch, on
    every rank."""
    env = init_distributed(device)
    if not env.distributed:
        if cp != 1 or fsdp:
            raise ValueError("--cp and --fsdp need several processes: launch with "
                             "`torchrun --nproc-per-node N -m msakit ...`")
        return None
    return make_parallel(env, cp, batch_size=batch_size)


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
