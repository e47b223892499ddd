"""Corpus discovery and split, tokenizer determinism and caching, packing with document boundaries."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from msakit.train import corpus as C
from msakit.train.data import IGNORE, Batch, PackedRows, RowLoader, TokenStream, encode_files, prepare_data
from msakit.train.tokenizer import EOS, Tokenizer, train_tokenizer

STDLIB = Path(sysconfig.get_paths()["stdlib"])
FILES = ["json/decoder.py", "json/encoder.py", "json/scanner.py", "textwrap.py", "fnmatch.py", "bisect.py",
         "heapq.py", "colorsys.py", "glob.py", "keyword.py"]


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    for n in FILES:
        (d / n.replace("/", "_")).write_text((STDLIB / n).read_text())
    (d / "sub").mkdir()
    (d / "sub" / "latin1.py").write_bytes("# caf\xe9 \xff\xfe not utf-8\nx = 1\n".encode("latin-1"))
    (d / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    (d / "__pycache__").mkdir()
    (d / "__pycache__" / "x.py").write_text("cached = 1\n")
    return d


def test_stdlib_corpus_default_excludes_site_packages_and_data_dirs():
    files = C.stdlib_files()
    names = [f.name for f in files]
    assert len(files) > 500
    assert "stdlib/json/decoder.py" in names
    assert all(n.startswith("stdlib/") and n.endswith(".py") for n in names)
    assert not any("site-packages" in n or "__pycache__" in n for n in names)
    assert not any("/decimaltestdata/" in n or "/data/" in n for n in names)


def test_split_is_deterministic_by_name(small_dir):
    a = C.build_corpus([small_dir], stdlib=False, val_fraction=0.3)
    b = C.build_corpus([str(small_dir)], stdlib=False, val_fraction=0.3)
    assert [f.name for f in a.train] == [f.name for f in b.train] and [f.name for f in a.val] == [f.name for f in b.val]
    assert a.val and a.train
    for f in a.val:
        assert C.is_validation(f.name, 0.3)
    names = {f.name for f in a.files}
    assert f"data/{small_dir.name}/sub/latin1.py" in names
    assert not any(n.endswith("blob.bin") or "__pycache__" in n for n in names)  # binary and cache skipped
    # the stdlib split uses the same rule: ~2% validation, stable under a reordering of discovery
    full = C.build_corpus(None)
    frac = len(full.val) / len(full.files)
    assert 0.005 < frac < 0.05
    assert all(C.is_validation(f.name) for f in full.val) and not any(C.is_validation(f.name) for f in full.train)


def test_empty_and_missing_corpus_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty corpus"):
        C.build_corpus([tmp_path / "empty"], stdlib=False)
    with pytest.raises(FileNotFoundError, match="not found"):
        C.build_corpus([tmp_path / "nope"], stdlib=False)


def test_tokenizer_deterministic_cached_and_handles_bad_utf8(small_dir, tmp_path):
    corpus = C.build_corpus([small_dir], stdlib=False, val_fraction=0.1)
    t1 = train_tokenizer(corpus.train, 300, cache_dir=tmp_path / "c1")
    t2 = train_tokenizer(corpus.train, 300, cache_dir=tmp_path / "c2")
    assert t1.to_str() == t2.to_str()  # same corpus -> same vocab, merges
    assert t1.vocab_size == 300 and t1.eos_id == 0
    cached = list((tmp_path / "c1").glob("tokenizer-*/tokenizer.json"))
    assert len(cached) == 1
    t3 = train_tokenizer(corpus.train, 300, cache_dir=tmp_path / "c1")  # from the cache
    assert t3.to_str() == t1.to_str()
    other = train_tokenizer(corpus.train, 320, cache_dir=tmp_path / "c1")  # key includes the vocab size
    assert other.vocab_size == 320 and len(list((tmp_path / "c1").glob("tokenizer-*"))) == 2
    text = "def f(x):\n    return x + 1  # ünïcode \ufffd\n"
    assert t1.decode(t1.encode(text)) == text
    assert t1.encode(EOS) == [t1.eos_id]
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(corpus.train, 100, cache_dir=tmp_path / "c1")
    p = t1.save(tmp_path / "tok")
    assert Tokenizer.load(p.parent).to_str() == t1.to_str()
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read tokenizer"):
        Tokenizer.load(tmp_path / "bad.json")


def _stream(docs: list[list[int]], eos: int = 0) -> TokenStream:
    toks, starts = [], [0]
    for d in docs:
        toks += d + [eos]
        starts.append(len(toks))
    return TokenStream(np.asarray(toks, np.int32), np.asarray(starts, np.int64), [f"d{i}" for i in range(len(docs))], [])


def test_packing_cu_seqlens_and_labels():
    docs = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16, 17]]
    # stream: 1 2 3 0 | 4 5 6 7 8 9 10 0 | 11 12 0 | 13 14 15 16 17 0   (21 tokens)
    rows = PackedRows(_stream(docs), context=8, pad_id=0)
    assert len(rows) == 3
    ids, labels, cu = rows.row(0)
    assert ids.tolist() == [1, 2, 3, 0, 4, 5, 6, 7]
    assert cu.tolist() == [0, 4, 8]
    assert labels.tolist() == [1, 2, 3, 0, IGNORE, 5, 6, 7]  # a document's first token is no target
    ids, labels, cu = rows.row(1)
    assert ids.tolist() == [8, 9, 10, 0, 11, 12, 0, 13]
    assert cu.tolist() == [0, 4, 7, 8]
    assert labels.tolist() == [8, 9, 10, 0, IGNORE, 12, 0, IGNORE]
    ids, labels, cu = rows.row(2)  # the tail: 5 real tokens, 3 padding
    assert ids.tolist() == [14, 15, 16, 17, 0, 0, 0, 0]
    assert cu.tolist() == [0, 5, 8]
    assert labels.tolist() == [14, 15, 16, 17, 0, IGNORE, IGNORE, IGNORE]
    # every segment of every row holds tokens of one document (or padding) only
    stream = rows.stream
    doc_of = np.searchsorted(stream.doc_starts, np.arange(len(stream)), side="right") - 1
    for r in range(len(rows)):
        _, _, cu = rows.row(r)
        for a, b in zip(cu[:-1], cu[1:]):
            g0, g1 = r * 8 + a, min(r * 8 + b, len(stream))
            if g0 < g1:
                assert len(set(doc_of[g0:g1].tolist())) == 1
    b = rows.batch([0, 1])
    ids, labels, cu = b.flat()
    assert ids.shape == (1, 16) and cu.tolist() == [0, 4, 8, 12, 15, 16] and cu.dtype == torch.int32
    assert b.num_targets == int((b.labels[:, 1:] != IGNORE).sum())


def test_loader_state_restores_the_same_batches():
    rows = PackedRows(_stream([[i] * (i % 7 + 1) for i in range(1, 60)]), context=8, pad_id=0)
    a = RowLoader(rows, 3, seed=5)
    seq = [a.next_batch().input_ids for _ in range(7)]  # crosses an epoch boundary
    b = RowLoader(rows, 3, seed=5)
    for _ in range(3):
        b.next_batch()
    st = json.loads(json.dumps(b.state_dict()))
    c = RowLoader(rows, 3, seed=123)
    c.load_state_dict(st)
    for i in range(3, 7):
        assert torch.equal(c.next_batch().input_ids, seq[i])
    other = PackedRows(_stream([[1, 2, 3]] * 10), context=8, pad_id=0)
    with pytest.raises(ValueError, match="differ"):
        RowLoader(other, 3).load_state_dict(st)


def test_encode_files_holds_out_long_files_and_caps(small_dir, tmp_path):
    corpus = C.build_corpus([small_dir], stdlib=False, val_fraction=0.1)
    tok = train_tokenizer(corpus.train, 300, cache_dir=tmp_path)
    sizes = {f.name: len(tok.encode(f.read())) for f in corpus.train}
    limit = sorted(sizes.values())[-2]  # the two longest are "long"
    s = encode_files(tok, corpus.train, long_min_tokens=limit, cache_dir=tmp_path)
    assert sorted(s.long) == sorted(n for n, v in sizes.items() if v >= limit)
    assert len(s) == sum(v + 1 for n, v in sizes.items() if v < limit)
    assert (s.tokens[s.doc_starts[1:] - 1] == tok.eos_id).all()  # one EOS after each document
    s2 = encode_files(tok, corpus.train, long_min_tokens=limit, cache_dir=tmp_path)  # cached copy
    assert np.array_equal(s.tokens, s2.tokens) and s2.long == s.long
    capped = encode_files(tok, corpus.train, max_tokens=100, cache_dir=tmp_path, use_cache=False)
    assert len(capped) >= 100 and capped.doc_starts[-2] < 100  # stops right after crossing the cap
    pd = prepare_data([small_dir], stdlib=False, vocab_size=300, context=64, cache_dir=tmp_path, val_fraction=0.1,
                      long_min_tokens=limit)
    val_long = encode_files(tok, corpus.val, long_min_tokens=limit, use_cache=False).long
    assert {f.name for f in pd.corpus.long} == set(s.long) | set(val_long)
    assert not {f.name for f in pd.corpus.train} & set(s.long)
    assert isinstance(pd.train.batch([0]), Batch)
