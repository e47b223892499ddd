"""Long documents for the loss-by-position evaluation.

Default source: the ``.py`` files of Python's standard library (``sysconfig`` stdlib path;
site-packages, ``__pycache__`` and test-data folders left out), each file one document (files are
never concatenated).  A document of at least `length` tokens (under the evaluated model's
tokenizer) gives one window: its first `length` tokens.  Files are taken in a fixed order, the
sha256 of their relative name salted with the seed, so the choice does not depend on where the
library lies on disk.  Other sources: any files or folders (their text files) given as `paths`.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

__all__ = ["Document", "candidate_files", "long_documents", "stdlib_root"]

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", ".git", "node_modules"}
BYTES_PER_TOKEN_MIN = 1  # a byte-level token holds at least one byte: shorter files are not tokenized


@dataclass(frozen=True)
class Document:
    """A window of one file: its stable name and its first `len(ids)` tokens."""

    name: str
    ids: list[int]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _text_files(folder: Path, suffixes: Sequence[str] | None) -> Iterable[Path]:
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".") and "data" not in d)
        for f in sorted(filenames):
            if suffixes is None or any(f.endswith(s) for s in suffixes):
                yield Path(dirpath) / f


def candidate_files(paths: Sequence[str | os.PathLike[str]] | None = None) -> list[tuple[str, Path]]:
    """(stable name, path) of every document file: the stdlib's ``.py`` files, or the given
    files and folders (every non-hidden file of a folder)."""
    out: list[tuple[str, Path]] = []
    if not paths:
        root = stdlib_root()
        for p in _text_files(root, (".py",)):
            out.append((f"stdlib/{p.relative_to(root).as_posix()}", p))
        return out
    for raw in paths:
        p = Path(raw).expanduser()
        if p.is_file():
            out.append((p.name, p))
        elif p.is_dir():
            for f in _text_files(p, None):
                out.append((f"{p.name}/{f.relative_to(p).as_posix()}", f))
        else:
            raise FileNotFoundError(f"document path {p} does not exist")
    return out


def _order_key(seed: int, name: str) -> bytes:
    return hashlib.sha256(f"{seed}\0{name}".encode()).digest()


def long_documents(encode: Callable[[str], list], length: int, n: int, *, seed: int = 0,
                   paths: Sequence[str | os.PathLike[str]] | None = None) -> list[Document]:
    """Up to `n` documents of at least `length` tokens, each cut to its first `length` tokens."""
    if length < 2 or n < 1:
        raise ValueError(f"length must be >= 2 and n >= 1, got length={length}, n={n}")
    files = sorted(candidate_files(paths), key=lambda t: _order_key(seed, t[0]))
    docs: list[Document] = []
    for name, path in files:
        if path.stat().st_size < BYTES_PER_TOKEN_MIN * length:
            continue
        with open(path, "rb") as fh:
            raw = fh.read()
        if b"\0" in raw[:8192]:
            continue
        ids = encode(raw.decode("utf-8", errors="replace"))
        if len(ids) >= length:
            docs.append(Document(name, list(ids[:length])))
            if len(docs) == n:
                break
    return docs
