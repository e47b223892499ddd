"""The static (CUDA-graph) decode step of the paged path (PagedDecoder.static_step).

On CPU the static step runs eagerly from its static buffers and must give exactly the eager
step's logits, step after step (lengths and pages change, the buffers' shapes do not); a trace
of its aten ops must be the same at every length (what a CUDA graph replays) and hold no host
read of device data.  With CUDA, generate(cuda_graph=True) captures, replays and matches eager.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from msakit.generate import PagedDecoder, generate
from msakit.ops.dispatch import interpret_mode

from toy_model import paged_model

# these tests decode CPU models: msa_decode's Triton backend then runs under the interpreter only
BACKENDS = ["reference"] + (["triton"] if interpret_mode() else [])
CUDA = torch.cuda.is_available()

pytestmark = pytest.mark.usefixtures("one_thread")



def run_pair(model, prompt, steps: int, nq: int, max_len: int, backend: str, kv_dtype=None):
    """Eager decoder vs static-buffer decoder, fed the same greedy tokens; yields both logits."""
    B = prompt.shape[0]
    eager = PagedDecoder(model, B, max_len, backend=backend, kv_dtype=kv_dtype)
    static = PagedDecoder(model, B, max_len, backend=backend, kv_dtype=kv_dtype)
    le, ls = eager.prefill(prompt), static.prefill(prompt)
    torch.testing.assert_close(le, ls, rtol=0, atol=0)
    g = static.static_buffers(nq)
    gen = torch.Generator().manual_seed(5)
    for _ in range(steps):
        new = torch.cat([le.argmax(-1, keepdim=True),
                         torch.randint(0, 256, (B, nq - 1), generator=gen).to(prompt.device)], dim=1)
        le = eager.step(new)
        assert static.stage(g, new)
        ls = static.static_step(g)
        yield eager, static, g, le, ls


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_static_step_equals_eager(mode: str, backend: str) -> None:
    model = paged_model(mode)
    prompt = torch.randint(0, 256, (2, 44), generator=torch.Generator().manual_seed(1))
    # 44 + 6 tokens cross the page boundary at 48 (four steps before it, two after); the static page
    # table is 6 pages wide (max_len 90)
    n = 0
    for eager, static, g, le, ls in run_pair(model, prompt, 6, 1, 90, backend):
        assert torch.equal(le, ls), (le - ls).abs().max()
        n += 1
    assert n == 6 and g.width == 6
    assert [static.cache.length(s) for s in static.seq_ids] == [50, 50]
    for sid_e, sid_s in zip(eager.seq_ids, static.seq_ids):
        assert eager.cache.pages(sid_e) == static.cache.pages(sid_s)
    torch.testing.assert_close(static.cache.k, eager.cache.k, rtol=0, atol=0)
    torch.testing.assert_close(static.cache.k_idx, eager.cache.k_idx, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_static_step_several_queries_fp8(backend: str) -> None:
    """nq = 3 new tokens per step (speculative verification shape) on fp8 pools."""
    model = paged_model("sparse", seed=1)
    prompt = torch.randint(0, 256, (2, 29), generator=torch.Generator().manual_seed(2))
    for _, _, _, le, ls in run_pair(model, prompt, 4, 3, 64, backend, kv_dtype=torch.float8_e4m3fn):
        assert torch.equal(le, ls), (le - ls).abs().max()


def test_moe_counts_without_bincount() -> None:
    """MoE.forward counts experts with scatter-adds (bincount syncs on CUDA): same counts."""
    moe = paged_model("sparse").model.layers[1].block_sparse_moe
    x = torch.randn(3, 5, moe.hidden_size)
    _, idx = moe.route(x.reshape(-1, moe.hidden_size))
    _, load = moe(x)
    assert torch.equal(load, torch.bincount(idx.reshape(-1), minlength=moe.num_experts).float())


class _Trace(TorchDispatchMode):
    """Records every aten op with its non-tensor arguments and its tensors' shapes / dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}

        def sig(a):
            if isinstance(a, torch.Tensor):
                return ("T", tuple(a.shape), a.dtype)
            if isinstance(a, (list, tuple)):
                return tuple(sig(x) for x in a)
            return a if isinstance(a, (int, float, bool, str, type(None), torch.dtype, torch.device)) else repr(type(a))

        self.ops.append((str(func), sig(args), tuple(sorted((k, sig(v)) for k, v in kwargs.items()))))
        return func(*args, **kwargs)


