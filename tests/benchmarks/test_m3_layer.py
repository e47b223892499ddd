"""benchmarks/m3_layer.py on the CPU: its decode step (a `PagedDecoder`'s static step over a cache
filled directly) is the decode of that context, and the 60-layer composition adds what it says."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import m3_layer  # noqa: E402
from msakit.cache import KVCache  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("kind", ["m3_msa_moe", "m3_dense"])
def test_decode_step_equals_the_contiguous_decode_of_its_cache(kind):
    """The staged step (2 rows at a context of 2,300 tokens, past M3's 16 selected blocks, 8 new
    tokens crossing a page boundary) gives the logits of the contiguous cache holding the same
    keys, and writes its new keys into the slots of positions N .. N + 7."""
    torch.manual_seed(0)
    model, _ = m3_layer.build_layer(kind, torch.device("cpu"), tiny=True, dtype=torch.float32)
    B, N, nq = 2, 2300, 8
    ds = m3_layer.DecodeSteps(model, B, N, nq)
    cache, table = ds.dec.cache, ds.table.long()
    pools = cache.layer(0)
    assert (pools.k_idx is not None) == (kind != "m3_dense")
    W, ps = table.shape[1], cache.page_size
    assert W == -(-(N + nq) // ps) and len(set(table.flatten().tolist())) == B * W

    def rows(pool):  # [P, G, ps, D] -> [B, W * ps, G, D]; index keys [P, ps, Di] -> [B, W * ps, Di]
        x = pool[table]
        return x.transpose(2, 3).flatten(1, 2) if x.dim() == 5 else x.flatten(1, 2)

    kv = KVCache(1, N + nq)
    kv.k[0], kv.v[0] = rows(pools.k).clone(), rows(pools.v).clone()
    if pools.k_idx is not None:
        kv.k_idx[0] = rows(pools.k_idx).clone()
    kv.length = N
    step = ds.fn(nq)
    g = ds.dec.static_buffers(nq)
    assert g.positions.tolist() == [list(range(N, N + nq))] * B and g.seq_lens.tolist() == [N + nq] * B
    got = step()  # under no_grad itself, as generate runs it (the MoE's decode paths need it)
    assert not got.requires_grad
    with torch.no_grad():
        want = model(g.ids, cache=kv, logits_to_keep=1).logits[:, -1]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rows(pools.k)[:, N:N + nq], kv.k[0][:, N:N + nq], rtol=0, atol=0)
    if pools.k_idx is not None:
        torch.testing.assert_close(rows(pools.k_idx)[:, N:N + nq], kv.k_idx[0][:, N:N + nq], rtol=0, atol=0)
    assert m3_layer.cache_bytes(model, B, N, nq) == sum(
        t.numel() * t.element_size() for t in (cache.k, cache.v, cache.k_idx) if t is not None) // 2


def test_compose_adds_the_layers_head_and_dense_attention():
    """M3's step = head + 3 x (dense step at one page + SDPA over N) + 57 x MSA + MoE step at N;
    a round of DSpark = the Flash layers' verify steps + head + drafter; a missing (NaN) part
    gives NaN, not a number."""
    page, B, N = 128, 1, 4096
    steps = {(k, B, N if k != "m3_dense" else page, q): 1.0 + i + q / 100
             for i, k in enumerate(m3_layer.KINDS) for q in (1, m3_layer.VERIFY)}
    dense_attn = {(B, N, 1): 0.5}
    heads = {(B, 1): 2.0, (B, m3_layer.VERIFY): 3.0}
    rows = m3_layer.compose(steps, dense_attn, heads, [B], [N], {0.0: 4.0}, {B: 7.0}, page)
    by = {r["model"]: r for r in rows}
    assert by["M3"]["ms_per_step"] == pytest.approx(2.0 + 3 * (steps[("m3_dense", B, page, 1)] + 0.5)
                                                    + 57 * steps[("m3_msa_moe", B, N, 1)])
    flash_verify = 3.0 + 3 * steps[("flash_msa_dense", B, N, 8)] + 57 * steps[("flash_msa_moe", B, N, 8)]
    spec = by["M3.1-Flash + DSpark (T=0)"]
    assert spec["ms_per_round"] == pytest.approx(flash_verify + 7.0)
    assert spec["tok_s"] == pytest.approx(B * 4.0 / spec["ms_per_round"] * 1e3)
    steps[("m3_msa_moe", B, N, 1)] = float("nan")
    rows = m3_layer.compose(steps, dense_attn, heads, [B], [N], {0.0: 4.0}, {B: 7.0}, page)
    assert math.isnan(next(r for r in rows if r["model"] == "M3")["tok_s"])


def test_step_shapes_per_kind():
    assert m3_layer.step_contexts("m3_dense", [32768, 131072], 128) == [128]
    assert m3_layer.step_contexts("flash_msa_moe", [32768, 131072], 128) == [32768, 131072]
    assert m3_layer.step_nqs("m3_msa_moe") == (1,) and m3_layer.step_nqs("bf16_msa_dense") == (1,)
    assert m3_layer.step_nqs("flash_msa_dense") == m3_layer.step_nqs("m3_dense") == (1, m3_layer.VERIFY)
