"""The compiled paged decode step (PagedDecoder / generate with compile=True: torch.compile over
the model's forward, the cache's write + attention inside the opaque `paged_step_attend` op).

On CPU (inductor's C++ backend) the compiled step must give the eager step's logits within the
model dtype's rounding and the same greedy tokens, over a prefill and steps that cross a page
boundary, with one graph for every step (fullgraph: no graph break; static shapes: a new
position or a second decoder of the same shape compiles nothing new).  With CUDA, the compiled
step under msakit's own CUDA graph matches the uncompiled graphed step.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from msakit.generate import PagedDecoder, decoder_for, generate

from toy_model import paged_model

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = (0, 1)  # layer 0 dense GQA attention + dense MLP, layer 1 MSA + MoE
MAX_LEN = 128  # generate's rounded length for the prompts below: every test shares one page-table width
B = 2


def tolerance(dtype: torch.dtype, n: int) -> float:
    """Relative rounding bound of length-n reductions evaluated in another order (inductor's fused
    kernels against eager; fp32 measured ~2 eps at n = 128): 2 sqrt(n) eps."""
    return 2 * n ** 0.5 * torch.finfo(dtype).eps


@pytest.fixture(scope="module", autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_compiled_step_equals_eager(mode: str) -> None:
    model = paged_model(mode, layers=LAYERS)
    prompt = torch.randint(0, 256, (B, 40), generator=torch.Generator().manual_seed(1))
    eager = PagedDecoder(model, B, MAX_LEN, backend="reference")
    comp = PagedDecoder(model, B, MAX_LEN, backend="reference", compile=True)
    le, lc = eager.prefill(prompt), comp.prefill(prompt)
    torch.testing.assert_close(lc, le, rtol=0, atol=0)  # the prefill is not compiled
    tol = tolerance(model.dtype, model.config.hidden_size)
    before = graphs()
    for i in range(10):  # lengths 41..50: the sequences cross the page boundary at 48
        new = le.argmax(-1, keepdim=True)
        le, lc = eager.step(new), comp.step(new)
        assert comp.compile_disabled_reason is None, comp.compile_disabled_reason
        torch.testing.assert_close(lc, le, rtol=tol, atol=tol * le.abs().max().item())
        assert torch.equal(lc.argmax(-1), le.argmax(-1)), i
    assert graphs() - before <= 1  # at most one new graph (none when an earlier test compiled this mode's)
    assert graphs() >= 1 and not counters["graph_break"], dict(counters["graph_break"])
    # COMPILE_OPTIONS' same-input linear fusion found the layers' projections
    assert counters["inductor"]["batch_linear_lhs"] >= len(LAYERS), dict(counters["inductor"])
    assert [comp.cache.length(s) for s in comp.seq_ids] == [50, 50]
    torch.testing.assert_close(comp.cache.k, eager.cache.k, rtol=tol, atol=tol)
    torch.testing.assert_close(comp.cache.k_idx, eager.cache.k_idx, rtol=tol, atol=tol)


def test_compiled_step_with_routed_experts_op(monkeypatch) -> None:
    """The MoE decode path (`routed_experts`, a custom op: CUDA only by default, forced here on
    its reference) traces into the compiled step without a graph break and gives the eager
    step's logits."""
    from msakit.nn.moe import GroupedExperts

    calls = []
    real = GroupedExperts.forward_pairs

    def counted(self, x, idx, w):
        calls.append(x.shape[0])
        return real(self, x, idx, w)

    monkeypatch.setattr(GroupedExperts, "uses_pairs", lambda self, x, k: not torch.is_grad_enabled())
    monkeypatch.setattr(GroupedExperts, "forward_pairs", counted)
    torch._dynamo.reset()
    model = paged_model("sparse", layers=LAYERS)
    prompt = torch.randint(0, 256, (B, 40), generator=torch.Generator().manual_seed(2))
    eager = PagedDecoder(model, B, MAX_LEN, backend="reference")
    comp = PagedDecoder(model, B, MAX_LEN, backend="reference", compile=True)
    le, lc = eager.prefill(prompt), comp.prefill(prompt)
    tol = tolerance(model.dtype, model.config.hidden_size)
    for _ in range(3):
        new = le.argmax(-1, keepdim=True)
        le, lc = eager.step(new), comp.step(new)
        assert comp.compile_disabled_reason is None, comp.compile_disabled_reason
        torch.testing.assert_close(lc, le, rtol=tol, atol=tol * le.abs().max().item())
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert B in calls  # the decode steps took the pairs path
    torch._dynamo.reset()


