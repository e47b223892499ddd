"""`speculative_generate`: greedy output equals plain greedy decoding token for token, the KV
rollback (target cache and drafter context), the sampled output's distribution, the confidence
budget, eos, and bad input."""

from __future__ import annotations

import pytest
import torch

from msakit.generate import generate
from msakit.models import M3ForCausalLM
from msakit.speculative import DSparkDrafter, speculative_generate
from msakit.speculative.generate import SpecCache, draft_context_update, draft_hidden, target_forward
from msakit.speculative.verify import sampling_probs
from spec_helpers import bigram_pair

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_greedy_equals_plain_decoding(mode: str) -> None:
    t, d = bigram_pair(mode)
    prompt = torch.randint(0, 64, (3, 9), generator=torch.Generator().manual_seed(0))
    ref = generate(t, prompt, 48, temperature=0)
    for kw in [{}, {"num_drafts": 3}, {"confidence_budget": True, "budget_cost": (1.0, 0.3)}]:
        out, st = speculative_generate(t, d, prompt, 48, temperature=0, return_stats=True, **kw)
        assert out.shape == ref.shape
        assert torch.equal(out, ref), kw
        # the rounds really mixed acceptances and rejections (rollbacks happened)
        assert 0 < st.accepted_drafts < st.verified_drafts, (kw, st.as_dict())
        assert st.accepted_length > 1.5
    # the same with an untrained (random) drafter: almost everything is rejected
    torch.manual_seed(3)
    rnd = DSparkDrafter(d.config).bind(t)
    out = speculative_generate(t, rnd, prompt, 20, temperature=0)
    assert torch.equal(out, ref[:, :29])


def test_kv_rollback() -> None:
    """After verifying junk and rolling back to per-row lengths, the cache continues exactly
    like a cache that only ever saw the kept tokens (target logits and drafter blocks)."""
    t, d = bigram_pair("sparse")
    gen = torch.Generator().manual_seed(4)
    B = 2
    prompt = torch.randint(0, 64, (B, 11), generator=gen)
    junk = torch.randint(0, 64, (B, 6), generator=gen)
    keep = [2, 5]  # row 0 keeps 2 of the 6 new tokens, row 1 keeps 5
    cache = SpecCache(2, 1, B, 64, torch.device("cpu"))
    _, tap = target_forward(t, cache, prompt, d.config.target_layer_ids)
    draft_context_update(d, cache, tap)
    cache.set_lengths(torch.full((B,), 11), [11] * B)
    _, tap = target_forward(t, cache, junk, d.config.target_layer_ids)
    draft_context_update(d, cache, tap)
    cache.rollback([11 + k for k in keep])
    nxt = torch.randint(0, 64, (B, 4), generator=gen)
    logits, _ = target_forward(t, cache, nxt, d.config.target_layer_ids)
    h = draft_hidden(d, cache, nxt[:, 0])
    with pytest.raises(ValueError, match="rollback"):
        cache.rollback([100, 0])
    for b in range(B):
        seq = torch.cat([prompt[b], junk[b, :keep[b]], nxt[b]]).unsqueeze(0)
        full = t(seq, compute_kl=False).logits[0, -4:]
        torch.testing.assert_close(logits[b], full, rtol=1e-4, atol=1e-4)
        fresh = SpecCache(2, 1, 1, 64, torch.device("cpu"))
        L = 11 + keep[b]
        _, tap = target_forward(t, fresh, seq[:, :L], d.config.target_layer_ids)
        draft_context_update(d, fresh, tap)
        fresh.set_lengths(torch.tensor([L]), [L])
        torch.testing.assert_close(draft_hidden(d, fresh, nxt[b:b + 1, 0])[0], h[b], rtol=1e-4, atol=1e-4)


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    counts, exp = counts.double(), probs.double() * counts.sum()
    if bool(((exp < 1e-9) & (counts > 0)).any()):
        return 0.0
    big = exp >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    ex = torch.cat([exp[big], exp[~big].sum().view(1)])
    obs, ex = obs[ex > 0], ex[ex > 0]
    stat = float(((obs - ex) ** 2 / ex).sum())
    df = max(1, obs.numel() - 1)
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


@pytest.mark.parametrize("budget", [False, True])
def test_sampled_output_distribution(budget: bool) -> None:
    """T = 1 with top-k 8: the joint law of generated tokens 2 and 3 (both from speculative
    rounds; token 3 from the first round or, after a rejection, the second) is the target's."""
    t, d = bigram_pair("sparse", head_scale=4.0)
    V, N, K = 64, 6000, 8
    prompt = torch.randint(0, V, (1, 5), generator=torch.Generator().manual_seed(5))
    out, st = speculative_generate(t, d, prompt.expand(N, 5), 3, temperature=1.0, top_k=K, return_stats=True,
                                   generator=torch.Generator().manual_seed(6), confidence_budget=budget,
                                   budget_cost=(float(N), 0.15))  # per row: fixed 1, 0.15 per position
    assert 0 < st.accepted_drafts < st.verified_drafts
    y1, y2, y3 = out[:, 5], out[:, 6], out[:, 7]
    with torch.no_grad():
        p1 = sampling_probs(t(prompt, compute_kl=False).logits[0, -1], 1.0, K)
        # condition on the most frequent first token (its law given the prompt is checked too)
        assert _chi2_pvalue(torch.bincount(y1, minlength=V), p1) > 1e-6
        a = int(torch.bincount(y1, minlength=V).argmax())
        rows = y1 == a
        seq = torch.cat([prompt.expand(V, 5), torch.full((V, 1), a), torch.arange(V).view(V, 1)], 1)
        lg = t(seq, compute_kl=False).logits
        p2 = sampling_probs(lg[0, -2], 1.0, K)
        p3 = sampling_probs(lg[:, -1], 1.0, K)  # [V(y2), V]
        joint = (p2.unsqueeze(1) * p3).reshape(-1)
    counts = torch.bincount(y2[rows] * V + y3[rows], minlength=V * V)
    assert int(rows.sum()) > 1000
    assert _chi2_pvalue(counts, joint) > 1e-6


