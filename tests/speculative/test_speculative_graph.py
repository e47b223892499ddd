"""The fixed-shape (CUDA-graph-ready) speculative rounds: `target_step` / `draft_hidden(...,
lengths)` equal the length-sliced `target_forward` / `draft_hidden`, greedy output is unchanged
with cuda_graph on or off, and on CUDA the captured graphs replay exactly what the eager static
step computes (`gpu_check` times speculative_generate with cuda_graph False / True)."""

from __future__ import annotations

import time

import pytest
import torch

from msakit.generate import generate
from msakit.speculative import DSparkConfig, DSparkDrafter, autoregressive_generate, speculative_generate
from msakit.speculative.generate import (SpecCache, StaticRounds, draft_context_update, draft_hidden, target_forward,
                                  target_step)

from spec_helpers import bigram_pair

pytestmark = pytest.mark.usefixtures("one_thread")


def _prefilled(t, d, B: int = 3, T: int = 9, max_len: int = 40, device: str = "cpu"):
    prompt = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(0)).to(device)
    cache = SpecCache(t.config.num_hidden_layers, d.config.num_hidden_layers, B, max_len, torch.device(device))
    _, tap = target_forward(t, cache, prompt, d.config.target_layer_ids)
    draft_context_update(d, cache, tap)
    lens = [T, T - 2, T - 5]  # per-row lengths (as after rollbacks)
    cache.rollback(lens)
    return cache


def _clone(cache: SpecCache) -> SpecCache:
    c = SpecCache(len(cache.k), len(cache.dk), cache.batch, cache.max_len, cache.device)
    for name in ("k", "v", "k_idx", "dk", "dv"):
        setattr(c, name, [None if x is None else x.clone() for x in getattr(cache, name)])
    c.set_lengths(cache.lengths.clone(), cache.host_lengths)
    c.written = list(cache.written)
    return c


def _assert_sampled_graph_equals_eager(t, d, prompt, g: torch.Generator) -> None:
    """Sampled speculative output (T 1; T 0.8 with top-p 0.9) is the same with cuda_graph False / True."""
    for seed, kw in ((5, dict(temperature=1.0)), (6, dict(temperature=0.8, top_p=0.9))):
        s1 = speculative_generate(t, d, prompt, 12, generator=g.manual_seed(seed), cuda_graph=False, **kw)
        s2 = speculative_generate(t, d, prompt, 12, generator=g.manual_seed(seed), cuda_graph=True, **kw)
        assert torch.equal(s1, s2), kw


@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_static_step_equals_length_sliced_path(mode: str) -> None:
    t, d = bigram_pair(mode)
    taps = d.config.target_layer_ids
    a = _prefilled(t, d)
    b = _clone(a)
    toks = torch.randint(0, 64, (3, 4), generator=torch.Generator().manual_seed(1))
    # drafter block: all max_len context positions (masked) == the first max(lengths)
    h_ref = draft_hidden(d, a, toks[:, 0])
    h = draft_hidden(d, b, toks[:, 0], b.lengths.clone())
    torch.testing.assert_close(h, h_ref, rtol=1e-5, atol=1e-5)
    # target verify forward + draft context update
    ref, tap = target_forward(t, a, toks, taps)
    draft_context_update(d, a, tap)
    logits = target_step(t, b, toks, b.lengths.clone(), taps, d)
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))
    for name in ("k", "v", "k_idx", "dk", "dv"):
        for x, y in zip(getattr(a, name), getattr(b, name)):
            assert (x is None) == (y is None)
            if x is not None:
                torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)
    # the round object (eager on CPU) runs the same thing from its static buffers
    c = _clone(_prefilled(t, d))
    r = StaticRounds(t, d, c, taps, 3, True, None)
    (h2,) = r.draft(toks[:, 0])
    torch.testing.assert_close(h2, h_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r.verify_forward(toks[:, 1:]), ref, rtol=1e-5, atol=1e-5)
    assert c.written == [L + 4 for L in c.host_lengths]


@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_greedy_unchanged_with_cuda_graph_flag(mode: str) -> None:
    t, d = bigram_pair(mode)
    prompt = torch.randint(0, 64, (3, 9), generator=torch.Generator().manual_seed(0))
    ref = generate(t, prompt, 30, temperature=0)
    for cg in (None, False, True):  # CPU: always eager, the same fixed-shape rounds
        for kw in [{}, {"confidence_budget": True, "budget_cost": (1.0, 0.3)}]:
            assert torch.equal(speculative_generate(t, d, prompt, 30, temperature=0, cuda_graph=cg, **kw), ref)
        assert torch.equal(autoregressive_generate(t, prompt, 30, temperature=0, cuda_graph=cg), ref)
    _assert_sampled_graph_equals_eager(t, d, prompt, torch.Generator())
    with pytest.raises(ValueError):
        speculative_generate(t, d, prompt, 4, cuda_graph="yes")
    with pytest.raises(ValueError):
        autoregressive_generate(t, prompt, 4, cuda_graph=1)


