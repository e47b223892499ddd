"""Training with compiled decoder layers (`compile_layers`, `TrainConfig.compile`, `--compile`).

Compiled and eager training steps of the toy model give the same losses and gradients within
fp32 rounding, over two optimizer steps, and the second step compiles nothing new (static
shapes, guards that hold).  Two paths:

- dense attention (SDPA) + MoE: the CPU path itself, one graph per layer kind (fullgraph);
- MSA (sparse attention, index_topk, the index KL) as it runs on CUDA: there `sparse_attention`
  and `index_kl_loss` call their Triton kernels through `torch.library` custom ops.  On CPU the
  test routes the ops to those custom ops with dense-mask stand-ins for the kernels (`FakeKernels`,
  checked against the ops' own CPU path first), so dynamo traces what it traces on the GPU:
  the custom ops, their fake kernels and registered autograd, in one graph per layer kind.

Graphs are captured by dynamo + AOTAutograd ("aot_eager": the graph breaks, guards and
autograd of a GPU compile) and, for the MSA layer, lowered by inductor's CPU backend too.  The
ops' chunked CPU paths themselves break the graph (data-dependent shapes): `compile_layers`
then compiles without fullgraph, checked last.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch._dynamo.utils import counters

from msakit.train.trainer import TrainConfig, Trainer, compile_layers

from toy_model import make_model, randomize_norms

pytestmark = pytest.mark.usefixtures("one_thread")

V, B, T = 64, 2, 32  # T spans 4 blocks of 8 (top-2): sparse attention skips blocks


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def tolerance(dtype: torch.dtype, n: int) -> float:
    """Rounding bound of a length-n fp reduction evaluated in another order (fused / reordered
    kernels against eager), with margin: 8 sqrt(n) eps."""
    return 8 * n ** 0.5 * torch.finfo(dtype).eps


# ------------------------------------------------------------------------------ kernel stand-ins
def selected_mask(block_idx: torch.Tensor, T: int, bs: int) -> torch.Tensor:
    """bool [B, G, T, T]: key j lies in a block selected by query i, and j <= i."""
    nb = (T + bs - 1) // bs
    sel = (block_idx.long().unsqueeze(-1) == torch.arange(nb)).any(-2)  # [B, G, T, nb]
    j = torch.arange(T)
    return sel[..., j // bs] & (j.view(1, -1) <= j.view(-1, 1))


class FakeKernels:
    """Dense-mask stand-ins for the Triton kernels behind the custom ops (same signatures and
    output layouts: contiguous, lse float32 [B, Hq, T]); no packed documents.  `calls` counts
    the calls by entry point."""

    calls: dict[str, int] = {}

    @staticmethod
    def kernel_supports(*args) -> None:
        return None

    @staticmethod
    def _probs(q, k, block_idx, bs, scale):
        Bq, Tq, Hq, D = q.shape
        G = k.shape[2]
        qh = q.float().view(Bq, Tq, G, Hq // G, D).permute(0, 2, 3, 1, 4)  # [B, G, R, T, D]
        kh = k.float().transpose(1, 2)  # [B, G, T, D]
        m = selected_mask(block_idx, Tq, bs).unsqueeze(2)
        s = torch.einsum("bgrid,bgjd->bgrij", qh, kh).mul(scale).masked_fill(~m, float("-inf"))
        lse = torch.logsumexp(s, -1)
        return qh, kh, torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0), lse

    @classmethod
    def sparse_attention_fwd_triton(cls, q, k, v, block_idx, cu_seqlens, bs, scale):
        cls.calls["sparse_attention_fwd_triton"] = cls.calls.get("sparse_attention_fwd_triton", 0) + 1
        assert cu_seqlens is None
        Bq, Tq, Hq, D = q.shape
        _, _, p, lse = cls._probs(q, k, block_idx, bs, scale)
        o = torch.einsum("bgrij,bgjd->bgrid", p, v.float().transpose(1, 2))
        return (o.permute(0, 3, 1, 2, 4).reshape(Bq, Tq, Hq, D).to(q.dtype).contiguous(),
                lse.reshape(Bq, Hq, Tq).contiguous())

    @classmethod
    def sparse_attention_bwd_triton(cls, do, q, k, v, o, lse, dlse, block_idx, cu_seqlens, bs, scale):
        cls.calls["sparse_attention_bwd_triton"] = cls.calls.get("sparse_attention_bwd_triton", 0) + 1
        Bq, Tq, Hq, D = q.shape
        G = k.shape[2]
        qh, kh, p, _ = cls._probs(q, k, block_idx, bs, scale)
        heads = lambda t: t.float().view(Bq, Tq, G, Hq // G, D).permute(0, 2, 3, 1, 4)  # noqa: E731
        doh, oh = heads(do), heads(o)
        dp = torch.einsum("bgrid,bgjd->bgrij", doh, v.float().transpose(1, 2))
        ds = p * (dp - (doh * oh).sum(-1, keepdim=True))
        if dlse is not None:
            ds = ds + p * dlse.float().view(Bq, G, Hq // G, Tq, 1)
        dq = torch.einsum("bgrij,bgjd->bgrid", ds, kh).mul(scale).permute(0, 3, 1, 2, 4).reshape(Bq, Tq, Hq, D)
        dk = torch.einsum("bgrij,bgrid->bjgd", ds, qh).mul(scale)
        dv = torch.einsum("bgrij,bgrid->bjgd", p, doh)
        return tuple(g.to(x.dtype).contiguous() for g, x in ((dq, q), (dk, k), (dv, v)))

    @classmethod
    def index_kl_fwd_triton(cls, q, k, q_idx, k_idx, block_idx, lse, cu_seqlens, bs, scale, iscale, compute_grad):
        cls.calls["index_kl_fwd_triton"] = cls.calls.get("index_kl_fwd_triton", 0) + 1
        Bq, Tq, G, _ = q_idx.shape
        P = cls._probs(q, k, block_idx, bs, scale)[2].mean(2)  # [B, G, T, T]
        m = selected_mask(block_idx, Tq, bs)
        z = torch.einsum("bigd,bjd->bgij", q_idx.float(), k_idx.float()).mul(iscale).masked_fill(~m, float("-inf"))
        logq = torch.log_softmax(z, -1)
        loss = torch.where(P > 0, P * (P.clamp_min(1e-30).log() - logq), torch.zeros_like(P)).sum(-1).mean()
        if not compute_grad:
            return loss, q_idx.new_empty(0), k_idx.new_empty(0)
        dz = (logq.exp().nan_to_num(0.0) - P) / (Bq * G * Tq)
        dq = torch.einsum("bgij,bjd->bigd", dz, k_idx.float()) * iscale
        dk = torch.einsum("bgij,bigd->bjd", dz, q_idx.float()) * iscale
        return loss, dq.to(q_idx.dtype).contiguous(), dk.to(k_idx.dtype).contiguous()


@pytest.fixture
def gpu_ops(monkeypatch):
    """sparse_attention and index_kl_loss take their custom-op (kernel) path on CPU tensors: the
    dispatch asked as for a CUDA tensor (`use_triton`'s own code runs, traced), the Triton entry
    points replaced by `FakeKernels` (index_topk is a custom op on every device already)."""
    from msakit.ops import dispatch

    as_cuda = lambda op, backend, device: dispatch.use_triton(op, backend, torch.device("cuda"))  # noqa: E731
    for mod in ("msakit.ops.sparse_attention", "msakit.ops.index_kl"):
        monkeypatch.setattr(importlib.import_module(mod), "use_triton", as_cuda)
    sa_triton = importlib.import_module("msakit.ops.sparse_attention.triton")
    for name in ("kernel_supports", "sparse_attention_fwd_triton", "sparse_attention_bwd_triton"):
        monkeypatch.setattr(sa_triton, name, getattr(FakeKernels, name))
    monkeypatch.setattr(importlib.import_module("msakit.ops.index_kl.triton"), "index_kl_fwd_triton",
                        FakeKernels.index_kl_fwd_triton)


# ------------------------------------------------------------------------------ steps
def toy(kind: str, **overrides) -> torch.nn.Module:
    """The toy model (layer 0 dense MLP, layer 1 MoE), MSA in both layers or ("dense") plain GQA;
    norms drawn away from their zero init so their gradients are not trivial."""
    extra = {"sparse_attention_freq": [0, 0]} if kind == "dense" else {}
    kwargs = {"max_position_embeddings": T, **extra, **overrides}  # an override may set the length
    model = randomize_norms(make_model(vocab_size=V, **kwargs))
    model.set_attention_mode("dense" if kind == "dense" else "sparse")
    return model.train()


def train_steps(model, steps: int = 2) -> tuple[list[tuple[float, float]], list[dict[str, torch.Tensor]], list[int]]:
    """`steps` steps of LM + KL, backward, SGD: per step (LM loss, KL), the gradients by name and
    dynamo's graph count after the step."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    gen = torch.Generator().manual_seed(1)
    losses, grads, graphs = [], [], []
    for _ in range(steps):
        ids = torch.randint(0, V, (B, T), generator=gen)
        out = model(ids, labels=ids)
        (out.loss + out.kl).backward()
        losses.append((out.loss.item(), out.kl.item()))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        graphs.append(counters["stats"]["unique_graphs"])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads, graphs


def assert_steps_close(got, want, n: int) -> None:
    tol = tolerance(torch.float32, n)
    for (lg, kg), (lw, kw) in zip(got[0], want[0]):
        assert lg == pytest.approx(lw, rel=tol, abs=tol) and kg == pytest.approx(kw, rel=tol, abs=tol)
    for gg, gw in zip(got[1], want[1]):
        assert gg.keys() == gw.keys()
        for name in gw:  # each gradient within the rounding of its largest entry
            torch.testing.assert_close(gg[name], gw[name], rtol=tol, atol=tol * gw[name].abs().max().item(),
                                       msg=lambda m, name=name: f"{name}: {m}")


def reduction_length(model) -> int:
    c = model.config
    return max(B * T, c.hidden_size, c.vocab_size, c.intermediate_size, c.dense_intermediate_size)


@pytest.mark.parametrize("kind", ["dense", "msa"])
def test_compiled_steps_equal_eager(kind, gpu_ops):
    FakeKernels.calls.clear()
    eager = train_steps(toy(kind))
    model = toy(kind)
    assert compile_layers(model, fullgraph=True, backend="aot_eager") == 2
    comp = train_steps(model)
    if kind == "msa":  # 2 layers x 2 steps x (eager, compiled): the kernel path ran
        assert FakeKernels.calls == dict.fromkeys(
            ("sparse_attention_fwd_triton", "sparse_attention_bwd_triton", "index_kl_fwd_triton"), 8)
    assert_steps_close(comp, eager, reduction_length(model))
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert comp[2][0] == 2 and comp[2][1] == comp[2][0]  # one graph per layer kind; the 2nd step compiles nothing
    assert list(model.state_dict()) == list(toy(kind).state_dict())  # names unchanged (compiled in place)


def test_fake_kernels_equal_the_cpu_path(gpu_ops, monkeypatch):
    """The stand-ins give the ops' own CPU (chunked) path's losses and gradients, eagerly."""
    fake = train_steps(toy("msa"), steps=1)
    monkeypatch.undo()
    cpu = train_steps(toy("msa"), steps=1)
    assert_steps_close(fake, cpu, reduction_length(toy("msa")))


def test_inductor_msa_layer_equals_eager(gpu_ops):
    """Inductor's lowering of one MSA + MoE layer (the custom ops as extern kernels)."""
    one = dict(num_hidden_layers=1, moe_layer_freq=[1])
    eager = train_steps(toy("msa", **one))
    model = toy("msa", **one)
    compile_layers(model, fullgraph=True)
    comp = train_steps(model)
    assert_steps_close(comp, eager, reduction_length(model))
    assert not counters["graph_break"] and comp[2] == [1, 1]


def test_cpu_msa_path_compiles_without_fullgraph():
    """On CPU the MSA ops' chunked paths break the graph (data-dependent shapes): compile_layers
    picks fullgraph=False there, and the steps still equal eager ones."""
    eager = train_steps(toy("msa"), steps=1)
    model = toy("msa")
    compile_layers(model, backend="aot_eager")
    comp = train_steps(model, steps=1)
    assert_steps_close(comp, eager, reduction_length(model))


def test_train_config_and_trainer_compile(tmp_path, monkeypatch):
    """TrainConfig's checks; a Trainer with compile=True compiles its layers, trains (the
    dense warm-up step, then a sparse one: one new graph per layer kind) and evaluates eagerly
    (no new graph).  Dynamo + AOTAutograd here (inductor's CPU compile is slow)."""
    import functools

    import numpy as np

    from msakit.train import trainer as trainer_mod
    from msakit.train.data import PackedRows, TokenStream

    with pytest.raises(ValueError, match="compile must be"):
        TrainConfig(compile="yes")
    with pytest.raises(ValueError, match="doc_attention"):
        TrainConfig(compile=True, doc_attention=True)
    n = 4 * T
    stream = TokenStream(np.arange(n, dtype=np.int32) % V, np.array([0, n]), ["doc"], [])
    monkeypatch.setattr(trainer_mod, "compile_layers",
                        functools.partial(trainer_mod.compile_layers, backend="aot_eager"))
    rows = PackedRows(stream, T, 0)
    cfg = TrainConfig(compile=True, steps=2, batch_size=2, dense_warmup_steps=1, eval_rows=2, recall_rows=0)
    tr = Trainer(toy("msa"), cfg, rows, rows, out_dir=tmp_path, device="cpu", progress=False)
    assert all(layer._compiled_call_impl is not None for layer in tr.model.model.layers)
    recs = [tr.train_step() for _ in range(2)]
    assert [r["mode"] for r in recs] == ["dense", "sparse"] and all(np.isfinite(r["loss"]) for r in recs)
    n = counters["stats"]["unique_graphs"]
    assert n >= 2
    ev = tr.evaluate()
    assert np.isfinite(ev["loss"]) and counters["stats"]["unique_graphs"] == n  # evaluation ran eagerly
    with pytest.raises(ValueError, match="M3DecoderLayer"):
        compile_layers(torch.nn.Linear(2, 2))


def test_cli_compile_flag():
    from msakit.cli import build_parser

    args = build_parser().parse_args(["train", "--compile", "--out", "x"])
    from msakit.commands.options import optim_config

    assert optim_config(args, warn=lambda _: None).compile is True
    args = build_parser().parse_args(["train", "--out", "x"])
    assert optim_config(args, warn=lambda _: None).compile is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels and bf16 autocast need CUDA")
def test_cuda_compiled_steps_equal_eager():
    """The real path: msakit's Triton kernels and the MoE's grouped matmuls, inductor, fullgraph;
    head dims of 32 and blocks of 16 (kernel tiles), T = 64 (4 blocks, top-2), two SGD steps.

    - float16 weights (the kernels take 16-bit inputs) and no near-tied discrete choice: every
      expert routed (top-4 of 4) and every causal block selected (top-4 of 4 blocks), still
      through the MoE and sparse-attention kernels: losses and gradients (relative norm) within
      8 fp16 eps (fused kernels keep fp32 where eager rounds each op's output).
    - bf16 autocast on the toy model's own choices (top-2 experts, top-2 blocks): losses within
      8 bf16 eps.  Gradients are not compared there: rounding flips near-tied top-k choices (an
      expert, a block), and one flip changes whole weights' gradients (measured: a router's by
      ~50%, and by 2-5% with fp16's rounding).
    """
    Tc = 64
    dims = dict(head_dim=32, index_head_dim=32, rotary_dim=16, index_block_size=16, max_position_embeddings=Tc)

    every_choice = dict(num_experts_per_tok=4, index_topk_blocks=4)  # 4 experts, T / 16 = 4 blocks

    def steps(compiled: bool, dtype: torch.dtype):
        torch._dynamo.reset()
        model = toy("msa", **dims, **(every_choice if dtype == torch.float16 else {})).cuda()
        if dtype == torch.float16:
            model = model.half()
        if compiled:
            compile_layers(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(1)
        losses, grads = [], []
        for _ in range(2):
            ids = torch.randint(0, V, (B, Tc), generator=gen).cuda()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                out = model(ids, labels=ids)
            (out.loss + out.kl).backward()
            losses.append((out.loss.item(), out.kl.item()))
            grads.append({n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None})
            opt.step()
            opt.zero_grad(set_to_none=True)
        return losses, grads

    bad = []  # every mismatch of both precisions, so that one run shows them all
    for dtype, tol, compare_grads in ((torch.float16, 8 * torch.finfo(torch.float16).eps, True),
                                      (torch.bfloat16, 8 * torch.finfo(torch.bfloat16).eps, False)):
        eager, comp = steps(False, dtype), steps(True, dtype)
        if counters["graph_break"]:
            bad.append(f"{dtype}: graph breaks {dict(counters['graph_break'])}")
        for step, ((lc, kc), (le, ke)) in enumerate(zip(comp[0], eager[0])):
            if lc != pytest.approx(le, rel=tol) or kc != pytest.approx(ke, rel=tol, abs=tol):
                bad.append(f"{dtype} step {step}: loss {lc:.7g} / {le:.7g}, kl {kc:.7g} / {ke:.7g} (compiled / eager)")
        for step, (gc, ge) in enumerate(zip(comp[1], eager[1]) if compare_grads else ()):
            if set(gc) != set(ge):
                bad.append(f"{dtype} step {step}: gradients of {sorted(set(gc) ^ set(ge))} exist in one run only")
            for name in set(gc) & set(ge):
                err = float((gc[name] - ge[name]).norm() / ge[name].norm().clamp_min(1e-30))
                if not err <= tol:
                    bad.append(f"{dtype} step {step}: {name}: relative error {err:.3g} > {tol:.3g}")
    assert not bad, "\n".join(sorted(bad))
