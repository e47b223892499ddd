"""Byte-level BPE tokenizer trained with the `tokenizers` package, cached on disk.

The tokenizer is trained on the training split's texts (`train_from_iterator` over files opened
with ``errors="replace"``: ``Tokenizer.train(files)`` aborts on non-UTF-8 files) with the byte
alphabet as its initial alphabet, so every input encodes.  One special token, ``<|endoftext|>``
(id 0), separates documents and ends generated text.

Cache: ``<cache_dir>/tokenizer-<key>/tokenizer.json`` with ``key = sha256(file list with sizes,
vocab size, format version)``; the cache dir is ``$MSAKIT_CACHE`` or ``~/.cache/msakit`` unless given.
Training is deterministic: the same corpus and vocabulary size give the same vocabulary.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Iterable, Sequence

from msakit.models.io import read_tokenizer_file
from msakit.train.corpus import CorpusFile

EOS = "<|endoftext|>"
_EOS_NAMES = (EOS, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")
_FORMAT = "msakit-bpe-v1"
TOKENIZER_FILE = "tokenizer.json"


def default_cache_dir() -> Path:
    env = os.environ.get("MSAKIT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "msakit"


class Tokenizer:
    """A thin wrapper over `tokenizers.Tokenizer` with the EOS id and batch encoding."""

    def __init__(self, tok, eos_id: int | None = None) -> None:
        self._tok = tok
        if eos_id is None:
            for name in _EOS_NAMES:  # msakit's own first, then the usual HF spellings
                eos_id = tok.token_to_id(name)
                if eos_id is not None:
                    break
        if eos_id is None:
            raise ValueError(f"tokenizer has no end-of-text token (looked for {', '.join(_EOS_NAMES)})")
        self.eos_id: int = int(eos_id)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def to_str(self) -> str:
        return self._tok.to_str()

    def fingerprint(self) -> str:
        return hashlib.sha256(self.to_str().encode()).hexdigest()

    def save(self, path: str | os.PathLike) -> Path:
        """Write ``tokenizer.json`` into folder ``path`` (or to the file ``path`` if it ends in .json)."""
        p = Path(path)
        if p.suffix != ".json":
            p.mkdir(parents=True, exist_ok=True)
            p = p / TOKENIZER_FILE
        _atomic_write_text(p, self.to_str())
        return p

    @classmethod
    def load(cls, path: str | os.PathLike, eos_id: int | None = None) -> "Tokenizer":
        p = Path(path)
        return cls(read_tokenizer_file(p / TOKENIZER_FILE if p.is_dir() else p), eos_id)


class TextStreamer:
    """`streamer(tokens [B])` for `model.generate`: decodes row 0 incrementally to a text stream
    (holding back an incomplete UTF-8 sequence until its last byte arrives); stops at EOS.
    `push(token)` feeds one token id (what the speculative streamer adapter calls)."""

    def __init__(self, tokenizer, stream=None, eos_id: int | None = None) -> None:
        self.tok = tokenizer
        self.stream = stream if stream is not None else sys.stdout
        self.eos_id = eos_id
        self.ids: list[int] = []
        self.printed = 0
        self.done = False

    def __call__(self, tokens) -> None:
        self.push(int(tokens.reshape(-1)[0]))

    def push(self, t: int) -> None:
        if self.done:
            return
        if self.eos_id is not None and t == self.eos_id:
            self.done = True
            return
        self.ids.append(t)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return
        self.stream.write(text[self.printed:])
        self.stream.flush()
        self.printed = len(text)

    def text(self) -> str:
        return self.tok.decode(self.ids)


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
    try:
        m = os.umask(0o022)
        os.umask(m)
        os.fchmod(fd, 0o666 & ~m)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def cache_key(files: Sequence[CorpusFile], vocab_size: int) -> str:
    h = hashlib.sha256(f"{_FORMAT}\0{vocab_size}\n".encode())
    for f in files:
        h.update(f"{f.name}\0{f.size}\n".encode())
    return h.hexdigest()[:20]


def _build(files: Sequence[CorpusFile], vocab_size: int):
    from tokenizers import Tokenizer as _Tok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = _Tok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def texts():
        for f in files:
            yield f.read()

    tok.train_from_iterator(texts(), trainer=trainer, length=len(files))
    return tok


MIN_VOCAB = 257  # the 256 byte symbols + EOS


def train_tokenizer(
    files: Sequence[CorpusFile],
    vocab_size: int,
    *,
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
    max_bytes: int | None = None,
) -> Tokenizer:
    """Train (or load from the cache) a byte-level BPE of ``vocab_size`` entries on ``files``
    (only the first files up to ``max_bytes`` in total, when given: a quicker, still deterministic fit)."""
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB} (256 bytes + EOS), got {vocab_size}")
    if not files:
        raise ValueError("cannot train a tokenizer on an empty file list")
    if max_bytes is not None:
        take, total = [], 0
        for f in files:
            if take and total + f.size > max_bytes:
                break
            take.append(f)
            total += f.size
        files = take
    cdir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    path = cdir / f"tokenizer-{cache_key(files, vocab_size)}" / TOKENIZER_FILE
    if use_cache and path.is_file():
        try:
            return Tokenizer.load(path)
        except ValueError:
            pass  # a damaged cache entry is rebuilt
    tok = Tokenizer(_build(files, vocab_size))
    if use_cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tok.save(path)
            meta = {"format": _FORMAT, "vocab_size": vocab_size, "files": len(files)}
            _atomic_write_text(path.parent / "meta.json", json.dumps(meta))
        except OSError:
            pass  # a read-only cache is not an error
    return tok