def test_graph_flow_with_fake_capture(monkeypatch) -> None:
    """The graph bookkeeping on CPU: a fake capture records the function and its outputs, a
    replay re-runs the recorded function into those outputs (as a graph re-runs its kernels on
    the same buffers); greedy / sampled output, the keys (one round graph; with the confidence
    budget one drafter graph and one target graph per verify width) and the clones match the
    eager rounds."""
    import msakit.speculative.generate as sg

    keys: list = []

    class FakeGraph:
        def __init__(self, fn, outs):
            self.fn, self.outs = fn, outs

        def replay(self):
            for o, x in zip(self.outs, self.fn()):
                o.copy_(x)

    def fake_capture(self, key, fn):
        keys.append(key)
        outs = fn()
        self.graphs[key] = (FakeGraph(fn, outs), outs)
        return tuple(o.clone() for o in outs)

    init = sg._Graphed.__init__

    def on_cpu(self, use_graph, device):
        init(self, use_graph, device)
        self.use_graph = use_graph  # pretend CPU can capture

    t, d = bigram_pair("sparse")
    prompt = torch.randint(0, 64, (3, 9), generator=torch.Generator().manual_seed(0))
    ref = generate(t, prompt, 30, temperature=0)
    g = torch.Generator().manual_seed(5)
    eager = speculative_generate(t, d, prompt, 12, temperature=1.0, top_k=8, generator=g.manual_seed(5),
                                 cuda_graph=False)
    monkeypatch.setattr(sg._Graphed, "_capture", fake_capture)
    monkeypatch.setattr(sg._Graphed, "__init__", on_cpu)
    assert torch.equal(speculative_generate(t, d, prompt, 30, temperature=0), ref)
    assert keys == ["round"]  # one graph per run: the whole round
    keys.clear()
    out = speculative_generate(t, d, prompt, 30, temperature=0, confidence_budget=True, budget_cost=(1.0, 0.3))
    assert torch.equal(out, ref)
    assert keys[0] == "drafter" and len(keys) == len(set(keys)) and len(keys) > 2  # several verify widths
    keys.clear()
    assert torch.equal(speculative_generate(t, d, prompt, 12, temperature=1.0, top_k=8, generator=g.manual_seed(5)),
                       eager)
    assert torch.equal(autoregressive_generate(t, prompt, 30, temperature=0), ref)
    assert keys == ["round", ("target", 1)]
    # later calls of the same shapes reuse the pooled run states: their graphs replay, none is captured
    keys.clear()
    assert torch.equal(speculative_generate(t, d, prompt, 30, temperature=0), ref)
    assert torch.equal(speculative_generate(t, d, prompt[:, :7], 25, temperature=0), generate(t, prompt[:, :7], 25,
                                                                                               temperature=0))
    assert torch.equal(autoregressive_generate(t, prompt, 30, temperature=0), ref)
    assert keys == []
    sg.clear_runs(t)
    assert torch.equal(autoregressive_generate(t, prompt, 30, temperature=0), ref)
    assert keys == [("target", 1)]


# ------------------------------------------------------------------------------------------- CUDA


def _graph_failures() -> list[str]:
    from msakit.graphs import _GRAPH_WARNED

    return sorted(r for r in _GRAPH_WARNED if "speculative_generate" in r)