SYNC_OPS = ("_local_scalar_dense", "aten.nonzero", "aten.item", "aten.bincount", "aten.unique",
            "masked_select", "_assert_async")


@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_static_step_trace_is_length_independent(mode: str) -> None:
    """What a CUDA graph replays: the same aten ops with the same arguments at every length
    (nothing read from the lengths on the host), and no op that reads device data on the host
    (on CPU, msa_decode takes its CPU seq_lens for host values and reads them; on CUDA they stay
    on the device).  msa_decode's capturable path is its Triton kernel: sparse mode needs
    TRITON_INTERPRET=1 here (the interpreter's own tensor ops are in the trace too)."""
    backend = "triton" if interpret_mode() else "reference"
    if mode == "sparse" and backend == "reference":
        pytest.skip("msa_decode's capturable path is its Triton kernel (TRITON_INTERPRET=1 on CPU)")
    model = paged_model(mode)
    prompt = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(3))
    traces = []
    dec = PagedDecoder(model, 1, 80, backend=backend)
    logits = dec.prefill(prompt)
    g = dec.static_buffers(1)
    for i in range(4):  # lengths 31..34: crosses the page boundary at 32
        assert dec.stage(g, logits.argmax(-1, keepdim=True))
        with _Trace() as t:
            logits = dec.static_step(g)
        traces.append(t.ops)
    assert len(traces[0]) > 50
    for tr in traces[1:]:
        assert tr == traces[0]
    names = {o[0] for o in traces[0]}
    assert not [n for n in names if any(s in n for s in SYNC_OPS)], sorted(names)


def test_stage_refuses_past_max_len_and_unsupported_reasons() -> None:
    model = paged_model("sparse")
    prompt = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(4))
    dec = PagedDecoder(model, 1, 32, backend="reference", num_pages=8)
    dec.prefill(prompt)
    g = dec.static_buffers(1)
    assert g.width == 2
    assert dec.stage(g, torch.zeros(1, 1, dtype=torch.long))  # length 31
    assert dec.stage(g, torch.zeros(1, 1, dtype=torch.long))  # length 32: still 2 pages
    assert not dec.stage(g, torch.zeros(1, 1, dtype=torch.long))  # 33 would need a third page
    assert dec.cache.length(dec.seq_ids[0]) == 32  # nothing reserved
    assert dec.step(torch.zeros(1, 1, dtype=torch.long)).shape == (1, 256)  # the eager step still can
    assert "reference" in dec.graph_unsupported_reason()
    if BACKENDS[-1] == "triton":
        assert PagedDecoder(model, 1, 32, backend="triton").graph_unsupported_reason() is None
    assert PagedDecoder(paged_model("dense"), 1, 32, backend="reference").graph_unsupported_reason() is None

    from msakit.nn.moe import MoE

    class MyMoE(MoE):
        def forward(self, x):
            return super().forward(x)

    dense = paged_model("dense")
    dense.model.layers[1].block_sparse_moe.__class__ = MyMoE
    assert "MyMoE" in PagedDecoder(dense, 1, 32, backend="reference").graph_unsupported_reason()


def emulate_graphs(monkeypatch) -> list[int]:
    """CUDA graphs emulated on CPU: capture = remember the static step, replay = rerun it on the
    buffers.  Returns the list of captured nq (appended at each capture)."""
    captures: list[int] = []

    class FakeGraph:
        def __init__(self, dec, g):
            self.dec, self.g = dec, g

        def replay(self):
            self.g.logits.copy_(self.dec.static_step(self.g))

    def fake_capture(self, g, new):
        captures.append(g.nq)
        g.graph, g.logits = FakeGraph(self, g), self.static_step(g)
        g.graph.replay()
        return g.logits.clone()

    monkeypatch.setattr(PagedDecoder, "_capture", fake_capture)
    # msa_decode's reference reads the lengths on the host (fine on CPU, not capturable on CUDA):
    # the flow is the same with Triton, whose static step the tests above compare
    monkeypatch.setattr(PagedDecoder, "graph_unsupported_reason", lambda self: None)
    return captures


