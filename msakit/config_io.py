"""HF ``config.json`` in and out, and the field readers every config class shares.

Standard library only (importing it does not import torch), so that `msakit.cost` can use it
while standing alone; `msakit.models` re-exports these names as the public config I/O of the
package.  Every reader raises ValueError naming the field; the file readers name the file.

    raw, path = read_config_json("ckpt/")            # ckpt/config.json or a *.json path
    cfg = load_config_file("ckpt/", MyConfig.from_dict)
    write_config_json("out/", cfg.to_dict())         # out/config.json (folder created)
    get_field(cfg, "rms_norm_eps", 1e-6)             # value, or the default if missing or null
    get_int_field(cfg, "num_hidden_layers")          # int; ValueError if missing or not integral
    check_fixed_fields(cfg, [("use_qk_norm", True)]) # ValueError for an unsupported boolean
    get_rotary_dim(cfg, head_dim)                    # rotary_dim / partial_rotary_factor
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, TypeVar

__all__ = [
    "read_config_json",
    "write_config_json",
    "load_config_file",
    "get_field",
    "get_int_field",
    "check_fixed_fields",
    "get_rotary_dim",
]

T = TypeVar("T")


def read_config_json(source: str | os.PathLike[str], what: str = "config") -> tuple[Any, Path]:
    """The parsed JSON of a folder's ``config.json`` (or the file itself), and the file's path.

    FileNotFoundError ("<what> not found: PATH") for a missing file, ValueError for bad JSON.
    """
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    return raw, path


def write_config_json(path: str | os.PathLike[str], d: Mapping[str, Any]) -> Path:
    """Write `d` as config.json into a folder (created) or to a *.json path; returns the file."""
    p = Path(path)
    if p.suffix != ".json":
        p.mkdir(parents=True, exist_ok=True)
        p = p / "config.json"
    else:
        p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(d, indent=2) + "\n", encoding="utf-8")
    return p


def load_config_file(source: str | os.PathLike[str], parse: Callable[[Any], T],
                     what: str = "config") -> T:
    """``parse(raw)`` on a config file read by `read_config_json`; its ValueErrors name the file."""
    raw, path = read_config_json(source, what)
    try:
        return parse(raw)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def get_field(cfg: Mapping[str, Any], key: str, default: Any) -> Any:
    """``cfg[key]``, or `default` where the key is missing or null."""
    v = cfg.get(key)
    return default if v is None else v


def get_int_field(cfg: Mapping[str, Any], key: str, default: int | None = None,
                  *, required: bool = True) -> int:
    """``cfg[key]`` as an int.

    Missing or null: `default` if given, else ValueError naming the field when `required`,
    else 0.  A bool, a non-number or a non-integral float is a ValueError naming the field.
    """
    v = cfg.get(key)
    if v is None:
        if default is not None:
            return default
        if required:
            raise ValueError(f"config is missing required field '{key}'")
        return 0
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
        raise ValueError(f"config field '{key}' must be an integer, got {v!r}")
    return int(v)


def check_fixed_fields(cfg: Mapping[str, Any], fixed: Sequence[tuple[str, bool]]) -> None:
    """ValueError for any boolean field whose value (missing: the wanted one) is not the wanted one."""
    for key, want in fixed:
        v = get_field(cfg, key, want)
        if bool(v) != want:
            raise ValueError(f"config field '{key}'={v!r} is unsupported (only {want} is implemented)")


def get_rotary_dim(cfg: Mapping[str, Any], head_dim: int, *, check: bool = False) -> int:
    """``rotary_dim``, else ``partial_rotary_factor`` x `head_dim`, else ``head_dim // 2``.

    With `check`, both fields given must agree (ValueError otherwise).
    """
    rotary = cfg.get("rotary_dim")
    prf = cfg.get("partial_rotary_factor")
    if rotary is None:
        rotary = int(round(head_dim * float(prf))) if prf is not None else head_dim // 2
    elif check and prf is not None and int(round(head_dim * float(prf))) != rotary:
        raise ValueError(f"inconsistent config: rotary_dim={rotary} but partial_rotary_factor={prf} x "
                         f"head_dim={head_dim} = {head_dim * float(prf):g}")
    return rotary
