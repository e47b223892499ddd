"""msakit.sampling: the one temperature / top-k / top-p transform and its two draws."""

from __future__ import annotations

import math

import pytest
import torch

from msakit.sampling import check_sampling, filter_logits, sample_next, sample_probs, sampling_probs

EPS32 = torch.finfo(torch.float32).eps


def _naive_probs(row: torch.Tensor, t: float, k: int | None, p: float | None) -> tuple[torch.Tensor, bool]:
    """One row in float64, token by token: (probabilities, True where a top-p cut is too close
    to call in float32)."""
    z = row.double() / t
    V = z.numel()
    keep = torch.ones(V, dtype=torch.bool)
    if k is not None and k < V:
        kth = sorted(z.tolist(), reverse=True)[k - 1]
        keep &= z >= kth
    close = False
    if p is not None and p < 1:
        q = torch.where(keep, z, torch.full_like(z, -math.inf)).softmax(0)
        before = 0.0
        for i in sorted(range(V), key=lambda i: -z[i].item()):
            close |= abs(before - p) < 1e-4
            if before >= p:
                keep[i] = False
            before += q[i].item()
    return torch.where(keep, z, torch.full_like(z, -math.inf)).softmax(0), close


@pytest.mark.parametrize("t, k, p", [(1.0, None, None), (0.7, 5, None), (1.3, None, 0.8), (0.9, 8, 0.6),
                                     (1.0, 1, None), (2.0, 100, 1.0), (0.5, None, 0.05)])
def test_sampling_probs_matches_naive(t: float, k: int | None, p: float | None) -> None:
    g = torch.Generator().manual_seed(0)
    V = 64
    logits = torch.randn(6, V, generator=g) * 3
    probs = sampling_probs(logits, t, k, p)
    assert probs.dtype == torch.float32 and probs.shape == logits.shape
    tol = 8 * V * EPS32  # float32 softmax over V terms against a float64 one
    for r in range(logits.shape[0]):
        ref, close = _naive_probs(logits[r], t, k, p)
        if close:
            continue
        torch.testing.assert_close(probs[r].double(), ref, rtol=0, atol=tol)
    # the filtered logits are the log of the same distribution (up to a constant)
    torch.testing.assert_close(filter_logits(logits, t, k, p).softmax(-1), probs, rtol=0, atol=tol)


def test_leading_dims_and_dtypes() -> None:
    logits = torch.randn(2, 3, 40, dtype=torch.bfloat16)
    probs = sampling_probs(logits, 0.8, 4, 0.9)
    assert probs.shape == (2, 3, 40) and probs.dtype == torch.float32
    assert torch.equal(probs, sampling_probs(logits.float(), 0.8, 4, 0.9))
    assert ((probs > 0).sum(-1) <= 4).all() and ((probs > 0).sum(-1) >= 1).all()


def test_greedy() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    assert torch.equal(sampling_probs(logits, 0), torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))
    assert sample_next(logits, 0).tolist() == [1, 0]
    with pytest.raises(ValueError, match="temperature"):
        filter_logits(logits, 0)


def test_top_p_keeps_at_least_one_token() -> None:
    logits = torch.tensor([[5.0, 1.0, 0.0, -1.0]])
    probs = sampling_probs(logits, 1.0, None, 1e-6)
    assert torch.equal(probs, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    g = torch.Generator().manual_seed(1)
    assert all(sample_next(logits, 1.0, top_p=1e-6, generator=g).item() == 0 for _ in range(5))


def _frequencies(draw, n: int, V: int) -> torch.Tensor:
    counts = torch.bincount(draw(n).flatten(), minlength=V).double()
    return counts / counts.sum()


@pytest.mark.parametrize("sampler", ["sample_next", "sample_probs"])
def test_draws_follow_the_distribution(sampler: str) -> None:
    """Both draws: frequencies within 5 standard errors of sampling_probs; filtered tokens never."""
    V, n = 12, 20_000
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(2)) * 2
    probs = sampling_probs(logits, 0.9, 6, 0.95)[0].double()
    g = torch.Generator().manual_seed(3)
    rows = logits.expand(n, V)
    if sampler == "sample_next":
        freq = _frequencies(lambda m: sample_next(rows, 0.9, 6, 0.95, generator=g), n, V)
    else:
        p = sampling_probs(rows, 0.9, 6, 0.95)
        freq = _frequencies(lambda m: sample_probs(p, g), n, V)
    se = (probs * (1 - probs) / n).sqrt()
    assert (freq[probs == 0] == 0).all()
    assert ((freq - probs).abs() <= 5 * se + 1e-12).all(), (freq, probs)


def test_sample_probs_noise_and_zero_mass() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0]]).expand(64, 4)
    noise = torch.empty(64, 4).exponential_(generator=torch.Generator().manual_seed(4))
    a, b = sample_probs(probs, noise=noise), sample_probs(probs, noise=noise)
    assert torch.equal(a, b) and set(a.tolist()) <= {1, 2}
    zero = torch.zeros(64, 4)  # a draw of exactly 0 must not pick a zero-probability token
    assert set(sample_probs(probs, noise=zero).tolist()) <= {1, 2}
    with pytest.raises(ValueError, match="noise"):
        sample_probs(probs, noise=noise[:, :3])


def test_no_op_filters() -> None:
    logits = torch.randn(3, 10)
    base = sampling_probs(logits, 1.0)
    assert torch.equal(sampling_probs(logits, 1.0, 10, 1.0), base)
    assert torch.equal(sampling_probs(logits, 1.0, 50), base)


@pytest.mark.parametrize("kw, name", [(dict(temperature=-1.0), "temperature"), (dict(temperature=True), "temperature"),
                                      (dict(top_k=0), "top_k"), (dict(top_k=2.0), "top_k"),
                                      (dict(top_k=True), "top_k"), (dict(top_p=0.0), "top_p"),
                                      (dict(top_p=1.5), "top_p")])
def test_bad_arguments_named(kw: dict, name: str) -> None:
    args = dict(temperature=1.0, top_k=None, top_p=None) | kw
    with pytest.raises(ValueError, match=name):
        check_sampling(**args)
    with pytest.raises(ValueError, match=name):
        sampling_probs(torch.zeros(1, 4), **args)
    with pytest.raises(ValueError, match=name):
        sample_next(torch.zeros(1, 4), **args)


def test_bad_logits_named() -> None:
    with pytest.raises(ValueError, match="logits"):
        sampling_probs(torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="logits"):
        sample_next(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="logits"):
        sampling_probs(torch.zeros(2, 0))


def test_keyword_options_defaults_order_and_unknown_names():
    from msakit.sampling import keyword_options

    got = keyword_options({"top_k": 5}, {"temperature": 1.0, "top_k": None}, "f")
    assert list(got.items()) == [("temperature", 1.0), ("top_k", 5)]
    with pytest.raises(ValueError, match="f takes temperature, top_k; got topk"):
        keyword_options({"topk": 5}, {"temperature": 1.0, "top_k": None}, "f")


def test_uncached_and_same_engine_loops_refuse_unknown_options():
    from msakit.generate import generate_uncached
    from msakit.speculative import autoregressive_generate

    ids = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="generate_uncached takes"):
        generate_uncached(None, ids, 1, temprature=0)
    with pytest.raises(ValueError, match="autoregressive_generate takes"):
        autoregressive_generate(None, ids, 1, temprature=0)
