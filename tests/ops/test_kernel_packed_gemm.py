"""msakit.ops.packed_gemm: the Triton kernels (TRITON_INTERPRET=1 on CPU) and the reference against
the code-by-code float64 restatement (tests/naive.py) and against `unpack_weight` + matmul;
ragged and empty groups, K not a multiple of the tile, odd N, split-K, argument checks; the
packed modules' kernel path against their dequantize-then-matmul path."""

from __future__ import annotations

import pytest
import torch
from naive import naive_packed_weight
from tolerances import sum_tol

from msakit.nn.moe import MoE
from msakit.ops.dispatch import interpret_mode, triton_available
from msakit.ops.packed_gemm import (dequantize_reference, mxfp8_scaled_mm, packed_grouped_mm,
                                    packed_linear)
from msakit.quant.formats import mxfp8_quantize
from msakit.quant.linear import PackedExperts, PackedLinear, pack_weight, unpack_weight

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(not triton_available() or (DEV == "cpu" and not interpret_mode()),
                                  reason="needs CUDA or TRITON_INTERPRET=1")


def packed(G, N, K, fmt, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(G, N, K, generator=g) * torch.rand(G, N, 1, generator=g) * 3
    t = pack_weight(w, fmt)
    sc = t["weight_scale"] if fmt == "nvfp4" else t["weight_scale_inv"]
    return t, (t["weight"].to(DEV), sc.to(DEV), None if fmt == "mxfp8" else t["weight_scale_2"].to(DEV))


def expected(x, counts, wd):
    """float64 rows of group g times wd[g].T (wd: the dequantized weight in x's dtype)."""
    parts = torch.split(x.cpu().double(), [int(c) for c in counts])
    return torch.cat([p @ wd[g].cpu().double().T for g, p in enumerate(parts)])


def check(y, ref, x, K):
    tol = sum_tol(torch.float32, K) + (2 * torch.finfo(x.dtype).eps if x.dtype != torch.float32 else 0.0)
    assert y.dtype == x.dtype and y.shape == ref.shape
    torch.testing.assert_close(y.cpu().double(), ref, rtol=tol, atol=tol * max(float(ref.abs().max()), 1e-30))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_dequantize_reference_is_unpack_weight_and_naive(fmt):
    t, (w, s, gs) = packed(3, 5, 64, fmt)
    for dt in (torch.float32, torch.bfloat16):
        assert torch.equal(dequantize_reference(w.cpu(), s.cpu(), None if gs is None else gs.cpu(), fmt, dt),
                           unpack_weight(t, fmt, dt, backend="reference"))
    ref = naive_packed_weight(w.cpu(), s.cpu(), None if gs is None else gs.cpu(), fmt)
    assert torch.equal(dequantize_reference(w.cpu(), s.cpu(), None if gs is None else gs.cpu(), fmt,
                                            torch.float32).double(), ref)


CASES = [  # (counts, N, K)
    ([3, 0, 17, 1], 24, 96),
    ([0, 0, 1, 0, 2], 37, 64),  # odd N, zero-row groups first and last
    ([1], 16, 48),  # K not a multiple of the tile
    ([5, 4, 0, 9, 2, 1, 0, 3], 40, 160),
]


@needs_kernel
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float16])
def test_grouped_kernel(fmt, case, dt):
    counts, N, K = case
    if fmt == "mxfp8" and K % 32:
        K = 64
    _, (w, s, gs) = packed(len(counts), N, K, fmt, seed=len(counts))
    x = torch.randn(sum(counts), K, generator=torch.Generator().manual_seed(1)).to(DEV, dt)
    c = torch.tensor(counts, device=DEV)
    y = packed_grouped_mm(x, c, w, s, gs, fmt=fmt, backend="triton")
    wd = dequantize_reference(w, s, gs, fmt, dt)
    check(y, expected(x, counts, wd), x, K)
    check(packed_grouped_mm(x, c, w, s, gs, fmt=fmt, backend="reference"), expected(x, counts, wd), x, K)