def test_generate_compile_reuses_the_graph() -> None:
    """generate(compile=True) gives the tokens of compile=False; the compiled decoder is pooled
    under its own key; a second decoder of the same shape (another call, another model of the
    same structure) runs the graph compiled before: no recompilation."""
    model = paged_model("sparse", layers=LAYERS)
    prompt = torch.randint(0, 256, (B, 30), generator=torch.Generator().manual_seed(2))
    kw = dict(temperature=0, return_logits=True, cache="paged", decode_backend="reference")
    toks, logits = generate(model, prompt, 6, **kw)
    toks_c, logits_c = generate(model, prompt, 6, compile=True, **kw)
    n = graphs()
    assert torch.equal(toks_c, toks)
    tol = tolerance(model.dtype, model.config.hidden_size)
    torch.testing.assert_close(logits_c, logits, rtol=tol, atol=tol * logits.abs().max().item())
    other = paged_model("sparse", seed=3, layers=LAYERS)
    toks2, _ = generate(other, prompt, 6, **kw)
    toks2_c, _ = generate(other, prompt, 6, compile=True, **kw)
    assert torch.equal(toks2_c, toks2) and graphs() == n and not counters["graph_break"]
    with decoder_for(model, B, MAX_LEN, backend="reference", compile=True) as a, \
            decoder_for(model, B, MAX_LEN, backend="reference") as b:
        assert a.compile and not b.compile and a is not b


def test_compile_argument_checks() -> None:
    model = paged_model("sparse", layers=LAYERS)
    prompt = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="compile must be"):
        generate(model, prompt, 2, compile="yes")
    with pytest.raises(ValueError, match="paged"):
        generate(model, prompt, 2, compile=True, cache="contiguous")


def test_failed_compilation_falls_back_with_warning(monkeypatch) -> None:
    """A dynamo / inductor failure disables compilation for the decoder (one warning naming the
    error); the step's logits then come from the uncompiled forward."""
    import msakit.generate as G

    def broken(*args, **kwargs):
        raise torch._dynamo.exc.Unsupported("stand-in for a graph break")

    monkeypatch.setattr(G, "_COMPILED", [broken])
    model = paged_model("sparse", layers=LAYERS)
    prompt = torch.randint(0, 256, (B, 20), generator=torch.Generator().manual_seed(5))
    eager = PagedDecoder(model, B, MAX_LEN, backend="reference")
    comp = PagedDecoder(model, B, MAX_LEN, backend="reference", compile=True)
    le, lc = eager.prefill(prompt), comp.prefill(prompt)
    with pytest.warns(RuntimeWarning, match="compile=True disabled.*stand-in"):
        lc = comp.step(le.argmax(-1, keepdim=True))
    le = eager.step(le.argmax(-1, keepdim=True))
    assert torch.equal(lc, le) and "Unsupported" in comp.compile_disabled_reason
    assert torch.equal(comp.step(le.argmax(-1, keepdim=True)), eager.step(le.argmax(-1, keepdim=True)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture of the compiled step needs CUDA")
def test_cuda_graph_compiled_step_equals_graphed_eager() -> None:
    """bf16 on CUDA (msa_decode's Triton kernels, torch._grouped_mm): the captured compiled step
    against the captured uncompiled step, fed the same tokens."""
    model = paged_model("sparse", device="cuda", layers=(0, 1, 1)).to(torch.bfloat16)
    prompt = torch.randint(0, 256, (B, 40), generator=torch.Generator().manual_seed(4)).cuda()
    ref = PagedDecoder(model, B, MAX_LEN, cuda_graph=True)
    comp = PagedDecoder(model, B, MAX_LEN, cuda_graph=True, compile=True)
    lr, lc = ref.prefill(prompt), comp.prefill(prompt)
    tol = tolerance(torch.bfloat16, model.config.hidden_size)
    for _ in range(10):
        new = lr.argmax(-1, keepdim=True)
        lr, lc = ref.step(new), comp.step(new)
        torch.testing.assert_close(lc.float(), lr.float(), rtol=tol, atol=tol * lr.abs().max().item())
    assert ref.graph_disabled_reason is None and comp.graph_disabled_reason is None
    assert comp.compile_disabled_reason is None and comp._graphs[1].graph is not None
