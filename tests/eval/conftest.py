"""Fixtures of the eval tests: a tiny byte-level BPE tokenizer and fake models (CPU, tiny)."""

from __future__ import annotations

import pytest

from eval_fakes import tiny_tokenizer


@pytest.fixture(scope="session")
def tok():
    return tiny_tokenizer()
