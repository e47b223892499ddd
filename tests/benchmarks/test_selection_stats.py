"""tools/bench/selection_stats.py (statistics of block selections) and the real-like selection
kind of benchmarks/selections.py (contract, determinism, the statistics its parameters set, the fit)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.selections import (RealLike, fit_real_like, real_like_block_idx, stats_distance,  # noqa: E402
                                   trained_like_block_idx)
from tools.bench import selection_stats as S  # noqa: E402


def by_hand(rows: list[list[int]], topk: int) -> torch.Tensor:
    """block_idx [1, 1, T, topk] from per-query lists (-1 padded)."""
    return torch.tensor([r + [-1] * (topk - len(r)) for r in rows], dtype=torch.int32).view(1, 1, len(rows), topk)


def test_statistics_of_a_hand_made_selection():
    # block 4: queries 0-3 in block 0, 4-7 in block 1, 8-11 in block 2, 12-15 in block 3
    rows = [[0]] * 4 + [[0, 1]] * 4 + [[0, 2]] * 2 + [[1, 2]] * 2 + [[0, 3]] * 4
    st = S.selection_stats(by_hand(rows, 2), 4, tiles=(4, 8))
    # neighbour pairs: 3 x {0}{0}, {0}{0,1} 1/2, 3 x same, {0,1}{0,2} 1/3, same, {0,2}{1,2} 1/3, same,
    # {1,2}{0,3} 0, 3 x same
    want = (3 + 0.5 + 3 + 1 / 3 + 1 + 1 / 3 + 1 + 0 + 3) / 15
    assert st["jaccard"]["mean"] == pytest.approx(want)
    assert st["union"]["4"]["mean"] == pytest.approx((1 + 2 + 3 + 2) / 4)
    assert st["union"]["8"]["max"] == 4
    # distances: own block always (16 selections at 0), block 0 from blocks 1, 2, 3 (4 + 2 + 4 at
    # 1, 2, 3), block 1 from block 2 (2 at 1)
    assert st["distance"]["bins"][:3] == ["0", "1", "2-3"]
    assert st["distance"]["hist"][:3] == [16, 6, 6]
    # popularity: block 0 is taken by 10 of the 12 later queries, block 1 by 2 of 8, block 2 by 0 of 4
    assert st["popularity"]["top_block_share_mean"] == pytest.approx(10 / 12)
    assert st["popularity"]["blocks_never_selected"] == pytest.approx(1 / 3)
    assert sum(st["popularity"]["share_hist"]) == 3
    json.dumps(st)  # JSON-ready


def test_constant_and_independent_selections():
    T, bs, K = 512, 16, 4
    const = torch.tensor([0, 1, 2, 3], dtype=torch.int32).expand(1, 2, T, K).clone()
    const[:, :, : 4 * bs] = by_hand([[b for b in range(min(4, i // bs + 1))] for i in range(4 * bs)], K)
    st = S.selection_stats(const, bs)
    assert st["jaccard"]["p50"] == 1.0 and st["union"]["128"]["p50"] == 4
    g = torch.Generator().manual_seed(0)
    rand = torch.randint(0, 4, (1, 2, T, K), generator=g, dtype=torch.int32)
    assert S.selection_stats(rand, bs)["jaccard"]["mean"] < st["jaccard"]["mean"]


def test_checks_and_cli(tmp_path):
    with pytest.raises(ValueError, match="block_idx"):
        S.selection_stats(torch.zeros(2, 3, 4), 4)
    with pytest.raises(ValueError, match="block_idx"):
        S.selection_stats(torch.zeros(1, 1, 4, 2), 4)  # floating
    with pytest.raises(ValueError, match="block_size"):
        S.selection_stats(torch.zeros(1, 1, 4, 2, dtype=torch.int32), 0)
    bi = trained_like_block_idx(300, block_size=16, topk=4, groups=2)
    torch.save({"block_idx": bi, "block_size": 16}, tmp_path / "a.pt")
    torch.save(bi, tmp_path / "b.pt")
    S.main([str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "--block-size", "16", "--out", str(tmp_path / "s.json"),
            "--plot", str(tmp_path / "s.png")])
    data = json.loads((tmp_path / "s.json").read_text())
    assert set(data) == {str(tmp_path / "a.pt"), str(tmp_path / "b.pt")}
    assert (tmp_path / "s.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        S.main([str(tmp_path / "b.pt"), "--out", str(tmp_path / "t.json")])  # no block size anywhere
    S.main([str(tmp_path / "a.pt"), "--out", str(tmp_path / "f.json"), "--fit", "--local-blocks", "1"])
    fit = json.loads((tmp_path / "f.json").read_text())[str(tmp_path / "a.pt")]["real_like_fit"]
    assert set(fit["params"]) >= {"churn", "p_hot", "dist_alpha"} and fit["distance"] >= 0


@pytest.mark.parametrize("T,bs,topk,local,init", [(700, 16, 8, 1, 0), (129, 8, 16, 2, 1), (1, 8, 4, 1, 0)])
def test_real_like_follows_the_contract(T, bs, topk, local, init, monkeypatch):
    import benchmarks.selections as sel

    monkeypatch.setattr(sel, "REAL_LIKE_CHUNK", 64)  # several chunks: the slots carry over
    par = RealLike(local_blocks=local, init_blocks=init, churn=0.2, hot_blocks=3, p_hot=0.4)
    bi = real_like_block_idx(T, block_size=bs, topk=topk, batch=2, groups=3, params=par, seed=3)
    assert bi.dtype == torch.int32 and bi.shape == (2, 3, T, topk)
    for row_b in range(2):
        for r in range(3):
            for i in range(T):
                row = bi[row_b, r, i].tolist()
                own = i // bs
                n = sum(x >= 0 for x in row)
                assert all(x == -1 for x in row[n:]) and row[:n] == sorted(set(row[:n])), row
                assert all(0 <= x <= own for x in row[:n]) and n == min(topk, own + 1), row
                forced = {own - d for d in range(local) if own - d >= 0} | {b for b in range(init) if b <= own}
                assert forced <= set(row[:n]), row
    again = real_like_block_idx(T, block_size=bs, topk=topk, batch=2, groups=3, params=par, seed=3)
    assert torch.equal(bi, again)  # deterministic in the seed
    assert not torch.equal(bi, real_like_block_idx(T, block_size=bs, topk=topk, batch=2, groups=3, params=par,
                                                   seed=4)) or T == 1


def test_real_like_parameters_move_the_statistics():
    kw = dict(block_size=16, topk=8, groups=2)

    def stats(**p):
        return S.selection_stats(real_like_block_idx(4096, params=RealLike(**{"jump": 0.0, **p}), **kw), 16)

    slow, fast = stats(churn=0.01), stats(churn=0.5)
    assert slow["jaccard"]["mean"] > 0.9 > fast["jaccard"]["mean"]
    assert slow["union"]["64"]["over_slots"] < fast["union"]["64"]["over_slots"]
    jumpy = stats(churn=0.01, jump=0.3)  # whole-set redraws: bimodal neighbour overlap
    assert jumpy["jaccard"]["mean"] < slow["jaccard"]["mean"] and jumpy["jaccard"]["p50"] == 1.0
    near, far = stats(dist_alpha=3.0, p_hot=0.0), stats(dist_alpha=0.0, p_hot=0.0)
    assert near["distance"]["near_share"] > far["distance"]["near_share"]
    hot = stats(p_hot=0.9, hot_blocks=2, hot_zipf=0.0)
    assert hot["popularity"]["top_block_share_mean"] > far["popularity"]["top_block_share_mean"]
    with pytest.raises(ValueError, match="churn"):
        RealLike(churn=0.0)
    with pytest.raises(ValueError, match="jump"):
        RealLike(jump=1.5)
    with pytest.raises(ValueError, match="topk"):
        real_like_block_idx(64, block_size=8, topk=2, params=RealLike(local_blocks=2, init_blocks=1))


def test_fit_recovers_a_generated_target():
    kw = dict(T=1024, block_size=16, topk=8, groups=2)
    truth = RealLike(churn=0.05, jump=0.1, p_hot=0.5, hot_blocks=4, hot_zipf=1.0, dist_alpha=1.6)
    target = S.selection_stats(real_like_block_idx(kw["T"], block_size=16, topk=8, groups=2, params=truth, seed=9), 16)
    par, dist = fit_real_like(target, **kw, rounds=2)
    start = stats_distance(S.selection_stats(real_like_block_idx(kw["T"], block_size=16, topk=8, groups=2), 16),
                           target)
    # the truth itself, drawn with the fit's seed, is this far (other hot-block positions, sampling)
    floor = stats_distance(S.selection_stats(real_like_block_idx(kw["T"], block_size=16, topk=8, groups=2,
                                                                 params=truth), 16), target)
    # a coordinate search on a small, noisy target: far better than the start, within a few floors
    assert dist < 0.2 * start and dist < 3 * floor + 0.05, (par, dist, start, floor)
    assert par.jump == truth.jump and 0.02 <= par.churn <= 0.12, par