def gpu_check(new: int = 64, ctx: int = 128, repeats: int = 3) -> dict:
    """Times speculative_generate / autoregressive_generate with cuda_graph False / True on the
    "small" preset (bf16, sparse) with an untrained drafter; asserts identical greedy tokens and
    that no graph was disabled.  -> {name: ms per generated token}: `total` = a whole call over
    `new` tokens (prefill and captures included), `steady` = (t(new) - t(new / 2)) / (new / 2)."""
    from msakit.models import M3Config, M3ForCausalLM

    torch.manual_seed(0)
    cfg = M3Config.preset("small", vocab_size=4096, max_position_embeddings=ctx + 4 * new + 64)
    model = M3ForCausalLM(cfg, mode="sparse").cuda().to(torch.bfloat16).eval()
    drafter = DSparkDrafter(DSparkConfig.for_target(model.config, "small")).cuda().to(torch.bfloat16).eval()
    ids = torch.randint(0, 4096, (1, ctx), device="cuda")
    runs = {
        "speculative": lambda n, cg: speculative_generate(model, drafter, ids, n, temperature=0.0, cuda_graph=cg),
        "spec_engine_plain": lambda n, cg: autoregressive_generate(model, ids, n, temperature=0.0, cuda_graph=cg),
    }

    def wall(fn) -> tuple[float, torch.Tensor]:
        best, out = float("inf"), None
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fn()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return best, out

    res: dict[str, float] = {}
    before = _graph_failures()
    for name, fn in runs.items():
        outs = {}
        for cg in (False, True):
            fn(4, cg)
            t_all, outs[cg] = wall(lambda: fn(new, cg))
            t_half, _ = wall(lambda: fn(new // 2, cg))
            res[f"{name} graph={cg} total ms/token"] = round(t_all * 1e3 / new, 3)
            res[f"{name} graph={cg} steady ms/token"] = round((t_all - t_half) * 1e3 / (new - new // 2), 3)
        assert torch.equal(outs[False], outs[True]), name
    print(res)
    assert _graph_failures() == before, _graph_failures()  # no graph was disabled (a one-time warning each)
    return res


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_cuda_graph_replay_equals_eager(mode: str) -> None:
    t, d = bigram_pair(mode)
    t, d = t.cuda().to(torch.bfloat16), d.cuda().to(torch.bfloat16)  # bf16: torch._grouped_mm (no sync)
    taps = d.config.target_layer_ids
    toks = torch.randint(0, 64, (3, 4), generator=torch.Generator().manual_seed(1)).cuda()
    for greedy_kw in (None, dict(temperature=0, top_k=None, top_p=None, num_drafts=3, want_confidence=True)):
        eager = StaticRounds(t, d, _clone(_prefilled(t, d, device="cuda")), taps, 3, False, greedy_kw)
        graph = StaticRounds(t, d, _clone(_prefilled(t, d, device="cuda")), taps, 3, True, greedy_kw)
        for _ in range(3):  # capture, then replays (the step rewrites the same keys)
            de, dg = eager.draft(toks[:, 0]), graph.draft(toks[:, 0])
            for x, y in zip(de, dg):
                assert torch.equal(x, y)
            for w in (4, 2):
                assert torch.equal(eager.verify_forward(toks[:, 1:w]), graph.verify_forward(toks[:, 1:w]))
        assert graph.run.disabled_reason is None and len(graph.run.graphs) == 3
    prompt = torch.randint(0, 64, (3, 9), generator=torch.Generator().manual_seed(0)).cuda()
    before = _graph_failures()
    for kw in [{}, {"confidence_budget": True, "budget_cost": (1.0, 0.3)}]:
        a = speculative_generate(t, d, prompt, 30, temperature=0, cuda_graph=False, **kw)
        b = speculative_generate(t, d, prompt, 30, temperature=0, cuda_graph=True, **kw)
        assert torch.equal(a, b), kw
    assert torch.equal(autoregressive_generate(t, prompt, 20, temperature=0, cuda_graph=False),
                       autoregressive_generate(t, prompt, 20, temperature=0, cuda_graph=True))
    _assert_sampled_graph_equals_eager(t, d, prompt, torch.Generator(device="cuda"))
    assert _graph_failures() == before


@cuda
def test_cuda_small_preset_speed_and_tokens() -> None:
    gpu_check(new=32, repeats=1)


@cuda
def test_cuda_paged_rounds_graph_equals_eager() -> None:
    """The paged target cache (verify forwards through msa_decode's Triton kernels) on CUDA: the
    captured rounds (greedy, the confidence budget's widths, sampled) give the eager rounds'
    tokens, no graph is disabled, and a second call reuses the pooled graphs."""
    import msakit.speculative.generate as sg

    t, d = bigram_pair("sparse", block=16)
    t, d = t.cuda().to(torch.bfloat16), d.cuda().to(torch.bfloat16)
    prompt = torch.randint(0, 64, (3, 9), generator=torch.Generator().manual_seed(0)).cuda()
    before = _graph_failures()
    sg.clear_runs(t)
    for kw in [{}, {"confidence_budget": True, "budget_cost": (1.0, 0.3)}]:
        a = speculative_generate(t, d, prompt, 30, temperature=0, cuda_graph=False, cache="paged", **kw)
        b = speculative_generate(t, d, prompt, 30, temperature=0, cuda_graph=True, cache="paged", **kw)
        c = speculative_generate(t, d, prompt, 30, temperature=0, cuda_graph=True, cache="paged", **kw)
        assert torch.equal(a, b) and torch.equal(b, c), kw
    assert torch.equal(autoregressive_generate(t, prompt, 20, temperature=0, cuda_graph=False, cache="paged"),
                       autoregressive_generate(t, prompt, 20, temperature=0, cuda_graph=True, cache="paged"))
    g = torch.Generator(device="cuda")
    for seed in (5, 6):
        s1 = speculative_generate(t, d, prompt, 12, temperature=1.0, generator=g.manual_seed(seed), cuda_graph=False,
                                  cache="paged")
        s2 = speculative_generate(t, d, prompt, 12, temperature=1.0, generator=g.manual_seed(seed), cuda_graph=True,
                                  cache="paged")
        assert torch.equal(s1, s2)
    assert _graph_failures() == before