def test_graph_step_flow_emulated(monkeypatch) -> None:
    """PagedDecoder.step's graph path on CPU with an emulated graph (capture = remember the
    static step, replay = rerun it on the buffers): stage + replay per step, eager steps past
    max_len, and the logits of the eager decoder throughout."""
    captures = emulate_graphs(monkeypatch)
    backend = "reference"
    model = paged_model("sparse")
    prompt = torch.randint(0, 256, (2, 27), generator=torch.Generator().manual_seed(7))
    dec = PagedDecoder(model, 2, 40, backend=backend, num_pages=8)  # graph page table: 3 pages
    ref = PagedDecoder(model, 2, 40, backend=backend, num_pages=8)
    dec.cuda_graph = True
    l1, l2 = dec.prefill(prompt), ref.prefill(prompt)
    for i in range(25):  # lengths 28..52: past 48 (3 pages) the steps run eagerly
        new = l2.argmax(-1, keepdim=True)
        l1, l2 = dec.step(new), ref.step(new)
        assert torch.equal(l1, l2), i
    assert captures == [1] and dec.graph_disabled_reason is None
    assert dec.cache.length(dec.seq_ids[0]) == 52
    new = torch.randint(0, 256, (2, 2), generator=torch.Generator().manual_seed(8))
    dec2 = PagedDecoder(model, 2, 60, backend=backend)
    dec2.cuda_graph = True
    ref2 = PagedDecoder(model, 2, 60, backend=backend)
    dec2.prefill(prompt), ref2.prefill(prompt)
    for _ in range(3):  # nq = 2 and nq = 1 steps: one graph each
        assert torch.equal(dec2.step(new), ref2.step(new))
        assert torch.equal(dec2.step(new[:, :1]), ref2.step(new[:, :1]))
    assert captures == [1, 2, 1]


def test_decoders_and_graphs_kept_across_calls(monkeypatch) -> None:
    """decoder_for hands the same decoder (pools, static buffers, graphs) to later calls of the
    same shape: an emulated graph captured in the first call is replayed in the second (no new
    capture) with the logits of a fresh eager decoder; generate reuses its paged decoder; a new
    shape or a mode switch gets a fresh one; a decoder in use is never handed out twice."""
    import msakit.generate as G
    from msakit import graphs

    captures = emulate_graphs(monkeypatch)
    model = paged_model("sparse")
    G.clear_decoders(model)
    prompts = [torch.randint(0, 256, (2, 21), generator=torch.Generator().manual_seed(s)) for s in (9, 10)]
    decs = []
    for prompt in prompts:
        with G.decoder_for(model, 2, 40, backend="reference") as dec:
            dec.cuda_graph = True
            decs.append(dec)
            ref = PagedDecoder(model, 2, 40, backend="reference")
            l1, l2 = dec.prefill(prompt), ref.prefill(prompt)
            assert torch.equal(l1, l2)
            for _ in range(6):
                new = l2.argmax(-1, keepdim=True)
                l1, l2 = dec.step(new), ref.step(new)
                assert torch.equal(l1, l2)
            assert dec.cache.length(dec.seq_ids[0]) == 27
    assert decs[0] is decs[1] and decs[0].max_len == graphs.LENGTH_QUANTUM and captures == [1]
    assert decs[0].model is None  # pooled decoders do not keep their model alive
    with G.decoder_for(model, 2, 40, backend="reference") as a, G.decoder_for(model, 2, 40, backend="reference") as b:
        assert a is decs[0] and b is not a
    with G.decoder_for(model, 1, 40, backend="reference") as c:
        assert c is not decs[0]
    model.set_attention_mode("dense")
    with G.decoder_for(model, 2, 40, backend="reference") as d:
        assert d is not decs[0]
    model.set_attention_mode("sparse")
    # generate: the paged decoder of the first call serves the second; the tokens do not change
    G.clear_decoders(model)
    made = []
    init = PagedDecoder.__init__

    def counting_init(self, *a, **kw):
        made.append(1)
        init(self, *a, **kw)

    monkeypatch.setattr(PagedDecoder, "__init__", counting_init)
    outs = [generate(model, prompts[0], 5, temperature=0, cache="paged", decode_backend="reference") for _ in range(2)]
    assert len(made) == 1 and torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0], generate(model, prompts[0], 5, temperature=0, cache="contiguous"))
    G.clear_decoders(model)


