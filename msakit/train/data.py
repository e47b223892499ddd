"""Token streams, packing to the context length with document boundaries, loaders with state.

A `TokenStream` is the corpus split encoded once: every document's tokens followed by one EOS,
concatenated (``tokens`` int32) with the documents' start offsets (``doc_starts``, plus the end).
Files with at least ``long_min_tokens`` tokens are left out of the stream and reported as long
(they belong to the long-context held-out set).

`PackedRows` cuts a stream into rows of ``context`` tokens (the last row padded with EOS, its
padding ignored in the loss) and records, per row, where documents start: ``cu_seqlens`` int32
``[0, s1, ..., context]`` for the model's ``cu_seqlens`` path (positions restart per document and
attention does not cross documents).  ``labels`` follow the HF convention (the model shifts):
the first token of a document that starts inside a row is not a target (-100), since predicting it
from the previous document's end is meaningless under per-document attention; padding is -100 too.

`RowLoader` serves batches of rows in a seeded per-epoch order; its ``state_dict()`` (seed, epoch,
position, dataset fingerprint) restores the exact same sequence of batches after a resume.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from msakit.train.corpus import Corpus, CorpusFile, build_corpus
from msakit.train.tokenizer import Tokenizer, default_cache_dir, train_tokenizer

IGNORE = -100
_ENCODE_BATCH_BYTES = 4 << 20


@dataclass
class TokenStream:
    tokens: np.ndarray  # int32 [N]: doc0 tokens, EOS, doc1 tokens, EOS, ...
    doc_starts: np.ndarray  # int64 [ndocs + 1]: start offsets, last entry = N
    names: list[str]  # the documents' stable names, in stream order
    long: list[str]  # names of files left out as long (>= long_min_tokens tokens)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_docs(self) -> int:
        return len(self.names)

    def fingerprint(self) -> str:
        h = hashlib.sha256(self.tokens.tobytes())
        h.update(self.doc_starts.tobytes())
        return h.hexdigest()[:20]


def _stream_key(tokenizer: Tokenizer, files: Sequence[CorpusFile], max_tokens, long_min_tokens) -> str:
    h = hashlib.sha256(f"stream-v1\0{tokenizer.fingerprint()}\0{max_tokens}\0{long_min_tokens}\n".encode())
    for f in files:
        h.update(f"{f.name}\0{f.size}\n".encode())
    return h.hexdigest()[:20]


def encode_files(
    tokenizer: Tokenizer,
    files: Sequence[CorpusFile],
    *,
    max_tokens: int | None = None,
    long_min_tokens: int = 0,
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
) -> TokenStream:
    """Encode ``files`` in order into one stream (stopping once ``max_tokens`` are reached).

    Files with ``>= long_min_tokens`` tokens (when > 0) are skipped and listed in ``.long``.
    Cached as ``<cache_dir>/tokens-<key>.npz`` (no pickle).
    """
    cdir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    path = cdir / f"tokens-{_stream_key(tokenizer, files, max_tokens, long_min_tokens)}.npz"
    if use_cache and path.is_file():
        try:
            with np.load(path, allow_pickle=False) as z:
                names = [str(s) for s in z["names"]] if z["names"].size else []
                long = [str(s) for s in z["long"]] if z["long"].size else []
                return TokenStream(z["tokens"].astype(np.int32), z["doc_starts"].astype(np.int64), names, long)
        except Exception:
            pass  # damaged cache entry: re-encode
    eos = tokenizer.eos_id
    chunks: list[np.ndarray] = []
    starts = [0]
    names: list[str] = []
    long: list[str] = []
    total = 0
    i = 0
    done = False
    while i < len(files) and not done:
        j, nbytes = i, 0
        cap = _ENCODE_BATCH_BYTES
        if max_tokens is not None:  # do not encode far past the cap (~4 bytes per token of source text)
            cap = min(cap, max(1 << 16, 4 * (max_tokens - total)))
        while j < len(files) and (j == i or nbytes + files[j].size <= cap):
            nbytes += files[j].size
            j += 1
        batch = files[i:j]
        ids_list = tokenizer.encode_batch([f.read() for f in batch])
        for f, ids in zip(batch, ids_list):
            if long_min_tokens > 0 and len(ids) >= long_min_tokens:
                long.append(f.name)
                continue
            if not ids:
                continue
            arr = np.asarray(ids + [eos], dtype=np.int32)
            chunks.append(arr)
            total += arr.shape[0]
            starts.append(total)
            names.append(f.name)
            if max_tokens is not None and total >= max_tokens:
                done = True
                break
        i = j
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int32)
    stream = TokenStream(tokens, np.asarray(starts, dtype=np.int64), names, long)
    if use_cache:
        try:
            cdir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=cdir, prefix=".tmp-", suffix=".npz")
            with os.fdopen(fd, "wb") as fh:
                np.savez(fh, tokens=stream.tokens, doc_starts=stream.doc_starts,
                         names=np.asarray(names, dtype=np.str_), long=np.asarray(long, dtype=np.str_))
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except OSError:
            pass
    return stream


def count_tokens(tokenizer: Tokenizer, files: Sequence[CorpusFile]) -> list[int]:
    """Token counts of ``files`` (for `corpus.split_long`)."""
    return [len(ids) for ids in tokenizer.encode_batch([f.read() for f in files])]


@dataclass
class Batch:
    input_ids: torch.Tensor  # int64 [B, T]
    labels: torch.Tensor  # int64 [B, T] (-100 = ignore)
    cu_seqlens: list[torch.Tensor]  # per row: int32 [nseg + 1]

    def to(self, device) -> "Batch":
        return Batch(self.input_ids.to(device), self.labels.to(device), [c.to(device) for c in self.cu_seqlens])

    def flat(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The B rows as one packed sequence [1, B*T] with cu_seqlens over all segments of all rows."""
        B, T = self.input_ids.shape
        cus = [self.cu_seqlens[0]]
        for r in range(1, B):
            cus.append(self.cu_seqlens[r][1:] + r * T)
        return self.input_ids.reshape(1, B * T), self.labels.reshape(1, B * T), torch.cat(cus).to(torch.int32)

    @property
    def num_targets(self) -> int:
        return int((self.labels[:, 1:] != IGNORE).sum())