@needs_kernel
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("cfg", [(16, 16, 32, 3), (32, 32, 64, 2), (64, 16, 128, 1), (16, 32, 64, 2)])
def test_grouped_kernel_tiles_and_split_k(fmt, cfg):
    """Explicit tiles: several row tiles per group, split-K partials summed by the launcher."""
    from msakit.ops.packed_gemm.triton import GemmConfig, grouped_mm_triton

    counts, N, K = [40, 0, 7, 33], 48, 192
    _, (w, s, gs) = packed(len(counts), N, K, fmt, seed=3)
    x = torch.randn(sum(counts), K, generator=torch.Generator().manual_seed(2)).to(DEV, torch.bfloat16)
    bm, bn, bk, split = cfg
    y = grouped_mm_triton(x, torch.tensor(counts, device=DEV), w, s, gs, fmt, GemmConfig(bm, bn, bk, split, 4, 2))
    check(y, expected(x, counts, dequantize_reference(w, s, gs, fmt, torch.bfloat16)), x, K)


@needs_kernel
def test_grouped_kernel_no_rows():
    _, (w, s, gs) = packed(3, 16, 32, "nvfp4")
    x = torch.zeros(0, 32, device=DEV, dtype=torch.bfloat16)
    y = packed_grouped_mm(x, torch.zeros(3, dtype=torch.int64, device=DEV), w, s, gs, fmt="nvfp4", backend="triton")
    assert y.shape == (0, 16) and y.dtype == torch.bfloat16


@needs_kernel
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_packed_linear_matches_unpack_matmul(fmt):
    t, (w, s, gs) = packed(1, 40, 128, fmt, seed=5)
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(0)).to(DEV, torch.bfloat16)
    one = {k: v[0] for k, v in t.items()}
    y = packed_linear(x, w[0], s[0], None if gs is None else gs[0], fmt=fmt, backend="triton")
    wd = unpack_weight(one, fmt, torch.bfloat16).to(DEV)
    check(y.reshape(6, 40), x.reshape(6, 128).double().cpu() @ wd.double().cpu().T, x, 128)


@needs_kernel
@pytest.mark.parametrize("M,N,K", [(33, 40, 96), (1, 16, 32), (130, 24, 256)])
def test_scaled_kernel(M, N, K):
    _, (w, s, _) = packed(1, N, K, "mxfp8", seed=M)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)) * 4
    xc, xs = mxfp8_quantize(x)
    xc, xs = xc.to(DEV), xs.to(DEV)
    ref = dequantize_reference(xc.unsqueeze(0), xs.unsqueeze(0), None, "mxfp8", torch.float64)[0].cpu() @ \
        dequantize_reference(w, s, None, "mxfp8", torch.float64)[0].cpu().T
    for dt in (torch.float32, torch.bfloat16):
        y = mxfp8_scaled_mm(xc, xs, w[0], s[0], out_dtype=dt, backend="triton")
        check(y, ref, torch.empty(0, dtype=dt), K)
        check(mxfp8_scaled_mm(xc, xs, w[0], s[0], out_dtype=dt, backend="reference"), ref,
              torch.empty(0, dtype=dt), K)


def test_argument_checks():
    _, (w, s, gs) = packed(2, 16, 32, "nvfp4")
    x = torch.randn(3, 32, device=DEV)
    c = torch.tensor([1, 2], device=DEV)
    with pytest.raises(ValueError, match="fmt"):
        packed_grouped_mm(x, c, w, s, gs, fmt="int4")
    with pytest.raises(ValueError, match="global_scale"):
        packed_grouped_mm(x, c, w, s, None, fmt="nvfp4")
    with pytest.raises(ValueError, match="counts"):
        packed_grouped_mm(x, c.float(), w, s, gs, fmt="nvfp4")
    with pytest.raises(ValueError, match="weight"):
        packed_grouped_mm(torch.randn(3, 64, device=DEV), c, w, s, gs, fmt="nvfp4")
    with pytest.raises(ValueError, match="scales"):
        packed_grouped_mm(x, c, w, s.view(torch.uint8), gs, fmt="nvfp4")
    with pytest.raises(ValueError, match="x must"):
        packed_grouped_mm(x.double(), c, w, s, gs, fmt="nvfp4")
    with pytest.raises(ValueError, match="x_scales"):
        mxfp8_scaled_mm(x.to(torch.float8_e4m3fn), torch.zeros(3, 2, dtype=torch.uint8, device=DEV), w[0], s[0])


