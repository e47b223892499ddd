"""Safetensors I/O of `M3ForCausalLM` under the HF MiniMax-M3 tensor names.

Names: ``model.embed_tokens.weight``, ``model.layers.{i}.input_layernorm.weight``,
``.self_attn.{q,k,v,o}_proj.weight``, ``.self_attn.{q,k}_norm.weight``,
``.self_attn.index_{q,k}_proj.weight``, ``.self_attn.index_{q,k}_norm.weight``,
``.post_attention_layernorm.weight``, ``.block_sparse_moe.gate.weight`` (fp32),
``.block_sparse_moe.e_score_correction_bias`` (fp32), ``.block_sparse_moe.experts.{e}.w1/w3/w2.weight``,
``.block_sparse_moe.shared_experts.{gate,up,down}_proj.weight``, ``.mlp.{gate,up,down}_proj.weight``,
``model.norm.weight``, ``lm_head.weight``.

Loading accepts a ``language_model.`` prefix (the VL checkpoint's text tower) and skips the
vision / projector / MTP tensors of a VL checkpoint; any other missing, unexpected or
mis-shaped tensor raises ValueError naming a few.  A single ``model.safetensors`` is written up
to `max_shard_size`, above it ``model-0000k-of-0000n.safetensors`` shards plus
``model.safetensors.index.json``; both forms are read, and so is a sharded DCP checkpoint of a
run on several processes (`load_dcp_weights`).  Never pickle.

Every problem with a model folder's files -- a truncated, empty, garbage or absurd-header
safetensors file, an unreadable tokenizer.json, weights holding NaN or inf, tensors that do not fit
the model -- is one error type, `ModelFolderError` (a ValueError), whose one-line message names
the file; `msakit.train.checkpoint.CheckpointError` (damaged training checkpoints) is a kind of it.
`reading(path)` turns the readers' own exceptions (safetensors', tokenizers', transformers') into
it; `check_finite` refuses non-finite weights as they are loaded.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from msakit.models.config import M3Config

__all__ = [
    "ModelFolderError",
    "reading",
    "check_finite",
    "read_tokenizer_file",
    "SINGLE_FILE",
    "INDEX_FILE",
    "hf_state_items",
    "split_stacked",
    "save_weights",
    "save_tensors",
    "load_weights",
    "is_dcp_folder",
    "load_dcp_weights",
    "copy_tensors",
    "weight_files",
    "save_pretrained",
    "load_pretrained",
    "parse_size",
    "few_names",
    "match_names",
    "name_problems",
    "targets_in_files",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DCP_METADATA = ".metadata"  # what marks a torch.distributed.checkpoint folder
_PREFIXES = ("language_model.",)
# Tensors of a VL / MTP checkpoint that the text model does not hold: skipped on load.
_SKIP = re.compile(r"^(vision_tower\.|visual\.|multi_modal_projector\.|patch_merge_mlp\.|mtp\.|model\.mtp\.|"
                   r"model\.layers\.\d+\.(eh_proj|enorm|hnorm|shared_head)\.)")
_STACKED = re.compile(r"^(?P<pre>.*\.block_sparse_moe\.experts)\.(?P<w>w[123])$")
_PER_EXPERT = re.compile(r"^(?P<pre>.*\.block_sparse_moe\.experts)\.(?P<e>\d+)\.(?P<w>w[123])\.weight$")


class ModelFolderError(ValueError):
    """A model folder's file that cannot be used (damaged, of the wrong form, non-finite weights,
    tensors that do not fit the model): a user error, one line naming the file (exit status 2)."""


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


@contextmanager
def reading(path: str | os.PathLike[str], what: str = "safetensors file") -> Iterator[None]:
    """Around reading `what` from `path`: any error but a missing file (FileNotFoundError) and an
    interruption becomes one `ModelFolderError` line naming `path` (safetensors, tokenizers and
    transformers raise their own exception types, some not ValueErrors)."""
    try:
        yield
    except (ModelFolderError, FileNotFoundError):
        raise
    except Exception as e:  # noqa: BLE001 - the readers' own types: SafetensorError, tokenizers' Exception, ...
        msg = _first_line(e)
        if isinstance(e, ValueError) and str(path) in msg:
            raise ModelFolderError(msg) from None
        raise ModelFolderError(f"{path}: cannot read {what}: {msg}") from None


def check_finite(name: str, tensor: torch.Tensor, where: str | os.PathLike[str]) -> None:
    """ModelFolderError when floating-point weight `name` (read from `where`) holds NaN or inf.
    One pass over the tensor; 8-bit float and integer (packed) tensors are not checked."""
    if not tensor.is_floating_point() or tensor.element_size() < 2 or tensor.numel() == 0:
        return
    bad = ~torch.isfinite(tensor)
    if bool(bad.any()):
        raise ModelFolderError(f"{where}: weight {name} holds {int(bad.sum()):,} NaN / inf value(s) of "
                               f"{tensor.numel():,}: the weights are damaged")


def read_tokenizer_file(path: str | os.PathLike[str]) -> Any:
    """The `tokenizers.Tokenizer` of a tokenizer.json file: FileNotFoundError when missing,
    ModelFolderError (naming the file) when it cannot be read."""
    # tokenizers is an optional dependency (msakit[train]): imported only when a tokenizer is loaded
    from tokenizers import Tokenizer

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"tokenizer not found: {p}")
    with reading(p, "tokenizer"):
        return Tokenizer.from_file(str(p))


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string like "5GB", "500MB", "2GiB"."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size < 1:
            raise ValueError(f"max_shard_size must be positive, got {size}")
        return size
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?i?B)?\s*", str(size), re.IGNORECASE)
    if not m:
        raise ValueError(f"max_shard_size must be bytes or like '5GB', got {size!r}")
    unit = (m.group(2) or "B").upper()
    mult = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
            "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return max(1, int(float(m.group(1)) * mult))


def split_stacked(items: Iterable[tuple[str, torch.Tensor]], pattern: re.Pattern[str],
                  name: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, tensor) items with each tensor whose name matches `pattern` split along dim 0
    into views named ``name.format(e=index, **match.groupdict())``; the others unchanged."""
    for n, t in items:
        m = pattern.match(n)
        if m:
            for e in range(t.shape[0]):
                yield name.format(e=e, **m.groupdict()), t[e]
        else:
            yield n, t


