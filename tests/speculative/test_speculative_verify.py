"""`msakit.speculative.verify`: the lossless rule reproduces the target distribution (chi-square over
>= 100,000 draws, g = 1..7, disjoint supports, a per-row budget, a Markov target across rounds),
greedy mode, the -1 padding, the confidence-budget scheduler and the shared sampling transform."""

from __future__ import annotations


import pytest
import torch

from msakit.generate import sample_next
from msakit.speculative.verify import confidence_budget, sample_probs, sampling_probs, verify

N = 200_000
ALPHA = 1e-6  # significance of each chi-square test (seeded, so deterministic; tiny to stay robust)

pytestmark = pytest.mark.usefixtures("one_thread")


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value of observed counts against probabilities (cells with tiny
    expected counts are pooled)."""
    counts = counts.double()
    n = counts.sum()
    exp = probs.double() * n
    if bool(((exp < 1e-9) & (counts > 0)).any()):
        return 0.0  # a draw where the target has no mass
    big = exp >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    ex = torch.cat([exp[big], exp[~big].sum().view(1)])
    keep = ex > 0
    obs, ex = obs[keep], ex[keep]
    stat = float(((obs - ex) ** 2 / ex).sum())
    df = max(1, obs.numel() - 1)
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def random_dist(g: int, V: int, gen: torch.Generator, sparsity: float = 0.3) -> torch.Tensor:
    x = torch.rand(g, V, generator=gen, dtype=torch.float64) ** 2
    x = x * (torch.rand(g, V, generator=gen) > sparsity)
    x[torch.arange(g), torch.randint(0, V, (g,), generator=gen)] += 0.05  # never all zero
    return (x / x.sum(-1, keepdim=True)).float()


def draw(q: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    """n independent draws per position from q [g, V] -> [n, g]."""
    return torch.multinomial(q, n, replacement=True, generator=gen).t().contiguous()


def check_positions(p: torch.Tensor, q: torch.Tensor, *, lengths=None, seed: int = 0, rule=verify) -> list[float]:
    """Run the rule on N rows; for every position return the p-value of the emitted tokens there
    against p, and of the accepted-count histogram against its exact law."""
    g, V = q.shape
    gen = torch.Generator().manual_seed(seed)
    d = draw(q, N, gen)
    n, toks = rule(d, q.expand(N, g, V), p.expand(N, g + 1, V), generator=torch.Generator().manual_seed(seed + 1),
                   **({} if lengths is None else {"lengths": lengths}))
    assert n.shape == (N,) and toks.shape == (N, g + 1) and n.dtype == toks.dtype == torch.int64
    pv = []
    for i in range(g + 1):
        col = toks[:, i]
        emitted = col >= 0
        assert torch.equal(emitted, n >= i)  # the accepted drafts, the extra token, then -1
        if int(emitted.sum()) >= 1000:
            pv.append(chi2_pvalue(torch.bincount(col[emitted], minlength=V), p[i]))
    # law of the accepted count: P(n >= k) = prod_{i<k} beta_i, beta_i = sum min(p_i, q_i)
    beta = torch.minimum(p[:g], q).sum(-1).double()
    if lengths is None:
        surv = torch.cat([torch.ones(1, dtype=torch.float64), torch.cumprod(beta, 0)])
        law = surv - torch.cat([surv[1:], torch.zeros(1, dtype=torch.float64)])
        pv.append(chi2_pvalue(torch.bincount(n, minlength=g + 1), law))
    return pv


@pytest.mark.parametrize("g", [1, 2, 3, 4, 5, 6, 7])
def test_verify_reproduces_target(g: int) -> None:
    gen = torch.Generator().manual_seed(100 + g)
    V = 7
    for trial in range(2):
        p = random_dist(g + 1, V, gen)
        q = random_dist(g, V, gen)
        pv = check_positions(p, q, seed=10 * g + trial)
        assert min(pv) > ALPHA, (g, trial, pv)


def test_verify_disjoint_support() -> None:
    V, g = 6, 4
    p = torch.zeros(g + 1, V)
    q = torch.zeros(g, V)
    p[:, :3] = torch.tensor([0.5, 0.3, 0.2])
    q[:, 3:] = torch.tensor([0.1, 0.6, 0.3])
    gen = torch.Generator().manual_seed(0)
    d = draw(q, N, gen)
    n, toks = verify(d, q.expand(N, g, V), p.expand(N, g + 1, V), generator=gen)
    assert int(n.max()) == 0  # nothing q proposes has target mass
    assert bool((toks[:, 1:] == -1).all())
    assert chi2_pvalue(torch.bincount(toks[:, 0], minlength=V), p[0]) > ALPHA
    # and the other way round: p inside q's support with q spread wider
    q2 = torch.full((g, V), 1.0 / V)
    pv = check_positions(p, q2, seed=5)
    assert min(pv) > ALPHA, pv


def test_verify_identical_and_onehot() -> None:
    V, g = 5, 3
    gen = torch.Generator().manual_seed(3)
    p = random_dist(g + 1, V, gen)
    q = p[:g].clone()
    pv = check_positions(p, q, seed=7)  # p == q: everything accepted, the bonus from p_(g+1)
    assert min(pv) > ALPHA
    # one-hot drafts at T > 0 (argmax drafting): exact when q is the one-hot it really is
    oh = torch.nn.functional.one_hot(q.argmax(-1), V).float()
    pv = check_positions(p, oh, seed=8)
    assert min(pv) > ALPHA, pv


def test_verify_with_budget_lengths() -> None:
    """A per-row verify length chosen independently of the drafts keeps the output exact."""
    V, g = 6, 6
    gen = torch.Generator().manual_seed(11)
    p = random_dist(g + 1, V, gen)
    q = random_dist(g, V, gen)
    lengths = torch.randint(0, g + 1, (N,), generator=gen)
    pv = check_positions(p, q, lengths=lengths, seed=12)
    assert min(pv) > ALPHA, pv
    gen2 = torch.Generator().manual_seed(12)
    d = draw(q, N, gen2)
    n, toks = verify(d, q.expand(N, g, V), p.expand(N, g + 1, V), generator=torch.Generator().manual_seed(13),
                     lengths=lengths)
    assert bool((n <= lengths).all())
    # rows verified to length l behave like g = l: the token after l accepted drafts is a bonus from p_(l+1)
    full = n == lengths
    for l in range(g + 1):
        rows = full & (lengths == l)
        if int(rows.sum()) > 2000:
            assert chi2_pvalue(torch.bincount(toks[rows, l], minlength=V), p[l]) > ALPHA


def test_wrong_rules_are_detected() -> None:
    """The test has power: two classic bugs fail it."""
    V, g = 6, 3
    gen = torch.Generator().manual_seed(21)
    p = random_dist(g + 1, V, gen)
    q = random_dist(g, V, gen)

    def residual_from_p(d, qq, pp, *, generator=None, **kw):  # bug: resample from p, not max(0, p - q)
        n, toks = verify(d, qq, pp, generator=generator, **kw)
        fresh = sample_probs(pp[torch.arange(d.shape[0]), n.clamp(max=g)], generator)
        toks = toks.clone()
        rej = n < g
        toks[rej, n[rej]] = fresh[rej]
        return n, toks

    def no_q(d, qq, pp, *, generator=None, **kw):  # bug: q treated as 1 (argmax-style acceptance)
        return verify(d, torch.ones_like(qq), pp, generator=generator, **kw)

    assert min(check_positions(p, q, seed=22, rule=residual_from_p)) < 1e-12
    assert min(check_positions(p, q, seed=23, rule=no_q)) < 1e-12


def test_markov_target_across_rounds() -> None:
    """Joint law of two emitted tokens when the target and the drafter depend on the previous
    token, the second token coming from the first round or, after a rejection, from a second."""
    V, g = 5, 2
    gen = torch.Generator().manual_seed(31)
    P = random_dist(V, V, gen, sparsity=0.2)  # target P[prev] -> next
    Q = random_dist(V, V, gen, sparsity=0.2)  # drafter Q[prev] -> next
    x0 = 2
    rng = torch.Generator().manual_seed(32)
    acc = torch.Generator().manual_seed(33)

    def round_(anchor: torch.Tensor):
        d1 = torch.multinomial(Q[anchor], 1, generator=rng).squeeze(1)
        d2 = torch.multinomial(Q[d1], 1, generator=rng).squeeze(1)
        d = torch.stack([d1, d2], 1)
        qs = torch.stack([Q[anchor], Q[d1]], 1)
        ps = torch.stack([P[anchor], P[d1], P[d2]], 1)
        return verify(d, qs, ps, generator=acc)

    anchor = torch.full((N,), x0)
    n, toks = round_(anchor)
    y1 = toks[:, 0]
    n2, toks2 = round_(y1)
    y2 = torch.where(n >= 1, toks[:, 1], toks2[:, 0])
    joint = torch.bincount(y1 * V + y2, minlength=V * V)
    exact = (P[x0].unsqueeze(1) * P).reshape(-1)
    assert chi2_pvalue(joint, exact) > ALPHA


def test_greedy_mode() -> None:
    logits = torch.tensor([[[0.1, 2.0, 0.0], [3.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, 5.0, 0.0]],
                           [[0.1, 2.0, 0.0], [3.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, 5.0, 0.0]]])
    d = torch.tensor([[1, 0, 2], [1, 1, 2]])
    n, toks = verify(d, None, logits, greedy=True)
    assert n.tolist() == [3, 1]
    assert toks.tolist() == [[1, 0, 2, 1], [1, 0, -1, -1]]
    n, toks = verify(d, None, logits, greedy=True, lengths=torch.tensor([2, 3]))
    assert n.tolist() == [2, 1] and toks.tolist() == [[1, 0, 2, -1], [1, 0, -1, -1]]


def test_verify_errors_and_dtypes() -> None:
    d = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="g \\+ 1"):
        verify(d, torch.rand(2, 3, 4), torch.rand(2, 3, 4))
    with pytest.raises(ValueError, match="draft_probs is required"):
        verify(d, None, torch.rand(2, 4, 4))
    with pytest.raises(ValueError, match="draft_probs must have shape"):
        verify(d, torch.rand(2, 2, 4), torch.rand(2, 4, 4))
    # bf16 inputs are promoted: the same decisions as their float32 values
    p = torch.rand(2, 4, 4).softmax(-1).bfloat16()
    q = torch.rand(2, 3, 4).softmax(-1).bfloat16()
    a = verify(d, q, p, generator=torch.Generator().manual_seed(0))
    b = verify(d, q.float(), p.float(), generator=torch.Generator().manual_seed(0))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_predrawn_randomness() -> None:
    """uniforms / noise drawn beforehand (as the CUDA-graph round does) in the order verify draws
    them give the same result as the generator; shapes are checked; the rule stays lossless."""
    gen = torch.Generator().manual_seed(3)
    B, g, V = 64, 4, 11
    p = torch.rand(B, g + 1, V, generator=gen).softmax(-1)
    q = torch.rand(B, g, V, generator=gen).softmax(-1)
    d = torch.multinomial(q.reshape(-1, V), 1, generator=gen).view(B, g)
    a = verify(d, q, p, generator=torch.Generator().manual_seed(7))
    g2 = torch.Generator().manual_seed(7)
    u = torch.rand((B, g), generator=g2)
    e = torch.empty(B, V).exponential_(generator=g2)
    b = verify(d, q, p, uniforms=u, noise=e)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(ValueError, match="uniforms must have shape"):
        verify(d, q, p, uniforms=u[:, :2], noise=e)
    with pytest.raises(ValueError, match="noise must have the shape"):
        verify(d, q, p, uniforms=u, noise=e[:, :3])
    pr = torch.tensor([0.5, 0.0, 0.2, 0.3])
    noise = torch.empty(N, 4).exponential_(generator=torch.Generator().manual_seed(2))
    draws = sample_probs(pr.expand(N, 4), noise=noise)
    assert chi2_pvalue(torch.bincount(draws, minlength=4), pr) > ALPHA

    def rule(d_, q_, p_, *, generator):
        n_ = d_.shape[0]
        uu = torch.rand((n_, d_.shape[1]), generator=generator)
        ee = torch.empty(n_, p_.shape[-1]).exponential_(generator=generator)
        return verify(d_, q_, p_, uniforms=uu, noise=ee)

    gen = torch.Generator().manual_seed(11)
    pv = check_positions(random_dist(4, 9, gen), random_dist(3, 9, gen), rule=rule)
    assert min(pv) > ALPHA


def test_sampling_probs_matches_sample_next() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=gen) * 3
    for t, k, p in [(1.0, None, None), (0.7, 5, None), (1.3, None, 0.8), (0.9, 10, 0.5)]:
        probs = sampling_probs(logits, t, k, p)
        assert torch.allclose(probs.sum(-1), torch.ones(3))
        draws = torch.stack([sample_next(logits, t, k, p, torch.Generator().manual_seed(s)) for s in range(400)], 1)
        support = probs > 0
        assert bool(support.gather(1, draws).all())  # sample_next never leaves the support
        if k is not None:
            assert bool((support.sum(-1) <= k).all())
    assert torch.equal(sampling_probs(logits, 0.0).argmax(-1), logits.argmax(-1))
    # sample_probs is an exact sampler
    pr = torch.tensor([0.5, 0.0, 0.2, 0.3])
    draws = sample_probs(pr.expand(N, 4), torch.Generator().manual_seed(1))
    assert chi2_pvalue(torch.bincount(draws, minlength=4), pr) > ALPHA


def test_confidence_budget() -> None:
    c = torch.tensor([[0.9, 0.9, 0.5, 0.1], [0.6, 0.2, 0.9, 0.9]])
    # flat verify cost: every draft with positive survival raises the expected tokens per round
    assert confidence_budget(c, (1.0, 0.0)).tolist() == [4, 4]
    # prohibitive per-position cost: verify nothing (anchor only)
    assert confidence_budget(c, (0.0, 1.0)).tolist() == [0, 0]
    # hand check with cost 1 + 0.25 m over B=2 rows: survivals row0 .9 .81 .405 .0405, row1 .6 .12 .108 .0972
    lens = confidence_budget(c, (1.0, 0.25))
    surv = torch.cumprod(c, 1).reshape(-1).sort(descending=True).values
    theta = [(2 + float(surv[:m].sum())) / (1 + 0.25 * (2 + m)) for m in range(9)]
    m_star = next((m for m in range(8) if theta[m + 1] <= theta[m]), 8)
    assert int(lens.sum()) == m_star and lens.tolist() == [2, 1]
    # each row's admitted set is a prefix and lengths never exceed g
    big = torch.rand(64, 7, generator=torch.Generator().manual_seed(0))
    lens = confidence_budget(big, (1.0, 0.02))
    assert bool(((lens >= 0) & (lens <= 7)).all())
    # callable cost, max_len
    assert confidence_budget(c, lambda n: 1.0 + 0.0 * n, max_len=2).tolist() == [2, 2]