def test_generate_cuda_graph_argument() -> None:
    model = paged_model("sparse")
    prompt = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(6))
    with pytest.raises(ValueError, match="cuda_graph must be"):
        generate(model, prompt, 2, cuda_graph="yes")
    if not CUDA:
        with pytest.raises(ValueError, match="cuda_graph=True needs"):
            generate(model, prompt, 2, temperature=0, cache="paged", cuda_graph=True)
        with pytest.raises(ValueError, match="needs a model on CUDA"):
            PagedDecoder(model, 1, 32, cuda_graph=True)
    with pytest.raises(ValueError, match="cuda_graph=True needs"):
        generate(model, prompt, 2, temperature=0, cache="contiguous", cuda_graph=True)
    # CPU: auto / False are the eager paged path; the contiguous path ignores cuda_graph=None / False
    a = generate(model, prompt, 5, temperature=0, cache="paged", decode_backend="reference")
    b = generate(model, prompt, 5, temperature=0, cache="paged", decode_backend="reference", cuda_graph=False)
    c = generate(model, prompt, 5, temperature=0, cache="contiguous", cuda_graph=False)
    assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_cuda_graph_generate_equals_eager(mode: str) -> None:
    model = paged_model(mode, device="cuda", layers=(0, 1, 1, 1)).to(torch.bfloat16)
    prompt = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1)).cuda()
    te, le = generate(model, prompt, 24, temperature=0, return_logits=True, cache="paged", cuda_graph=False)
    tg, lg = generate(model, prompt, 24, temperature=0, return_logits=True, cache="paged", cuda_graph=True)
    assert torch.equal(te, tg)
    torch.testing.assert_close(lg, le, rtol=0, atol=0)
    # the decoder really replays a graph (no fallback) and matches the eager decoder step by step
    dec = PagedDecoder(model, 2, 80, cuda_graph=True)
    ref = PagedDecoder(model, 2, 80)
    l1, l2 = dec.prefill(prompt), ref.prefill(prompt)
    for _ in range(20):
        new = l2.argmax(-1, keepdim=True)
        l1, l2 = dec.step(new), ref.step(new)
        assert torch.equal(l1, l2)
    assert dec.graph_disabled_reason is None and dec._graphs[1].graph is not None
    # sampling with a seeded generator: same draws
    kw = dict(temperature=1.0, top_k=50, cache="paged")
    a = generate(model, prompt, 16, generator=torch.Generator("cuda").manual_seed(3), cuda_graph=False, **kw)
    b = generate(model, prompt, 16, generator=torch.Generator("cuda").manual_seed(3), cuda_graph=True, **kw)
    assert torch.equal(a, b)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_cuda_graph_falls_back_with_warning() -> None:
    from msakit import graphs

    model = paged_model("sparse", device="cuda")
    prompt = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(1)).cuda()
    graphs._GRAPH_WARNED.clear()
    with pytest.warns(RuntimeWarning, match="reference"):
        a = generate(model, prompt, 6, temperature=0, cache="paged", decode_backend="reference", cuda_graph=True)
    b = generate(model, prompt, 6, temperature=0, cache="paged", decode_backend="reference", cuda_graph=False)
    assert torch.equal(a, b)


def test_capture_graph_flow_with_fakes(monkeypatch) -> None:
    """capture_graph (shared by generate and the speculative rounds): warm-up under sync-error
    mode then capture; a warm-up failure raises stage "warm-up" without output, a capture failure
    stage "capture" with the warm-up's output; the sync debug mode is restored either way."""
    import contextlib

    from msakit import graphs as gen_mod

    modes = ["default"]

    class FakeStream:
        def wait_stream(self, other) -> None:
            pass

    class Out:
        recorded = 0

        def record_stream(self, s) -> None:
            Out.recorded += 1

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: modes[-1])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda m: modes.append(m))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: "graph")
    monkeypatch.setattr(torch.cuda, "graph", lambda g, stream=None: contextlib.nullcontext())
    calls = []

    def fn(fail_at=None):
        calls.append(modes[-1])
        if fail_at == len(calls):
            raise RuntimeError("boom")
        return (Out(), Out())

    out, graph, captured = gen_mod.capture_graph(fn, torch.device("cpu"))
    assert graph == "graph" and len(out) == 2 and len(captured) == 2 and Out.recorded == 2
    assert calls == ["error", "default"] and modes[-1] == "default"  # warm-up in error mode, restored
    for stage, at in (("warm-up", 1), ("capture", 2)):
        calls.clear()
        with pytest.raises(gen_mod.GraphCaptureError) as ei:
            gen_mod.capture_graph(lambda: fn(at), torch.device("cpu"))
        assert ei.value.stage == stage and (ei.value.out is None) == (stage == "warm-up")
        assert modes[-1] == "default" and "RuntimeError: boom" in ei.value.describe("the step")