def hf_state_items(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs of the model's weights; stacked experts are split per expert (views)."""
    return split_stacked(model.state_dict().items(), _STACKED, "{pre}.{e}.{w}.weight")


def _shards(items: list[tuple[str, torch.Tensor]], limit: int) -> list[list[tuple[str, torch.Tensor]]]:
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in items:
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append((name, t))
        size += n
    return shards


def save_weights(model: nn.Module, folder: str | os.PathLike[str], *, max_shard_size: int | str = "5GB") -> list[Path]:
    """Write the weights as safetensors into `folder`; returns the files written."""
    return save_tensors(hf_state_items(model), folder, max_shard_size=max_shard_size)


def save_tensors(
    items: Iterable[tuple[str, torch.Tensor]], folder: str | os.PathLike[str], *, max_shard_size: int | str = "5GB"
) -> list[Path]:
    """Write (name, tensor) pairs as safetensors into `folder` (single file or shards + index,
    replacing an earlier checkpoint's weight files); returns the files written.  Also used by
    msakit.quant.checkpoint for packed (quantized) tensors."""

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    limit = parse_size(max_shard_size)
    items = list(items)
    shards = _shards(items, limit)
    for old in list(folder.glob("model-*-of-*.safetensors")) + [folder / SINGLE_FILE, folder / INDEX_FILE]:
        if old.exists():
            old.unlink()
    files: list[Path] = []
    weight_map: dict[str, str] = {}
    total = 0
    n = len(shards)
    for k, shard in enumerate(shards, 1):
        fname = SINGLE_FILE if n == 1 else f"model-{k:05d}-of-{n:05d}.safetensors"
        # own, contiguous CPU copies: per-expert views of one stacked tensor must not share memory
        tensors = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in shard}
        save_file(tensors, str(folder / fname), metadata={"format": "pt"})
        files.append(folder / fname)
        for name, t in tensors.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
        del tensors
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        files.append(folder / INDEX_FILE)
    return files


