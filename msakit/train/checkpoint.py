"""Training checkpoints: atomic, hashed, pickle-free.

Layout of a run folder::

    <run>/checkpoints/step-00000200/    model weights (the model's save_pretrained: safetensors + config.json)
                                        optimizer.safetensors + optimizer.json (tensors / scalars)
                                        rng.safetensors + trainer_state.json (step, loader state, RNG, config)
                                        tokenizer.json, manifest.json (sha256 of every other file)
    <run>/checkpoints/latest            the name of the newest complete checkpoint

Writing goes into ``checkpoints/.tmp-...``; every file is fsynced, the manifest written last, the
folder renamed to ``step-N`` and only then ``latest`` replaced (os.replace, fsync of the folder).
An interruption at any point (Ctrl-C included) leaves ``latest`` naming the previous complete
checkpoint; older checkpoints are pruned only after the new one is in place (``keep`` 0 keeps all).  Loading checks every
file against the manifest (a missing, extra-modified or corrupt file is a `CheckpointError`), then
the form of what a resume reads before anything uses it: trainer_state.json's fields and their types
(`check_trainer_state`), rng.safetensors' tensors (`check_rng_tensors`), the optimizer files.
`CheckpointError` is a `msakit.models.io.ModelFolderError`: one error type for every damaged folder.

A run on several processes writes sharded DCP checkpoints instead (``<run>/sharded/step-N``:
`msakit.distributed.checkpoint`, its trainer state in state.json, no RNG file, the optimizer
inside the shards); `find_checkpoint` returns the newest complete checkpoint of either kind, so a
run folder is resumed, loaded, exported the same way whichever wrote it.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from msakit.distributed.checkpoint import STATE_FILE, is_sharded_checkpoint, read_state
from msakit.models.io import ModelFolderError, lies_inside, reading

MANIFEST = "manifest.json"
LATEST = "latest"
CKPT_DIR = "checkpoints"
SHARDED_DIR = "sharded"  # DCP checkpoints of runs on several ranks: <run>/sharded/step-N, <run>/sharded/latest
FORMAT = "msakit-train-checkpoint-v1"


class CheckpointError(ModelFolderError):
    """A missing, corrupt or mismatching checkpoint (a user error: one line, exit status 2)."""


# what the loaders read of trainer_state.json (both trainers write these; a missing key reads as absent)
_INT = (int,)
_LOADER_FIELDS = {"seed": _INT, "epoch": _INT, "pos": _INT, "batch_size": _INT, "shuffle": (bool,), "rows": _INT,
                  "fingerprint": (str,)}
_MT_WORDS = 624  # the Mersenne Twister's state words (Python's and NumPy's generator)


def _is(v: Any, kinds: tuple) -> bool:
    return isinstance(v, kinds) and not (isinstance(v, bool) and bool not in kinds)


def check_trainer_state(state: Any, path: Path, *, rng: bool = True) -> dict:
    """`state` (trainer_state.json, at `path`) if it holds what a resume reads, of the right types
    (step, config, loader, rng unless not `rng` (a sharded checkpoint's state.json), optional meta
    and tokens_seen); CheckpointError naming the file and the field otherwise."""
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: {what}; the checkpoint is damaged")

    if not isinstance(state, dict):
        raise bad("not a JSON object")
    step = state.get("step")
    if not _is(step, _INT) or step < 0:
        raise bad(f"'step' must be a non-negative integer, got {step!r}")
    for key in ("config", "loader", "rng") if rng else ("config", "loader"):
        if not isinstance(state.get(key), dict):
            raise bad(f"'{key}' is missing or not an object" if key not in state else f"'{key}' is not an object")
    for key in ("meta",):
        if key in state and not isinstance(state[key], dict):
            raise bad(f"'{key}' is not an object")
    if "tokens_seen" in state and not (_is(state["tokens_seen"], _INT) and state["tokens_seen"] >= 0):
        raise bad(f"'tokens_seen' must be a non-negative integer, got {state['tokens_seen']!r}")
    for key, kinds in _LOADER_FIELDS.items():
        v = state["loader"].get(key)
        if not _is(v, kinds) or (kinds is _INT and v < 0):
            raise bad(f"'loader.{key}' must be {'a non-negative integer' if kinds is _INT else kinds[0].__name__}, "
                      f"got {v!r}")
    if not rng:
        return state
    py, npy = state["rng"].get("python"), state["rng"].get("numpy")
    if not (isinstance(py, list) and len(py) == 3 and _is(py[0], _INT) and isinstance(py[1], list)
            and len(py[1]) == _MT_WORDS + 1 and all(_is(x, _INT) and 0 <= x < 2**32 for x in py[1])
            and (py[2] is None or _is(py[2], (int, float)))):
        raise bad("'rng.python' is not a Python random state")
    if not (isinstance(npy, list) and len(npy) == 4 and npy[0] == "MT19937" and _is(npy[1], _INT)
            and _is(npy[2], _INT) and _is(npy[3], (int, float))):
        raise bad("'rng.numpy' is not a NumPy random state")
    return state


def check_rng_tensors(tensors: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """`tensors` (rng.safetensors, at `path`) if they are the generator states `set_rng_state`
    restores (torch's CPU state, NumPy's key words, CUDA states); CheckpointError naming the file
    otherwise."""
    want = torch.get_rng_state()
    cpu = tensors.get("torch_cpu")
    if cpu is None or cpu.dtype != want.dtype or tuple(cpu.shape) != tuple(want.shape):
        raise CheckpointError(f"{path}: 'torch_cpu' must be a {want.dtype} tensor of {want.numel()} bytes "
                              f"(torch's CPU generator state); the checkpoint is damaged")
    keys = tensors.get("numpy_keys")
    if keys is None or keys.dtype != torch.int64 or tuple(keys.shape) != (_MT_WORDS,) or \
            bool(((keys < 0) | (keys >= 2**32)).any()):
        raise CheckpointError(f"{path}: 'numpy_keys' must be {_MT_WORDS} int64 words in [0, 2^32) (NumPy's "
                              "generator state); the checkpoint is damaged")
    for k, v in tensors.items():
        if k.startswith("torch_cuda_") and (v.dtype != torch.uint8 or v.dim() != 1):
            raise CheckpointError(f"{path}: '{k}' must be a 1-D uint8 tensor (a CUDA generator state)")
        if k not in ("torch_cpu", "numpy_keys") and not k.startswith("torch_cuda_"):
            raise CheckpointError(f"{path}: unexpected tensor {k!r} in the generator states")
    return tensors


# ----------------------------------------------------------------------------- files and hashes
def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())


def _list_files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


# ----------------------------------------------------------------------------- optimizer state
def optimizer_to_files(optimizer: torch.optim.Optimizer, param_names: list[str]) -> tuple[dict, dict]:
    """-> (tensors for safetensors, JSON-able scalars).  Tensors keyed ``state.<param name>.<key>``."""
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {"state": {}, "param_groups": [], "param_names": param_names}
    for idx, st in sd["state"].items():
        name = param_names[idx]
        for key, val in st.items():
            if isinstance(val, torch.Tensor):
                tensors[f"state.{name}.{key}"] = val.detach().cpu().contiguous().clone()
            else:
                scalars["state"].setdefault(name, {})[key] = val
    for g in sd["param_groups"]:
        gg = {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
        gg["params"] = [param_names[i] for i in g["params"]]
        gg["_tuples"] = [k for k, v in g.items() if isinstance(v, tuple)]
        scalars["param_groups"].append(gg)
    return tensors, scalars


def optimizer_from_files(optimizer: torch.optim.Optimizer, param_names: list[str], tensors: dict, scalars: dict) -> None:
    """Restore `optimizer` from the tensors and scalars `optimizer_to_files` wrote; CheckpointError
    when they do not fit it or are malformed."""
    if not isinstance(scalars, dict) or scalars.get("param_names") != param_names:
        raise CheckpointError("optimizer state does not match the model's parameters")
    try:
        _optimizer_from_files(optimizer, param_names, tensors, scalars)
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, RuntimeError) as e:
        raise CheckpointError(f"optimizer state does not fit: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                              ) from None


def _optimizer_from_files(optimizer: torch.optim.Optimizer, param_names: list[str], tensors: dict,
                          scalars: dict) -> None:
    index = {n: i for i, n in enumerate(param_names)}
    state: dict[int, dict] = {}
    for key, val in tensors.items():
        _, rest = key.split(".", 1)
        name, sub = rest.rsplit(".", 1)
        if name not in index:
            raise CheckpointError(f"optimizer state names an unknown parameter {name!r}")
        state.setdefault(index[name], {})[sub] = val
    for name, d in scalars.get("state", {}).items():
        state.setdefault(index[name], {}).update(d)
    groups = []
    for g in scalars["param_groups"]:
        g = dict(g)
        tuples = g.pop("_tuples", [])
        for k in tuples:
            g[k] = tuple(g[k])
        g["params"] = [index[n] for n in g["params"]]
        groups.append(g)
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# ----------------------------------------------------------------------------- RNG state
def rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    np_state = np.random.get_state()
    tensors["numpy_keys"] = torch.from_numpy(np.asarray(np_state[1], dtype=np.int64))
    py = random.getstate()
    scalars = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], int(np_state[2]), int(np_state[3]), float(np_state[4])],
    }
    return tensors, scalars


def set_rng_state(tensors: dict[str, torch.Tensor], scalars: dict) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = [tensors[k] for k in sorted(k for k in tensors if k.startswith("torch_cuda_"))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])
    py = scalars["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = scalars["numpy"]
    np.random.set_state((n[0], tensors["numpy_keys"].numpy().astype(np.uint32), n[1], n[2], n[3]))


# ----------------------------------------------------------------------------- save / load
def checkpoint_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / CKPT_DIR


def save_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    *,
    model,
    optimizer: torch.optim.Optimizer | None,
    param_names: list[str] | None = None,
    state: dict | None = None,
    tokenizer=None,
    keep: int = 2,
    _hook=None,
) -> Path:
    """Write checkpoint ``step-<step>`` atomically under ``run_dir/checkpoints``; return its path.

    ``state`` (JSON-able) holds the step, data-loader state, config...; the RNG states are added
    here.  ``_hook(stage)`` is called between stages (tests use it to simulate an interruption).
    """
    from safetensors.torch import save_file

    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:08d}"
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-{name}-"))
    try:
        os.chmod(tmp, 0o777 & ~_umask())
        model.save_pretrained(tmp)
        if _hook:
            _hook("model")
        if optimizer is not None:
            names = param_names or [n for n, _ in model.named_parameters()]
            ot, os_ = optimizer_to_files(optimizer, names)
            save_file(ot, str(tmp / "optimizer.safetensors"))
            _write_json(tmp / "optimizer.json", os_)
        if _hook:
            _hook("optimizer")
        rt, rs = rng_state()
        save_file(rt, str(tmp / "rng.safetensors"))
        full_state = {"format": FORMAT, "step": step, "time": time.time(), "rng": rs, **(state or {})}
        _write_json(tmp / "trainer_state.json", full_state)
        if tokenizer is not None:
            tokenizer.save(tmp)
        if _hook:
            _hook("state")
        files = [f for f in _list_files(tmp) if f != MANIFEST]
        for f in files:
            _fsync_file(tmp / f)
        manifest = {"format": FORMAT, "step": step, "files": {f: sha256_file(tmp / f) for f in files}}
        _write_json(tmp / MANIFEST, manifest)
        _fsync_dir(tmp)
        if _hook:
            _hook("manifest")
        final = root / name
        old = None
        if final.exists():  # the same step written again (e.g. a re-run): move the old one aside first
            old = root / f".old-{name}-{os.getpid()}-{time.time_ns()}"
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync_dir(root)
        if _hook:
            _hook("rename")
        _write_latest(root, name)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _prune(root, keep, current=name)
    return final


def _umask() -> int:
    m = os.umask(0o022)
    os.umask(m)
    return m


def _write_latest(root: Path, name: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=root, prefix=".tmp-latest-")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w") as fh:
            fh.write(name + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, root / LATEST)
        _fsync_dir(root)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _prune(root: Path, keep: int, current: str) -> None:
    """Keep `current` and the `keep - 1` newest checkpoints before it (keep 0: all).  Checkpoints of
    later steps than `current` (left by a run resumed from an older checkpoint, e.g. because the
    newest was corrupt) are neither counted nor removed: the checkpoint resumed from survives."""
    older = sorted(p.name for p in root.glob("step-*") if p.is_dir() and p.name < current)
    for stale in root.glob(".tmp-*"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
    if keep > 0:
        for n in older[: max(0, len(older) - (keep - 1))]:
            shutil.rmtree(root / n, ignore_errors=True)


def _step_of(ck: Path) -> int:
    try:
        return int(ck.name.rpartition("-")[2])
    except ValueError:
        return -1


def _sharded_complete(ck: Path) -> bool:
    return is_sharded_checkpoint(ck) and (ck / STATE_FILE).is_file() and (ck / "config.json").is_file()


def find_sharded_checkpoint(path: str | os.PathLike) -> Path | None:
    """A sharded (DCP) checkpoint folder itself, or the newest complete one under <run>/sharded
    (its `latest`, else the highest step); None when there is none."""
    p = Path(path)
    if is_sharded_checkpoint(p):
        return p
    root = p / SHARDED_DIR
    lp = root / LATEST
    if lp.is_file() and (name := lp.read_text().strip()) and _sharded_complete(root / name):
        return root / name
    steps = sorted((c for c in root.glob("step-*") if _sharded_complete(c)), key=_step_of) if root.is_dir() else []
    return steps[-1] if steps else None


def find_checkpoint(path: str | os.PathLike) -> Path | None:
    """A checkpoint folder (manifest.json, or a sharded DCP checkpoint), or a run folder /
    checkpoints folder -> its newest complete checkpoint: the higher step of the single-file one
    under checkpoints/ and the sharded one under sharded/ (a run resumed on another number of
    processes writes the other kind)."""
    p = Path(path)
    if (p / MANIFEST).is_file():
        return p
    single = _find_single(p)
    sharded = find_sharded_checkpoint(p)
    if sharded is not None and (single is None or _step_of(sharded) > _step_of(single)):
        return sharded
    return single


def _find_single(p: Path) -> Path | None:
    for root in (p / CKPT_DIR, p):
        lp = root / LATEST
        if lp.is_file():
            name = lp.read_text().strip()
            cand = root / name
            if name and (cand / MANIFEST).is_file():
                return cand
            # `latest` must always name a complete checkpoint; fall back to the newest complete one
        steps = sorted(c for c in root.glob("step-*") if (c / MANIFEST).is_file()) if root.is_dir() else []
        if steps:
            return steps[-1]
    return None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    ck = find_checkpoint(p)
    if ck is None:
        raise CheckpointError(f"no complete checkpoint in {path} (no manifest.json)")
    return ck


def verify_checkpoint(ckpt: str | os.PathLike) -> dict:
    """Check every file against the manifest; return the manifest.  Raises CheckpointError."""
    ck = Path(ckpt)
    if is_sharded_checkpoint(ck):  # DCP keeps no hashes: check that it is complete
        for f in (STATE_FILE, "config.json"):
            if not (ck / f).is_file():
                raise CheckpointError(f"sharded checkpoint {ck} is incomplete: {f} is missing")
        return {"format": "dcp", "files": {}}
    try:
        manifest = json.loads((ck / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{ck} is not a checkpoint (no {MANIFEST})") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"corrupt {MANIFEST} in {ck}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{ck / MANIFEST} is not an msakit checkpoint manifest")
    for f, digest in manifest["files"].items():
        if not f or not lies_inside(ck, f):
            raise CheckpointError(f"{ck / MANIFEST} names {f!r}, a file outside {ck}: refused")
        fp = ck / f
        if not fp.is_file():
            raise CheckpointError(f"checkpoint {ck} is incomplete: {f} is missing")
        if sha256_file(fp) != digest:
            raise CheckpointError(f"checkpoint {ck} is corrupt: sha256 of {f} does not match its manifest")
    return manifest


def load_checkpoint_state(ckpt: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor], dict[str, torch.Tensor] | None, dict | None]:
    """-> (trainer_state, rng tensors, optimizer tensors or None, optimizer scalars or None).  Verifies first."""
    from safetensors.torch import load_file

    ck = Path(ckpt)
    verify_checkpoint(ck)
    if is_sharded_checkpoint(ck):  # the RNG is reseeded per rank; the optimizer lies in the shards
        with reading(ck / STATE_FILE, "JSON"):
            state = read_state(ck)
        return check_trainer_state(state, ck / STATE_FILE, rng=False), {}, None, None

    def read(name: str, what: str, load: Any) -> Any:
        path = ck / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {ck} lacks {name}")
        try:
            with reading(path, what):
                return load(path)
        except ModelFolderError as e:
            raise CheckpointError(str(e)) from None

    state = check_trainer_state(read("trainer_state.json", "JSON", lambda p: json.loads(p.read_text())),
                                ck / "trainer_state.json")
    rng = check_rng_tensors(read("rng.safetensors", "safetensors file", lambda p: load_file(str(p))),
                            ck / "rng.safetensors")
    ot = os_ = None
    if (ck / "optimizer.safetensors").is_file():
        ot = read("optimizer.safetensors", "safetensors file", lambda p: load_file(str(p)))
        os_ = read("optimizer.json", "JSON", lambda p: json.loads(p.read_text()))
    return state, rng, ot, os_
