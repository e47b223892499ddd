"""routed_experts: the Triton kernels (TRITON_INTERPRET=1 on CPU) and the reference against the
row-by-row float64 restatement (tests/naive.py), argument checks, and MoE's decode path against
its sorted grouped path."""

from __future__ import annotations

import pytest
import torch
from naive import naive_routed_experts
from tolerances import sum_tol

from msakit.nn.moe import MoE
from msakit.ops.dispatch import interpret_mode, triton_available
from msakit.ops.moe import routed_experts, routed_experts_reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(not triton_available() or (DEV == "cpu" and not interpret_mode()),
                                  reason="needs CUDA or TRITON_INTERPRET=1")


def make(N, k, E, I, H, dt, wdt=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    w = torch.rand(N, k, generator=g)
    ws = [torch.randn(E, I, H, generator=g) * H**-0.5, torch.randn(E, I, H, generator=g) * H**-0.5,
          torch.randn(E, H, I, generator=g) * I**-0.5]
    wdt = wdt or dt
    return x.to(DEV, dt), idx.to(DEV), w.to(DEV), *[t.to(DEV, wdt) for t in ws]


def check(y, args, dt):
    """y against the float64 restatement of the same (rounded) inputs: a length-H (gate / up) and
    length-I (down) reduction, plus one rounding to dt per stage for 16-bit inputs."""
    x, idx, w, w1, w3, w2 = args
    ref = naive_routed_experts(*(t.cpu() for t in args))
    n = max(w1.shape[1], w1.shape[2])
    tol = sum_tol(torch.float32, n) + (8 * torch.finfo(dt).eps if dt != torch.float32 else 0.0)
    scale = float(ref.abs().max())
    assert y.dtype == torch.float32 and y.shape == ref.shape
    torch.testing.assert_close(y.cpu().double(), ref, rtol=tol, atol=tol * scale)


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 4, 16, 64, 48), (3, 2, 5, 24, 40), (2, 1, 3, 200, 136), (8, 4, 6, 8, 16)])
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_kernel_matches_naive(shape, dt):
    args = make(*shape, dt)
    check(routed_experts(*args, backend="triton"), args, dt)


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_reference_matches_naive(dt):
    args = make(3, 2, 5, 24, 40, dt)
    check(routed_experts(*args, backend="reference"), args, dt)


@needs_kernel
def test_kernel_strided_and_wider_weights():
    """Weights as transposed views (any strides) and in float32 under bf16 x (rounded on load):
    equal to the reference given the bf16-rounded weights."""
    x, idx, w, w1, w3, w2 = make(2, 2, 4, 40, 24, torch.bfloat16, wdt=torch.float32)
    w1t = w1.transpose(1, 2).contiguous().transpose(1, 2)  # [E, I, H] with strides of [E, H, I]
    y = routed_experts(x, idx, w, w1t, w3, w2, backend="triton")
    args = (x, idx, w, w1.bfloat16(), w3.bfloat16(), w2.bfloat16())
    check(y, args, torch.bfloat16)
    y_ref = routed_experts_reference(*args)
    torch.testing.assert_close(y, y_ref, rtol=0.05, atol=0.05 * float(y_ref.abs().max()))


def test_checks():
    x, idx, w, w1, w3, w2 = make(2, 2, 4, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="idx"):
        routed_experts(x, idx.float(), w, w1, w3, w2)
    with pytest.raises(ValueError, match="idx and w"):
        routed_experts(x, idx, w[:, :1], w1, w3, w2)
    with pytest.raises(ValueError, match="w1 / w3"):
        routed_experts(x, idx, w, w1, w3, w2.transpose(1, 2))
    with pytest.raises(ValueError, match="x must have 2"):
        routed_experts(x[None], idx, w, w1, w3, w2)
    with pytest.raises(ValueError, match="backend"):
        routed_experts(x, idx, w, w1, w3, w2, backend="fast")


def test_op_fake_and_schema():
    """The custom op's fake kernel and schema (what torch.compile traces)."""
    x, idx, w, w1, w3, w2 = make(2, 2, 4, 8, 16, torch.float32)
    torch.library.opcheck(torch.ops.msakit.routed_experts.default, (x, idx, w, w1, w3, w2, 1.702, 7.0, "reference"),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("N", [1, 3])
def test_moe_pairs_path_matches_grouped(N):
    """MoE.forward's decode path (forward_pairs, unsorted) equals its sorted grouped path."""
    torch.manual_seed(0)
    moe = MoE(32, 6, 2, 24, shared_intermediate_size=16).to(DEV)
    moe.reset_parameters(0.2)
    x = torch.randn(N, 32, device=DEV)
    with torch.no_grad():
        y, load = moe(x)
        w, idx = moe.route(x)
        y_pairs = moe.experts.forward_pairs(x, idx, w) + moe.shared_experts(x).float()
    assert float(load.sum()) == N * 2
    tol = sum_tol(torch.float32, 32)
    torch.testing.assert_close(y_pairs, y.float(), rtol=tol, atol=tol * float(y.abs().max()))


def test_moe_uses_pairs_rules():
    moe = MoE(32, 6, 2, 24).to(DEV)
    x = torch.randn(3, 32, device=DEV)
    with torch.no_grad():
        assert moe.experts.uses_pairs(x, 2) == (DEV == "cuda")  # CPU: the reference would not be faster
        assert not moe.experts.uses_pairs(torch.randn(40, 32, device=DEV), 2)  # 80 pairs > FEW_PAIRS
    assert not moe.experts.uses_pairs(x, 2)  # autograd through the experts' weights