def lies_inside(folder: str | os.PathLike[str], name: str) -> bool:
    """Whether the file `name`, relative to `folder`, lies inside it (not an absolute path, no `..`
    or link out of it)."""
    return not Path(name).is_absolute() and (Path(folder) / name).resolve().is_relative_to(Path(folder).resolve())


def manifest_entries(folder: str | os.PathLike[str]) -> list[tuple[str, str]]:
    """[(tensor name, file name)] of `folder`'s safetensors index ([] without one), each file checked
    to lie inside `folder` (no absolute path, no `..` or link out of it): ValueError otherwise."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if not index.is_file():
        return []
    try:
        items = list(json.loads(index.read_text(encoding="utf-8"))["weight_map"].items())
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise ModelFolderError(f"{index}: not a safetensors index ({e})") from None
    for name, fname in items:
        if not isinstance(fname, str) or not fname:
            raise ModelFolderError(f"{index}: the file of tensor {name!r} is not a file name: {fname!r}")
        if not lies_inside(folder, fname):
            raise ModelFolderError(f"{index}: tensor {name!r} names {fname!r}, a file outside {folder}: refused")
    return items


def weight_files(folder: str | os.PathLike[str]) -> dict[str, list[str]]:
    """{file path: [tensor names]} of a single-file or sharded safetensors checkpoint.  Every file
    the index names must lie inside `folder` (no absolute paths, no `..` out of it, no link out of
    it): ValueError otherwise."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    out: dict[str, list[str]] = {}
    if index.is_file():
        for name, fname in manifest_entries(folder):
            out.setdefault(str(folder / fname), []).append(name)
        for f in out:
            if not Path(f).is_file():
                raise FileNotFoundError(f"shard listed in {index} not found: {f}")
        return out
    single = folder / SINGLE_FILE
    files = [single] if single.is_file() else sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors in {folder}")
    for p in files:
        with reading(p), safe_open(str(p), framework="pt") as f:
            out[str(p)] = list(f.keys())
    return out


def _normalise(name: str) -> str | None:
    """Checkpoint name -> model name, or None for tensors the text model skips."""
    for pre in _PREFIXES:
        if name.startswith(pre):
            name = name[len(pre):]
            break
    if _SKIP.match(name):
        return None
    return name


def few_names(names: Iterable[str], n: int = 6) -> str:
    """The first `n` of the sorted names, comma-separated, with the count when some are left out."""
    names = sorted(names)
    return ", ".join(names[:n]) + (f", ... ({len(names)} in all)" if len(names) > n else "")


def match_names(files: Mapping[str, list[str]], targets: Mapping[str, Any]) -> tuple[set[str], list[str]]:
    """(model names no checkpoint tensor fills, checkpoint names the model has no place for)."""
    found: set[str] = set()
    unexpected: list[str] = []
    for names in files.values():
        for raw in names:
            name = _normalise(raw)
            if name is None:
                continue
            if name in targets:
                found.add(name)
            else:
                unexpected.append(raw)
    return set(targets) - found, unexpected


def name_problems(missing: Iterable[str], unexpected: Iterable[str]) -> list[str]:
    """The "missing ..." / "unexpected ..." phrases of a load error (empty when both are empty)."""
    problems = []
    if missing:
        problems.append(f"missing {few_names(missing)}")
    if unexpected:
        problems.append(f"unexpected {few_names(unexpected)}")
    return problems


def targets_in_files(files: Mapping[str, list[str]], targets: Mapping[str, Any]) -> Iterator[tuple[Any, str, str]]:
    """(open safetensors file, checkpoint name, model name) for each checkpoint tensor the model takes."""

    for fpath, names in files.items():
        with reading(fpath), safe_open(fpath, framework="pt") as f:
            for raw in names:
                name = _normalise(raw)
                if name in targets:
                    yield f, raw, name


def _same_shape(raw: str, name: str, sl: Any, target: torch.Tensor) -> str | None:
    shape = tuple(sl.get_shape())
    return None if shape == tuple(target.shape) else f"{raw} {list(shape)} (model {list(target.shape)})"