class PackedRows:
    """A token stream cut into rows of ``context`` tokens with per-row document boundaries."""

    def __init__(self, stream: TokenStream, context: int, pad_id: int) -> None:
        if context < 2:
            raise ValueError(f"context must be at least 2, got {context}")
        if len(stream) == 0:
            raise ValueError("no tokens to pack (empty split)")
        self.stream = stream
        self.context = context
        self.pad_id = pad_id
        self.n_rows = (len(stream) + context - 1) // context
        self._starts = stream.doc_starts[:-1]

    def __len__(self) -> int:
        return self.n_rows

    @property
    def num_tokens(self) -> int:
        return len(self.stream)

    def fingerprint(self) -> str:
        return f"{self.stream.fingerprint()}-{self.context}"

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Row i -> (input_ids int64 [T], labels int64 [T], cu_seqlens int32 [nseg + 1])."""
        if not 0 <= i < self.n_rows:
            raise IndexError(i)
        T = self.context
        a, b = i * T, min((i + 1) * T, len(self.stream))
        ids = np.full(T, self.pad_id, dtype=np.int64)
        ids[: b - a] = self.stream.tokens[a:b]
        labels = ids.copy()
        lo, hi = np.searchsorted(self._starts, [a, b], side="left")
        inner = self._starts[lo:hi] - a  # document starts inside [a, b)
        inner = inner[inner > 0]
        labels[inner] = IGNORE
        bounds = [0, *inner.tolist()]
        if b - a < T:  # padded tail: its own segment, never a target
            labels[b - a:] = IGNORE
            bounds.append(b - a)
        bounds.append(T)
        return ids, labels, np.asarray(bounds, dtype=np.int32)

    def batch(self, indices: Sequence[int]) -> Batch:
        rows = [self.row(int(i)) for i in indices]
        return Batch(
            torch.from_numpy(np.stack([r[0] for r in rows])),
            torch.from_numpy(np.stack([r[1] for r in rows])),
            [torch.from_numpy(r[2]) for r in rows],
        )


class RowLoader:
    """Endless batches of ``batch_size`` rows; a fresh seeded permutation each epoch (or in order)."""

    def __init__(self, rows: PackedRows, batch_size: int, *, seed: int = 0, shuffle: bool = True) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.rows = rows
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.pos = 0
        self._order = self._make_order(0)

    def _make_order(self, epoch: int) -> np.ndarray:
        n = len(self.rows)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def next_batch(self) -> Batch:
        idx = []
        while len(idx) < self.batch_size:
            if self.pos >= len(self._order):
                self.epoch += 1
                self.pos = 0
                self._order = self._make_order(self.epoch)
            take = min(self.batch_size - len(idx), len(self._order) - self.pos)
            idx.extend(self._order[self.pos:self.pos + take].tolist())
            self.pos += take
        return self.rows.batch(idx)

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "pos": self.pos, "batch_size": self.batch_size,
                "shuffle": self.shuffle, "rows": len(self.rows), "fingerprint": self.rows.fingerprint()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("fingerprint") != self.rows.fingerprint() or state.get("rows") != len(self.rows):
            raise ValueError("the training data differ from the checkpoint's (corpus, tokenizer or context changed); "
                             "cannot resume the same run")
        self.seed = int(state["seed"])
        self.batch_size = int(state["batch_size"])
        self.shuffle = bool(state["shuffle"])
        self.epoch = int(state["epoch"])
        self.pos = int(state["pos"])
        self._order = self._make_order(self.epoch)


def eval_batches(rows: PackedRows, batch_size: int, max_rows: int | None = None) -> list[Batch]:
    """The validation rows in order (the first ``max_rows``), in batches."""
    n = len(rows) if max_rows is None else min(len(rows), max_rows)
    return [rows.batch(range(i, min(n, i + batch_size))) for i in range(0, n, batch_size)]


@dataclass
class PreparedData:
    corpus: Corpus
    tokenizer: Tokenizer
    train: PackedRows
    val: PackedRows
    timings: dict

    def summary(self) -> str:
        return (f"{self.corpus.summary()}; {self.train.num_tokens:,} train tokens in {len(self.train)} rows, "
                f"{self.val.num_tokens:,} validation tokens; vocab {self.tokenizer.vocab_size}")


def prepare_data(
    data: Sequence[str | os.PathLike] | None = None,
    *,
    stdlib: bool = True,
    vocab_size: int = 4096,
    context: int = 512,
    tokenizer: Tokenizer | None = None,
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
    val_fraction: float = 0.02,
    long_min_tokens: int = 32768,
    max_train_tokens: int | None = None,
    max_val_tokens: int | None = None,
    stdlib_root: str | os.PathLike | None = None,
    tokenizer_max_bytes: int | None = None,
) -> PreparedData:
    """Corpus -> tokenizer (trained on the train split, cached; or the one given) -> packed rows.

    Long files (>= long_min_tokens tokens) met while encoding are held out of train and validation
    and recorded in ``corpus.long``.  ``max_train_tokens`` stops encoding the (hash-shuffled)
    training files once that many tokens are in the stream.
    """
    import time


    t0 = time.time()
    corpus = build_corpus(data, stdlib=stdlib, val_fraction=val_fraction,
                          stdlib_root=Path(stdlib_root) if stdlib_root is not None else None)
    t1 = time.time()
    if tokenizer is None:

        tokenizer = train_tokenizer(corpus.train, vocab_size, cache_dir=cache_dir, use_cache=use_cache,
                                    max_bytes=tokenizer_max_bytes)
    t2 = time.time()
    tr = encode_files(tokenizer, corpus.train, max_tokens=max_train_tokens, long_min_tokens=long_min_tokens,
                      cache_dir=cache_dir, use_cache=use_cache)
    va = encode_files(tokenizer, corpus.val, max_tokens=max_val_tokens, long_min_tokens=long_min_tokens,
                      cache_dir=cache_dir, use_cache=use_cache)
    t3 = time.time()
    long_names = set(tr.long) | set(va.long)
    if long_names:
        byname = {f.name: f for f in corpus.train + corpus.val}
        corpus = Corpus(train=[f for f in corpus.train if f.name not in long_names],
                        val=[f for f in corpus.val if f.name not in long_names],
                        long=sorted((byname[n] for n in long_names), key=lambda f: (f.unit(), f.name)),
                        sources=corpus.sources)
    if len(tr) == 0:
        raise ValueError("empty corpus: the training split has no tokens")
    if len(va) == 0:
        raise ValueError("empty validation split: no tokens (add files or raise val_fraction)")
    return PreparedData(corpus, tokenizer, PackedRows(tr, context, tokenizer.eos_id), PackedRows(va, context, tokenizer.eos_id),
                        {"corpus_s": t1 - t0, "tokenizer_s": t2 - t1, "encode_s": t3 - t2})
