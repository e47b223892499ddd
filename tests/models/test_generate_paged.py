"""Paged generation (generate(cache="paged"): PagedKVCache + msa_decode) equals the contiguous
cache token for token, in sparse and dense mode, with a dense GQA layer among MSA layers."""

from __future__ import annotations

import pytest
import torch

from msakit.generate import PagedDecoder, generate, paged_supported
from msakit.models import M3Config, M3ForCausalLM
from msakit.ops.dispatch import interpret_mode

from toy_model import paged_model

BACKENDS = ["reference"] + (["triton"] if (torch.cuda.is_available() or interpret_mode()) else [])
DEV = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.usefixtures("one_thread")


def model_for(mode: str, seed: int = 0) -> M3ForCausalLM:
    # layer 0 dense GQA, layers 1-2 MSA
    return paged_model(mode, seed, DEV)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_paged_equals_contiguous(mode: str, backend: str) -> None:
    model = model_for(mode)
    assert paged_supported(model) is None
    prompt = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1)).to(DEV)
    toks, logits = generate(model, prompt, 8, temperature=0, return_logits=True, cache="contiguous")
    toks_p, logits_p = generate(model, prompt, 8, temperature=0, return_logits=True, cache="paged",
                                decode_backend=backend)
    assert torch.equal(toks, toks_p)
    torch.testing.assert_close(logits_p, logits, rtol=1e-3, atol=1e-3)


def test_paged_sparse_differs_from_dense() -> None:
    prompt = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(2)).to(DEV)
    _, ls = generate(model_for("sparse"), prompt, 3, temperature=0, return_logits=True, cache="paged",
                     decode_backend="reference")
    _, ld = generate(model_for("dense"), prompt, 3, temperature=0, return_logits=True, cache="paged",
                     decode_backend="reference")
    assert (ls - ld).abs().max() > 1e-4


def test_paged_decoder_pages_and_nq() -> None:
    """The decoder's cache holds prompt + new tokens per row; several new tokens in one step
    (nq = 3) give the logits of the contiguous path's multi-token step."""
    from msakit.generate import KVCache

    model = model_for("sparse")
    prompt = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(3)).to(DEV)
    new = torch.randint(0, 256, (2, 3), generator=torch.Generator().manual_seed(4)).to(DEV)
    dec = PagedDecoder(model, 2, 40, backend="reference")
    l0 = dec.prefill(prompt)
    l1 = dec.step(new)
    assert [dec.cache.length(s) for s in dec.seq_ids] == [36, 36]
    assert dec.cache.index_layers == (1, 2)
    kv = KVCache(3, 40)
    r0 = model(prompt, cache=kv, logits_to_keep=1).logits[:, -1]
    r1 = model(new, cache=kv, logits_to_keep=1).logits[:, -1]
    torch.testing.assert_close(l0, r0)
    torch.testing.assert_close(l1, r1, rtol=1e-4, atol=1e-4)


def test_cache_argument_checks() -> None:
    model = model_for("sparse")
    prompt = torch.zeros(1, 4, dtype=torch.long, device=DEV)
    with pytest.raises(ValueError, match="cache must be one of"):
        generate(model, prompt, 2, cache="ring")
    # "auto" is contiguous off CUDA; M3ForCausalLM.generate passes cache through
    assert generate(model, prompt, 2, temperature=0, cache="paged").shape == (1, 6)
    bad = M3ForCausalLM(M3Config.preset("tiny", vocab_size=64, num_hidden_layers=2, index_block_size=8,
                                        index_topk_blocks=2), mode="sparse").to(DEV)
    assert "block size" in paged_supported(bad)
    with pytest.raises(ValueError, match="not supported"):
        generate(bad, prompt, 2, cache="paged")
    assert generate(bad, prompt, 2, temperature=0).shape == (1, 6)