def test_custom_ops_trace():
    """torch.compile sees one node per op (the fake kernels give the shapes)."""
    _, (w, s, gs) = packed(2, 16, 32, "nvfp4")
    x = torch.randn(3, 32, device=DEV)
    c = torch.tensor([1, 2], device=DEV)
    torch.library.opcheck(torch.ops.msakit.packed_grouped_mm.default, (x, c, w, s, gs, "nvfp4", "reference"),
                          test_utils=("test_faketensor",))


# ---------------------------------------------------------------------------------------------
# The packed modules: kernel path == dequantize-then-matmul path
# ---------------------------------------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("rows", [3, 300])  # the weight-only kernel; NVFP4 dequant / MXFP8 FP8 GEMM
def test_packed_linear_module_paths(fmt, rows):
    import msakit.ops.packed_gemm.triton as T

    lin = torch.nn.Linear(64, 48, bias=False)
    pl = PackedLinear.from_float(lin, fmt, compute_dtype=torch.bfloat16).to(DEV)
    x = torch.randn(rows, 64, dtype=torch.bfloat16, device=DEV)
    pl.backend = "reference"
    ref = pl(x)
    pl.backend = "triton"
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        for name in ("grouped_mm_triton", "scaled_mm_triton"):
            f = getattr(T, name)
            mp.setattr(T, name, lambda *a, _f=f, _n=name, **k: (calls.append(_n), _f(*a, **k))[1])
        y = pl(x)
    want = ["grouped_mm_triton"] if rows == 3 else []  # large batches: dequantize then matmul
    assert calls == want
    check(y, ref.double().cpu(), x, 64)


@needs_kernel
def test_packed_experts_kernel_path_and_moe_decode():
    torch.manual_seed(0)
    moe = MoE(64, 8, 2, 32, shared_intermediate_size=16)
    moe.reset_parameters(0.1)
    pe = PackedExperts.from_float(moe.experts, {"w1": "nvfp4", "w3": "nvfp4", "w2": "nvfp4"},
                                  compute_dtype=torch.bfloat16)
    moe.experts = pe
    moe = moe.to(DEV, torch.bfloat16)
    x = torch.randn(3, 64, dtype=torch.bfloat16, device=DEV)
    with torch.no_grad():
        pe.backend = "reference"
        ref, _ = moe(x)
        pe.backend = "triton"
        assert not pe.uses_pairs(x, 2)
        y, _ = moe(x)
    torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2, atol=2e-2 * float(ref.abs().max()))
    counts = torch.tensor([2, 0, 1, 0, 0, 3, 0, 0], device=DEV)
    xs = torch.randn(6, 64, dtype=torch.bfloat16, device=DEV)
    with torch.no_grad():
        y = pe(xs, counts)
        pe.backend = "reference"
        ref = pe(xs, counts)
    torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2, atol=2e-2 * float(ref.abs().max()))