def test_eos_and_streamer() -> None:
    t, d = bigram_pair("sparse")
    prompt = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(7))
    ref = generate(t, prompt, 30, temperature=0)
    eos = int(ref[0, 6 + 4])  # row 0's 5th new token
    seen = []
    out = speculative_generate(t, d, prompt, 30, temperature=0, eos_token_id=eos, streamer=seen.append)
    ref_eos = generate(t, prompt, 30, temperature=0, eos_token_id=eos)
    first = (ref[0, 6:] == eos).nonzero()[0, 0]
    assert torch.equal(out[0, :6 + first + 1], ref[0, :6 + first + 1])
    assert bool((out[0, 6 + first + 1:] == eos).all())
    n = min(out.shape[1], ref_eos.shape[1])
    assert torch.equal(out[:, :n], ref_eos[:, :n])
    assert sum(len(s[0]) for s in seen) == first + 1  # streamed tokens of row 0 end at the eos
    assert speculative_generate(t, d, prompt, 0).shape == (2, 6)


def test_bad_input() -> None:
    t, d = bigram_pair("sparse")
    prompt = torch.randint(0, 64, (1, 5))
    with pytest.raises(ValueError, match="exceeds the drafter's trained block"):
        speculative_generate(t, d, prompt, 4, num_drafts=8)
    other = M3ForCausalLM(t.config.replace(vocab_size=80)).eval()
    with pytest.raises(ValueError, match="vocabulary mismatch"):
        speculative_generate(other, d, prompt, 4)
    deep = DSparkDrafter(d.config.replace(target_layer_ids=[0, 3]))
    with pytest.raises(ValueError, match="beyond the target's depth"):
        speculative_generate(t, deep, prompt, 4)
    nc = DSparkDrafter(d.config.replace(enable_confidence_head=False))
    with pytest.raises(ValueError, match="confidence head"):
        speculative_generate(t, nc, prompt, 4, confidence_budget=True)
    with pytest.raises(ValueError, match="temperature"):
        speculative_generate(t, d, prompt, 4, temperature=-1)
    with pytest.raises(ValueError, match="token ids"):
        speculative_generate(t, d, torch.tensor([[1, 64]]), 4)


def test_same_engine_plain_decoding_and_chunked_prefill(monkeypatch) -> None:
    import msakit.speculative.generate as sg
    from msakit.speculative import autoregressive_generate

    t, d = bigram_pair("sparse")
    prompt = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(8))
    ref = generate(t, prompt, 20, temperature=0)
    assert torch.equal(autoregressive_generate(t, prompt, 20, temperature=0), ref)
    monkeypatch.setattr(sg, "PREFILL_CHUNK", 5)  # the prompt prefilled in 3 pieces
    assert torch.equal(speculative_generate(t, d, prompt, 20, temperature=0), ref)
    assert torch.equal(autoregressive_generate(t, prompt, 20, temperature=0), ref)


@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_paged_cache_equals_contiguous(mode: str, monkeypatch) -> None:
    """cache="paged": the target's keys in a PagedKVCache (pages = blocks of 16), verify forwards
    of up to 8 positions per row through msa_decode (sparse-mode MSA layers), the prompt's chunks
    over the gathered pages: greedy output equals plain greedy decoding (rollbacks included),
    the same-engine plain loop too; sampled output is reproducible from its seed."""
    import msakit.nn.core as dec  # the core calls msa_decode for paged sparse layers

    calls = []
    real = dec.msa_decode

    def counting(*a, **kw):
        calls.append(a[0].shape[1])  # nq
        return real(*a, **kw)

    monkeypatch.setattr(dec, "msa_decode", counting)
    t, d = bigram_pair(mode, block=16)
    prompt = torch.randint(0, 64, (3, 9), generator=torch.Generator().manual_seed(0))
    ref = generate(t, prompt, 40, temperature=0)
    for kw in [{}, {"confidence_budget": True, "budget_cost": (1.0, 0.3)}]:
        out, st = speculative_generate(t, d, prompt, 40, temperature=0, return_stats=True, cache="paged", **kw)
        assert torch.equal(out, ref), kw
        assert 0 < st.accepted_drafts < st.verified_drafts
    from msakit.speculative import autoregressive_generate

    assert torch.equal(autoregressive_generate(t, prompt, 40, temperature=0, cache="paged"), ref)
    assert (mode == "sparse") == bool(calls) and all(n <= 8 for n in calls)
    g = torch.Generator()  # sampled: the same seed, the same tokens (pooled run state reused or not)
    a = speculative_generate(t, d, prompt, 12, temperature=1.0, generator=g.manual_seed(5), cache="paged")
    b = speculative_generate(t, d, prompt, 12, temperature=1.0, generator=g.manual_seed(5), cache="paged",
                             cuda_graph=False)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="cache must be one of"):
        speculative_generate(t, d, prompt, 4, cache="ring")
    small, sd = bigram_pair(mode)  # blocks of 4: smaller than msa_decode's pages
    with pytest.raises(ValueError, match="not supported"):
        speculative_generate(small, sd, prompt, 4, cache="paged")
