"""benchmarks/selections.py: the trained-like selection meets index_topk's block_idx contract."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.selections import (load_block_idx, selection_stats, stripe_ids, trained_like_block_idx,  # noqa: E402
                                   trained_like_rows)
from naive import naive_sparse_attention  # noqa: E402


@pytest.mark.parametrize("T,bs,topk", [(40 * 8 + 3, 8, 16), (17, 4, 16), (64, 16, 4), (1, 8, 16)])
def test_rows_follow_the_contract_and_the_pattern(T, bs, topk):
    G, local, n_stripes = 3, 3, 11
    bi = trained_like_block_idx(T, block_size=bs, topk=topk, batch=2, groups=G, local_blocks=local,
                                stripes=n_stripes, seed=5)
    nb = (T + bs - 1) // bs
    assert bi.dtype == torch.int32 and bi.shape == (2, G, T, topk)
    assert torch.equal(bi[0], bi[1])
    stripes = stripe_ids(nb, G, n_stripes, seed=5)
    for r in range(G):
        s = set(stripes[r].tolist())
        assert len(s) == min(n_stripes, nb - 1) and all(1 <= x < nb for x in s)
        for i in range(T):
            row = bi[0, r, i].tolist()
            own = i // bs
            n_valid = sum(x >= 0 for x in row)
            assert all(x == -1 for x in row[n_valid:]), row  # valid first, -1 padding last
            valid = row[:n_valid]
            assert valid == sorted(set(valid)), row  # ascending, no repeats
            assert all(0 <= x <= own for x in valid), row  # causal
            assert n_valid == min(topk, own + 1), row  # as many as index_topk would choose
            forced = list(dict.fromkeys([own - d for d in range(local + 1) if own - d >= 0] + [0]))
            needed = forced + [x for x in sorted(s) if x <= own and x not in forced]
            # priority: own, local, block 0, then the stripes before the query, then filler
            assert set(needed[:topk]) <= set(valid), row


def test_stripes_are_shared_by_every_later_query_and_fixed_by_the_seed():
    rows = trained_like_rows(200, 2, 16, seed=1)
    s = stripe_ids(200, 2, 11, seed=1)
    for r in range(2):
        for o in range(200):
            for x in s[r].tolist():
                if x <= o:
                    assert x in rows[r, o].tolist()
    assert torch.equal(rows, trained_like_rows(200, 2, 16, seed=1))
    assert not torch.equal(rows, trained_like_rows(200, 2, 16, seed=2))
    assert not torch.equal(s[0], s[1])  # each group its own stripes


def test_sparse_attention_reference_on_the_selection_matches_the_naive_one():
    from msakit.ops.sparse_attention.reference import sparse_attention_reference

    torch.manual_seed(0)
    B, T, Hq, G, D, bs, topk = 1, 45, 4, 2, 8, 4, 6
    q, k, v = torch.randn(B, T, Hq, D, dtype=torch.float64), torch.randn(B, T, G, D, dtype=torch.float64), \
        torch.randn(B, T, G, D, dtype=torch.float64)
    bi = trained_like_block_idx(T, block_size=bs, topk=topk, groups=G, local_blocks=1, stripes=3)
    o = sparse_attention_reference(q, k, v, bi, block_size=bs)
    ref, _ = naive_sparse_attention(q, k, v, bi, bs)
    # float64 throughout; the softmax sums at most topk * bs terms
    assert torch.allclose(o, ref, rtol=0, atol=64 * topk * bs * torch.finfo(torch.float64).eps)


def test_stats_tell_the_kinds_apart():
    from msakit.ops.index_topk.reference import index_topk_reference

    torch.manual_seed(0)
    T, bs = 2048, 64
    rnd = index_topk_reference(torch.randn(1, T, 2, 16), torch.randn(1, T, 16), block_size=bs, topk=8)
    tl = trained_like_block_idx(T, block_size=bs, topk=8, groups=2, local_blocks=3, stripes=3)
    a, b = selection_stats(rnd, bs), selection_stats(tl, bs)
    assert a["valid_slots_per_row"] == b["valid_slots_per_row"]  # both fill every slot they can
    assert b["top_block_rows_over_T"] == 1.0  # block 0: every query
    assert b["distinct_blocks_per_128_queries"] < a["distinct_blocks_per_128_queries"]


def test_load_block_idx(tmp_path):
    bi = trained_like_block_idx(64, block_size=8, topk=4, groups=2)
    torch.save({"block_idx": bi}, tmp_path / "a.pt")
    out = load_block_idx(tmp_path / "a.pt", B=1, G=4, T=64, topk=4)
    assert out.shape == (1, 4, 64, 4) and torch.equal(out[:, 0], bi[:, 0]) and torch.equal(out[:, 1], bi[:, 0])
    torch.save(bi, tmp_path / "b.pt")
    assert torch.equal(load_block_idx(tmp_path / "b.pt", B=1, G=2, T=64, topk=4), bi)
    with pytest.raises(ValueError, match="cannot serve"):
        load_block_idx(tmp_path / "b.pt", B=1, G=3, T=64, topk=4)
    with pytest.raises(ValueError, match="cannot serve"):
        load_block_idx(tmp_path / "b.pt", B=1, G=2, T=128, topk=4)


def test_kernels_take_the_selection():
    """The Triton sparse attention (CPU interpreter or CUDA) and the KL on a trained-like selection
    agree with the references: the selection is valid input for the ops the benchmark times."""
    from msakit import ops
    from msakit.ops.dispatch import interpret_mode

    if not (interpret_mode() or torch.cuda.is_available()):
        pytest.skip("needs TRITON_INTERPRET=1 before triton is imported, or CUDA")
    dev = "cuda" if torch.cuda.is_available() and not interpret_mode() else "cpu"
    torch.manual_seed(0)
    B, T, Hq, G, D, Di, bs, topk = 1, 100, 4, 2, 16, 16, 16, 5
    q, k, v = (torch.randn(B, T, h, D, device=dev) for h in (Hq, G, G))
    qi, ki = torch.randn(B, T, G, Di, device=dev), torch.randn(B, T, Di, device=dev)
    bi = trained_like_block_idx(T, block_size=bs, topk=topk, groups=G, local_blocks=1, stripes=2, device=dev)
    o, lse = ops.sparse_attention(q, k, v, bi, block_size=bs, return_lse=True, backend="triton")
    o_ref, lse_ref = ops.sparse_attention(q, k, v, bi, block_size=bs, return_lse=True, backend="reference")
    # float32, softmax sums of at most topk * bs = 80 terms
    torch.testing.assert_close(o, o_ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse, lse_ref, atol=2e-5, rtol=1e-4)
    kl = ops.index_kl_loss(q, k, qi, ki, bi, block_size=bs, backend="triton")
    kl_ref = ops.index_kl_loss(q, k, qi, ki, bi, block_size=bs, backend="reference")
    torch.testing.assert_close(kl, kl_ref, atol=2e-5, rtol=1e-4)


def test_dump_records_every_msa_layer_and_round_trips(tmp_path):
    from benchmarks.selections import dump_block_idx
    from msakit import ops
    from msakit.models import M3Config, M3ForCausalLM

    torch.manual_seed(0)
    cfg = M3Config.preset("tiny", vocab_size=64, max_position_embeddings=96)
    model = M3ForCausalLM(cfg).eval()
    model.set_attention_mode("sparse")
    ids = torch.randint(0, 64, (1, 96))
    sels = dump_block_idx(model, ids)
    assert ops.index_topk.__name__ == "index_topk"  # restored
    n_msa = sum(cfg.sparse_attention_freq)
    assert len(sels) == n_msa
    G, bs, k = cfg.num_key_value_heads, cfg.index_block_size, cfg.index_topk_blocks
    assert all(s.shape == (1, G, 96, k) and s.dtype == torch.int32 for s in sels)
    own = torch.arange(96) // bs
    assert all(((s <= own.view(1, 1, -1, 1)) | (s == -1)).all() for s in sels)
    torch.save({"block_idx": sels[1], "block_size": bs}, tmp_path / "d.pt")
    back = load_block_idx(tmp_path / "d.pt", B=1, G=2 * G, T=96, topk=k, block_size=bs)
    assert torch.equal(back[:, 0::2], sels[1]) and torch.equal(back[:, 1::2], sels[1])  # group r reads r // 2
    with pytest.raises(ValueError, match="blocks of"):
        load_block_idx(tmp_path / "d.pt", B=1, G=G, T=96, topk=k, block_size=2 * bs)
