"""Cached generation (msakit.generate): equals full recomputation, deterministic under a seed."""

from __future__ import annotations

import pytest
import torch

from msakit.generate import KVCache, generate, generate_uncached, sample_next
from msakit.models import M3ForCausalLM

from toy_model import small_target

pytestmark = pytest.mark.usefixtures("one_thread")


def model_for(mode: str, seed: int = 0) -> M3ForCausalLM:
    return small_target(128, seed, mode)


@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_cached_logits_equal_recomputation(mode: str) -> None:
    model = model_for(mode)
    prompt = torch.randint(0, 128, (2, 9))
    toks, logits = generate(model, prompt, 14, temperature=0, return_logits=True)
    toks2, logits2 = generate_uncached(model, prompt, 14, temperature=0, return_logits=True)
    assert toks.shape == (2, 23) and torch.equal(toks[:, :9], prompt)
    assert logits.shape == (2, 14, 128)
    torch.testing.assert_close(logits, logits2, rtol=1e-4, atol=1e-4)
    assert torch.equal(toks, toks2)
    # and each step's logits are those of one full forward over the final sequence
    full = model(toks[:, :-1], compute_kl=False).logits[:, 8:]
    torch.testing.assert_close(logits, full, rtol=1e-4, atol=1e-4)


def test_sparse_decode_differs_from_dense() -> None:
    prompt = torch.randint(0, 128, (1, 20))
    _, ls = generate(model_for("sparse"), prompt, 3, temperature=0, return_logits=True)
    _, ld = generate(model_for("dense"), prompt, 3, temperature=0, return_logits=True)
    assert (ls - ld).abs().max() > 1e-4


def test_deterministic_under_seed_and_streamer() -> None:
    model = model_for("sparse")
    prompt = torch.randint(0, 128, (2, 5))
    seen: list[torch.Tensor] = []
    a = generate(model, prompt, 10, temperature=1.0, top_k=20, top_p=0.9,
                       generator=torch.Generator().manual_seed(7), streamer=seen.append)
    b = generate(model, prompt, 10, temperature=1.0, top_k=20, top_p=0.9, generator=torch.Generator().manual_seed(7))
    c = generate(model, prompt, 10, temperature=1.0, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert len(seen) == 10 and all(s.shape == (2,) for s in seen)
    assert torch.equal(torch.stack(seen, 1), a[:, 5:])
    class Streamer:  # the transformers streamer protocol
        def __init__(self) -> None:
            self.got: list[torch.Tensor] = []
            self.ended = 0

        def put(self, t: torch.Tensor) -> None:
            self.got.append(t)

        def end(self) -> None:
            self.ended += 1

    s = Streamer()
    d = generate(model, prompt[:1], 3, temperature=0, streamer=s)
    assert s.ended == 1 and torch.equal(torch.stack(s.got, 1), d[:, 5:])
    greedy = generate(model, prompt, 4, temperature=0)
    assert torch.equal(greedy, generate(model, prompt, 4, temperature=0))


def test_eos_stops_early() -> None:
    model = model_for("sparse")
    prompt = torch.randint(0, 128, (1, 5))
    greedy = generate(model, prompt, 6, temperature=0)
    eos = int(greedy[0, 7])
    out = generate(model, prompt, 6, temperature=0, eos_token_id=eos)
    first = (greedy[0, 5:] == eos).nonzero()[0].item()
    assert out.shape[1] == 5 + first + 1 and out[0, -1] == eos


def test_sample_next_filters() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    g = torch.Generator().manual_seed(0)
    assert sample_next(logits, 0).tolist() == [1]
    assert all(sample_next(logits, 1.0, top_k=1, generator=g).item() == 1 for _ in range(5))
    assert all(sample_next(logits, 1.0, top_p=0.01, generator=g).item() == 1 for _ in range(5))
    picks = {sample_next(logits, 1.0, top_k=2, generator=g).item() for _ in range(50)}
    assert picks == {1, 3}
    with pytest.raises(ValueError, match="temperature"):
        sample_next(logits, -1.0)
    with pytest.raises(ValueError, match="top_p"):
        sample_next(logits, 1.0, top_p=0.0)


def test_cache_overflow_and_training_flag() -> None:
    cache = KVCache(1, 4)
    k = torch.zeros(1, 3, 2, 8)
    assert cache.begin(1, 3, k.device).tolist() == [[0, 1, 2]]
    cache.write(0, k, k, None)
    assert cache.view(0).k.shape == (1, 3, 2, 8)  # what the forward wrote, the queries at its end
    cache.end()
    with pytest.raises(ValueError, match="overflow"):
        cache.write(0, k, k, None)
    with pytest.raises(ValueError, match="overflow"):
        cache.begin(1, 2, k.device)
    cache.truncate(1)
    assert cache.length == 1 and cache.begin(2, 3, k.device).tolist() == [[1, 2, 3]] * 2
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(2)
    model = model_for("sparse").train()
    generate(model, torch.randint(0, 128, (1, 3)), 2)
    assert model.training