@torch.no_grad()
def copy_tensors(
    folder: str | os.PathLike[str],
    targets: Mapping[str, torch.Tensor],
    *,
    what: str = "the model",
    check: Callable[[str, str, Any, torch.Tensor], str | None] = _same_shape,
    mismatch: str = "shape mismatch",
    optional: Callable[[str], bool] | None = None,
    convert: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> set[str]:
    """Copy the safetensors checkpoint in `folder` into `targets` ({model name: tensor}, in place;
    ``copy_`` converts the dtype); returns the optional model names the checkpoint lacks.

    Before copying any tensor, raises ModelFolderError naming the missing, unexpected and mismatched
    tensors; a damaged file or a tensor holding NaN / inf is a ModelFolderError naming the file.  check(checkpoint name, model name, safetensors slice, target): a problem or None
    (default: the shapes must be equal); `mismatch` heads the list of those problems.  optional(model name): may be absent.  convert(loaded,
    target): the tensor to copy (default: the loaded one).
    """
    files = weight_files(folder)
    missing, unexpected = match_names(files, targets)
    absent = {n for n in missing if optional is not None and optional(n)}
    problems = name_problems(missing - absent, unexpected)
    bad = [p for f, raw, name in targets_in_files(files, targets)
           if (p := check(raw, name, f.get_slice(raw), targets[name])) is not None]
    if bad:
        problems.append(f"{mismatch} {few_names(bad, 4)}")
    if problems:
        raise ModelFolderError(f"checkpoint {folder} does not match {what}: " + "; ".join(problems))
    file_of = {raw: fpath for fpath, names in files.items() for raw in names}
    for f, raw, name in targets_in_files(files, targets):
        with reading(file_of[raw]):
            src = f.get_tensor(raw)
        check_finite(raw, src, file_of[raw])
        targets[name].copy_(src if convert is None else convert(src, targets[name]))
    return absent


def is_dcp_folder(folder: str | os.PathLike[str]) -> bool:
    """Whether `folder` is a sharded `torch.distributed.checkpoint` (DCP) checkpoint (its .metadata)."""
    return (Path(folder) / DCP_METADATA).is_file()


@torch.no_grad()
def load_dcp_weights(model: nn.Module, folder: str | os.PathLike[str]) -> None:
    """The model's weights from a DCP checkpoint (``{"model": state dict by parameter name}``, saved
    on any number of ranks; `msakit.distributed.checkpoint.save_sharded`) into an unsharded
    model, on one process without a process group (DCP reshards on load).  ModelFolderError
    naming the folder for a damaged checkpoint, one that does not fit the model or NaN / inf."""
    import torch.distributed.checkpoint as dcp

    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with reading(folder, "the sharded checkpoint"), warnings.catch_warnings():
        # one process without a process group is this function's purpose, not a surprise worth a warning
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": sd}, checkpoint_id=str(folder), no_dist=True)
    for name, t in sd.items():
        check_finite(name, t, folder)
    model.load_state_dict(sd)


def load_weights(model: nn.Module, folder: str | os.PathLike[str]) -> None:
    """Copy a checkpoint's tensors into the model's parameters (dtype converted, in place): a
    safetensors folder, or a sharded DCP checkpoint (`load_dcp_weights`).

    Raises ModelFolderError listing missing, unexpected or mis-shaped tensors before copying any,
    or naming a damaged file or a tensor holding NaN / inf.
    """
    if is_dcp_folder(folder):
        load_dcp_weights(model, folder)
        return
    copy_tensors(folder, dict(hf_state_items(model)))


def save_pretrained(model: Any, path: str | os.PathLike[str], *, max_shard_size: int | str = "5GB") -> None:
    """config.json (with torch_dtype) + weights."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = model.config.replace(torch_dtype=str(model.lm_head.weight.dtype).replace("torch.", ""))
    cfg.save(folder)
    save_weights(model, folder, max_shard_size=max_shard_size)


def load_pretrained(cls: Any, path: str | os.PathLike[str], *, device: Any = None, dtype: torch.dtype | None = None,
                    mode: str = "sparse") -> Any:
    """Build on the meta device, materialise on `device` (CPU default) in `dtype` (float32 default;
    the router stays float32) and load the weights."""
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder not found: {folder}")
    cfg = M3Config.from_pretrained(folder)
    with torch.device("meta"):
        model = cls(cfg, mode=mode, init=False)
    if dtype is not None:
        model.to(dtype)
    model.to_empty(device=torch.device(device) if device is not None else torch.device("cpu"))
    load_weights(model, folder)
    return model
