"""The training corpus: which files, and how they split into train / validation / long held-out.

Default corpus: the ``*.py`` sources of Python's own standard library (found through
``sysconfig.get_paths()["stdlib"]``), without site-packages, ``__pycache__`` and the test-data
folders (``*data*`` directories such as ``test/decimaltestdata``, ``lib2to3/tests/data``), plus any
files or folders the user names.  A named file is always taken; a named folder contributes its
text files (no NUL byte in the first 8 KiB), hidden entries and ``__pycache__`` skipped.

Every file has a stable relative name (``stdlib/json/decoder.py``, ``data/<folder>/<rel>``) that does
not depend on where the corpus lies on disk.  The split is decided by that name alone:
``sha256(name)`` mapped to [0, 1) below ``val_fraction`` -> validation, so adding files never moves
an existing file between splits.  Files with at least ``long_min_tokens`` tokens (counted with the
trained tokenizer, see `split_long`) form the long-context evaluation set and are excluded from
training and from the ordinary validation set.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Sequence

DEFAULT_VAL_FRACTION = 0.02
DEFAULT_LONG_MIN_TOKENS = 32768
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", ".git", ".hg", ".svn", ".tox", ".venv", "node_modules"}


@dataclass(frozen=True)
class CorpusFile:
    """One document: its path on disk, its stable name (used for the split and cache keys), its size."""

    path: Path
    name: str
    size: int

    def read(self) -> str:
        """The file's text; undecodable bytes become U+FFFD (never raises on non-UTF-8 content)."""
        with open(self.path, encoding="utf-8", errors="replace") as fh:
            return fh.read()

    def unit(self) -> float:
        """A number in [0, 1) fixed by the name alone (sha256), used for the split and the order."""
        return _unit(self.name)


def _unit(name: str) -> float:
    h = hashlib.sha256(name.encode("utf-8")).digest()
    return int.from_bytes(h[:8], "big") / 2.0**64


@dataclass
class Corpus:
    """Files by split.  ``train``/``val`` are ordered by the hash of their names (a fixed shuffle)."""

    train: list[CorpusFile]
    val: list[CorpusFile]
    long: list[CorpusFile] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)

    @property
    def files(self) -> list[CorpusFile]:
        return self.train + self.val + self.long

    def fingerprint(self) -> str:
        """sha256 over (name, size) of every file in every split: the key of derived caches."""
        h = hashlib.sha256()
        for split, fs in (("train", self.train), ("val", self.val), ("long", self.long)):
            for f in fs:
                h.update(f"{split}\0{f.name}\0{f.size}\n".encode())
        return h.hexdigest()

    def summary(self) -> str:
        mb = lambda fs: sum(f.size for f in fs) / 1e6  # noqa: E731
        return (f"{len(self.train)} train files ({mb(self.train):.1f} MB), {len(self.val)} validation "
                f"({mb(self.val):.2f} MB), {len(self.long)} long held-out ({mb(self.long):.1f} MB)")


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_data_dir(name: str) -> bool:
    n = name.lower()
    return n == "data" or n.endswith("data") or n.endswith("_data") or n == "testdata"


def stdlib_files(root: Path | None = None) -> list[CorpusFile]:
    """The standard library's ``*.py`` sources (site-packages, caches and test-data folders excluded)."""
    root = Path(root) if root is not None else stdlib_dir()
    if not root.is_dir():
        raise FileNotFoundError(f"standard library folder not found: {root}")
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not _is_data_dir(d) and not d.startswith("."))
        for fn in sorted(filenames):
            if not fn.endswith(".py"):
                continue
            p = Path(dirpath) / fn
            try:
                st = p.stat()
            except OSError:
                continue
            if st.st_size == 0:
                continue
            out.append(CorpusFile(p, "stdlib/" + p.relative_to(root).as_posix(), st.st_size))
    return out


def _looks_text(p: Path) -> bool:
    with open(p, "rb") as fh:
        return b"\0" not in fh.read(8192)