@needs_kernel
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
def test_nvfp4_kernel_weights_bit_exact(dt):
    """x = identity: y = the dequantized weight exactly (one nonzero product per output).  Every
    code, block scales over the whole E4M3 range (zero, subnormal, negative), global scales in the
    kernel's power-of-two fast range and outside it (tiny, huge, negative)."""
    K, N = 64, 24
    # float16: no overflow to inf (the identity's zeros would turn it into NaN); 2^-30 makes subnormals
    gss = [1.7e-3, -0.37, 2.0**-118, 2.0**112 if dt == torch.bfloat16 else 2.0**-30, 5.0]
    G = len(gss)
    g = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 256, (G, N, K // 2), generator=g, dtype=torch.uint8)
    sb = torch.randint(0, 256, (G, N, K // 16), generator=g, dtype=torch.uint8)
    sb[(sb & 0x7F) == 0x7F] = 0x38  # no NaN scales
    sb[0, 0, :2] = torch.tensor([0x00, 0x01], dtype=torch.uint8)  # zero and the smallest subnormal
    scales = sb.view(torch.float8_e4m3fn)
    gs = torch.tensor(gss, dtype=torch.float32)
    x = torch.eye(K, dtype=dt).repeat(G, 1)
    counts = torch.full((G,), K, dtype=torch.int64)
    y = packed_grouped_mm(x.to(DEV), counts.to(DEV), codes.to(DEV), scales.to(DEV), gs.to(DEV), fmt="nvfp4",
                          backend="triton")
    want = dequantize_reference(codes, scales, gs, "nvfp4", dt).transpose(1, 2).reshape(G * K, N)
    assert torch.equal(y.cpu(), want)


@needs_kernel
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("even", [False, True])
def test_mxfp8_kernel_weights_bit_exact(dt, even):
    """x = identity: y = the dequantized weight exactly.  Groups 0 and 1: every row holds all 254
    non-NaN E4M3 codes (zero, the subnormals 0x01-0x07 / 0x81-0x87, +-448) and two zeros; every
    E8M0 scale 0..255 occurs once per group: tiny ones (subnormal and zero results), 127, huge
    ones (inf) and 255 (NaN), in order in group 0 (row 31 has 248..255), in a random order in
    group 1.  Group 2: random codes with the NaN codes 0x7F / 0xFF.  Rows with no inf / NaN
    weight are compared bit for bit with `dequantize_reference`; all rows with the float64 GEMM
    of the dequantized weight, NaN for NaN (the identity's zeros turn an inf weight into NaN
    outputs; the CPU's bfloat16 matmul would flush the subnormal weights).  even: 32 x 64 tiles
    and two K splits (no K / N masks in the kernel); else the library's tiles (N = 32 < 128)."""
    from msakit.ops.packed_gemm.triton import GemmConfig, grouped_mm_triton

    G, N, K = 3, 32, 256
    g = torch.Generator().manual_seed(11)
    codes = torch.stack([torch.randperm(256, generator=g) for _ in range(2 * N)]).reshape(2, N, K)
    codes[(codes & 0x7F) == 0x7F] = 0x00  # the NaN codes: in group 2
    nan_group = torch.randint(0, 256, (1, N, K), generator=g)
    nan_group[0, :4, :2] = torch.tensor([0x7F, 0xFF])
    codes = torch.cat([codes, nan_group]).to(torch.uint8).view(torch.float8_e4m3fn)
    order = torch.stack([torch.arange(256), torch.randperm(256, generator=g), torch.randint(110, 140, (256,), generator=g)])
    scales = order.reshape(G, N, K // 32).to(torch.uint8)
    x = torch.eye(K, dtype=dt).repeat(G, 1)
    counts = torch.full((G,), K, dtype=torch.int64)
    args = (x.to(DEV), counts.to(DEV), codes.to(DEV), scales.to(DEV), None)
    if even:
        y = grouped_mm_triton(*args, "mxfp8", GemmConfig(32, 32, 64, 2, 4, 2)).cpu()
    else:
        y = packed_grouped_mm(*args, fmt="mxfp8", backend="triton").cpu()
    wd = dequantize_reference(codes, scales, None, "mxfp8", dt)  # [G, N, K]
    finite = wd.isfinite().all(-1)  # [G, N]
    assert int(finite[0].sum()) >= 16 and not finite[0, -1] and not finite[2, :4].any()
    want, got = wd.transpose(1, 2), y.reshape(G, K, N)
    for gi in range(G):
        assert torch.equal(got[gi][:, finite[gi]], want[gi][:, finite[gi]])
    torch.testing.assert_close(y.double(), expected(x, counts.tolist(), wd), rtol=0, atol=0, equal_nan=True)


@needs_kernel
@pytest.mark.parametrize("even", [False, True])
def test_mxfp8_f16_path_row_scaling_and_non_finite(even):
    """bfloat16 x on the float16 path (scales within [MX_F16_LO, MX_F16_HI]): each row pre-scaled
    by a power of two into float16.  Rows of huge, tiny and mixed magnitudes, a bfloat16
    subnormal row, zeros, inf and NaN in x, NaN codes: equal to the float64 product of the
    reference's weights within the float32-accumulation tolerance, NaN where it is NaN.  A value
    below 2^-38 of its row's largest (row 5) is flushed by the float16 conversion: the
    documented loss, which also shows that this path ran; with one scale out of the range the
    program takes the bfloat16 dequantization and keeps it."""
    from msakit.ops.packed_gemm.triton import MX_F16_HI, MX_F16_LO, GemmConfig, grouped_mm_triton

    N, K = 40, 128
    _, (w, s, _) = packed(1, N, K, "mxfp8", seed=9)
    assert int(s.min()) >= MX_F16_LO.value and int(s.max()) <= MX_F16_HI.value
    codes = w.view(torch.uint8).clone()
    codes[0, 3, 5] = 0x7F  # a NaN weight: column 3 NaN in every row
    codes[0, 7, :] = 0  # column 7: zero weights but for k = 1
    codes[0, 7, 1] = 0x38  # 1.0
    w = codes.view(torch.float8_e4m3fn)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(8, K, generator=g)
    x[0] *= 1e30
    x[1] *= 1e-30
    x[2, ::2] *= 1e6
    x[2, 1::2] *= 1e-6
    x[3] = 0.0
    x[4] *= 2.0**-130  # bfloat16 subnormals
    x[5] = 0.0
    x[5, 0], x[5, 1] = 2.0**10, 2.0**-40  # column 7 sees only x[5, 1]: 2^-40 * 2^(s - 127)
    x[6, 9] = float("inf")
    x[7, 2] = float("nan")
    x = x.to(DEV, torch.bfloat16)
    counts = torch.tensor([8], device=DEV)
    cfg = GemmConfig(16, 8 if even else 16, 64, 2, 2, 2)  # even: N = 40 = 5 x 8, two K splits
    y = grouped_mm_triton(x, counts, w, s, None, "mxfp8", cfg if even else None)
    wd = dequantize_reference(w, s, None, "mxfp8", torch.bfloat16)
    ref = expected(x, [8], wd)
    fin = torch.isfinite(x.cpu()).all(1)
    assert torch.isnan(y[:, 3].cpu()).all() and torch.isnan(y[7].cpu()).all()
    assert torch.isinf(ref[6]).any() and torch.equal(torch.isnan(y[6].cpu()), torch.isnan(ref[6]))
    assert torch.equal(y[6].cpu().isinf(), ref[6].isinf())
    assert float(y[5, 7]) == 0.0 and float(ref[5, 7]) != 0.0  # the float16 path's flush
    tol = sum_tol(torch.float32, K) + 2 * torch.finfo(torch.bfloat16).eps
    keep = torch.ones(N, dtype=torch.bool)
    keep[3] = keep[7] = False
    for r in range(8):
        if not fin[r]:
            continue
        got, want = y[r].cpu().double()[keep], ref[r][keep]
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * max(float(want.abs().max()), 1e-300))
    s2 = s.clone()
    s2[0, 7, 0] = MX_F16_HI.value + 1  # the program of column 7 and k = 1: out of the float16 range
    y2 = grouped_mm_triton(x, counts, w, s2, None, "mxfp8", cfg if even else None)
    assert float(y2[5, 7]) == float(expected(x, [8], dequantize_reference(w, s2, None, "mxfp8", torch.bfloat16))[5, 7])