def user_files(paths: Sequence[str | os.PathLike]) -> list[CorpusFile]:
    """Files and folders named by the user.  Missing or unreadable paths raise (one-line errors)."""
    out: list[CorpusFile] = []
    for raw in paths:
        p = Path(raw).expanduser()
        if not p.exists():
            raise FileNotFoundError(f"data path not found: {raw}")
        if p.is_file():
            if not os.access(p, os.R_OK):
                raise PermissionError(f"data file is not readable: {raw}")
            out.append(CorpusFile(p, f"data/{p.name}", p.stat().st_size))
            continue
        if not os.access(p, os.R_OK | os.X_OK):
            raise PermissionError(f"data folder is not readable: {raw}")
        base = p.resolve().name or "root"
        for dirpath, dirnames, filenames in os.walk(p):
            dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
            for fn in sorted(filenames):
                if fn.startswith("."):
                    continue
                f = Path(dirpath) / fn
                try:
                    st = f.stat()
                    if not f.is_file() or st.st_size == 0 or not _looks_text(f):
                        continue
                except OSError:
                    continue  # unreadable entries inside a named folder are skipped, not fatal
                out.append(CorpusFile(f, f"data/{base}/{f.relative_to(p).as_posix()}", st.st_size))
    return out


def is_validation(name: str, val_fraction: float = DEFAULT_VAL_FRACTION) -> bool:
    """The deterministic split: sha256 of the file's stable name below ``val_fraction``."""
    return _unit(name) < val_fraction


def build_corpus(
    data: Sequence[str | os.PathLike] | None = None,
    *,
    stdlib: bool = True,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    stdlib_root: Path | None = None,
) -> Corpus:
    """Collect and split the corpus.  Raises ValueError for an empty corpus or an empty train split."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    files: list[CorpusFile] = []
    sources = []
    if stdlib:
        files += stdlib_files(stdlib_root)
        sources.append(f"python stdlib ({stdlib_root or stdlib_dir()})")
    if data:
        files += user_files(data)
        sources += [str(d) for d in data]
    # one entry per stable name (a file named twice counts once)
    seen: dict[str, CorpusFile] = {}
    for f in files:
        seen.setdefault(f.name, f)
    files = list(seen.values())
    if not files:
        raise ValueError("empty corpus: no readable text files found" + (f" in {', '.join(map(str, data))}" if data else ""))
    files.sort(key=lambda f: (f.unit(), f.name))
    val = [f for f in files if f.unit() < val_fraction]
    train = [f for f in files if f.unit() >= val_fraction]
    if not train:
        raise ValueError(f"empty corpus: all {len(files)} files fell into the validation split")
    if not val and val_fraction > 0:
        # tiny corpora: take the file with the smallest hash as validation so that there is one
        val, train = train[:1], train[1:]
        if not train:
            raise ValueError("corpus too small: need at least two files (one for validation)")
    return Corpus(train=train, val=val, sources=sources)


def split_long(corpus: Corpus, count_tokens, long_min_tokens: int = DEFAULT_LONG_MIN_TOKENS) -> Corpus:
    """Move files with >= long_min_tokens tokens out of train/val into ``corpus.long``.

    ``count_tokens(list[CorpusFile]) -> list[int]``.  Only files with at least ``long_min_tokens``
    bytes can qualify (a byte-level token is at least one byte), so only those are counted.
    """
    if long_min_tokens <= 0:
        return corpus
    cand = [f for f in corpus.train + corpus.val if f.size >= long_min_tokens]
    long_names = set()
    if cand:
        for f, n in zip(cand, count_tokens(cand)):
            if n >= long_min_tokens:
                long_names.add(f.name)
    train = [f for f in corpus.train if f.name not in long_names]
    val = [f for f in corpus.val if f.name not in long_names]
    long = sorted((f for f in corpus.train + corpus.val if f.name in long_names), key=lambda f: (f.unit(), f.name))
    if not train:
        raise ValueError(f"empty training split: every training file has >= {long_min_tokens} tokens")
    return Corpus(train=train, val=val, long=long, sources=corpus.sources)


def iter_texts(files: Iterable[CorpusFile]) -> Iterator[str]:
    for f in files:
        yield f.read()
