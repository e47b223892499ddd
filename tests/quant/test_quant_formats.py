"""MXFP8 / NVFP4 formats (msakit.quant.formats): hand-computed cases, bit-exactness of the
Triton kernels with the PyTorch reference, cross-checks against torch's own float8 casts and
against torchao where the rules coincide, and argument checks.

The kernels run under TRITON_INTERPRET=1 on CPU (set before triton is imported, as
`make test` does); without it they run on CUDA when a GPU is present (then this file checks
the compiled kernels against the CPU reference), and are skipped otherwise.
"""

from __future__ import annotations

import math
import os
from fractions import Fraction

import pytest
import torch

from msakit.quant import formats as F
from msakit.quant.formats import reference as R

try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover - only the property test needs hypothesis
    given = None

# Interpreted kernels compute with numpy, which warns where a result is inf by design.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

DTYPES = (torch.float32, torch.bfloat16)
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def _kernel_device() -> str | None:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    return None


KDEV = _kernel_device()
needs_kernel = pytest.mark.skipif(KDEV is None, reason="Triton kernels need TRITON_INTERPRET=1 or a CUDA GPU")


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view for bitwise comparison: tells -0.0 from 0.0; every NaN (only made by NaN
    scale or code bytes on dequantization) is made the same NaN first."""
    t = t.detach().cpu().contiguous()
    if t.dtype in (torch.float32, torch.bfloat16, torch.float16):
        t = torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
    ba, bb = bits(a), bits(b)
    if not torch.equal(ba, bb):
        bad = (ba != bb).nonzero()
        i = tuple(bad[0].tolist())
        raise AssertionError(f"{what}: {len(bad)} differing elements, first at {i}: {ba[i]} vs {bb[i]}")


def kernel(fn, *args, **kw):
    """Run a public function with backend='triton' on the kernel device; outputs back on CPU."""
    moved = [a.to(KDEV) if isinstance(a, torch.Tensor) else a for a in args]
    kw = {k: (v.to(KDEV) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    out = fn(*moved, backend="triton", **kw)
    if isinstance(out, tuple):
        return tuple(o.cpu() for o in out)
    return out.cpu()


def ref(fn, *args, **kw):
    return fn(*args, backend="reference", **kw)


def random_rows(shape, dtype, *, lo=-30.0, hi=30.0, seed=0) -> torch.Tensor:
    """Normal values with a per-row scale 10^U(lo, hi) (so blocks span a huge range)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    rows = x.reshape(-1, shape[-1])
    rows *= 10.0 ** (torch.rand(rows.shape[0], 1, generator=g, dtype=torch.float64) * (hi - lo) + lo)
    return x.to(dtype)


def extreme_values(dtype, n_blocks=16, seed=1) -> torch.Tensor:
    """[n_blocks, 32] blocks mixing float32-max-ish, min-normal, 448 * 2^k and signed zeros."""
    g = torch.Generator().manual_seed(seed)
    fmax = torch.finfo(dtype).max
    tiny = torch.finfo(dtype).tiny
    pool = [fmax, -fmax, fmax / 2, tiny, -tiny, 3 * tiny, 0.0, -0.0, 1.0, 6.0, 5.0, 2.5]
    pool += [448.0 * 2.0**k for k in range(-120, 120, 7)]
    pool += [-448.0 * 2.0**k * 1.0000001 for k in range(-100, 100, 13)]
    pool += [240.0 * 2.0**k for k in range(-40, 40, 9)]
    pool = [v for v in pool if abs(v) <= fmax]
    vals = torch.tensor(pool, dtype=torch.float64)
    idx = torch.randint(0, len(pool), (n_blocks, 32), generator=g)
    x = vals[idx]
    x[0] = vals[torch.randperm(len(pool), generator=g)[:32]]
    x[1] = 0.0  # all-zero block
    x[2] = -0.0
    return x.to(dtype)


def subnormal_values(dtype, n_blocks=8, seed=2) -> torch.Tensor:
    """Blocks of the dtype's subnormals (and a few normals to spread the block amaxes)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.float32:
        raw = torch.randint(1, 1 << 23, (n_blocks, 32), generator=g, dtype=torch.int32)
        x = raw.view(torch.float32).clone()
    elif dtype == torch.bfloat16:
        raw = torch.randint(1, 1 << 7, (n_blocks, 32), generator=g, dtype=torch.int16)
        x = raw.view(torch.bfloat16).clone()
    else:
        raw = torch.randint(1, 1 << 10, (n_blocks, 32), generator=g, dtype=torch.int16)
        x = raw.view(torch.float16).clone()
    sign = torch.rand(n_blocks, 32, generator=g) < 0.5
    x = torch.where(sign, -x, x)
    x[0, 0] = 1.0  # a normal block max next to subnormal elements
    x[1, :16] = torch.finfo(dtype).tiny
    return x


def check_all_mxfp8(x: torch.Tensor, what: str) -> None:
    """Kernel == reference bitwise for quantize, dequantize (3 dtypes) and fake-quantize."""
    for rule in F.SCALE_RULES:
        c_r, s_r = ref(F.mxfp8_quantize, x, scale_rule=rule)
        c_k, s_k = kernel(F.mxfp8_quantize, x, scale_rule=rule)
        assert_bits_equal(c_k, c_r, f"{what} {rule} codes")
        assert_bits_equal(s_k, s_r, f"{what} {rule} scales")
        for od in OUT_DTYPES:
            k, r = kernel(F.mxfp8_dequantize, c_r, s_r, od), ref(F.mxfp8_dequantize, c_r, s_r, od)
            assert_bits_equal(k, r, f"{what} {rule} deq {od}")
        f_k = kernel(F.mxfp8_fake_quantize, x, scale_rule=rule)
        assert_bits_equal(f_k, ref(F.mxfp8_fake_quantize, x, scale_rule=rule), f"{what} {rule} fake")
        assert_bits_equal(f_k, ref(F.mxfp8_dequantize, c_r, s_r, x.dtype), f"{what} {rule} fake vs deq(quant)")


def check_all_nvfp4(x: torch.Tensor, what: str, global_scale=None) -> None:
    p_r, b_r, g_r = ref(F.nvfp4_quantize, x, global_scale=global_scale)
    p_k, b_k, g_k = kernel(F.nvfp4_quantize, x, global_scale=global_scale)
    assert_bits_equal(g_k, g_r, f"{what} global scale")
    assert_bits_equal(p_k, p_r, f"{what} packed")
    assert_bits_equal(b_k, b_r, f"{what} block scales")
    for od in OUT_DTYPES:
        k, r = kernel(F.nvfp4_dequantize, p_r, b_r, g_r, od), ref(F.nvfp4_dequantize, p_r, b_r, g_r, od)
        assert_bits_equal(k, r, f"{what} deq {od}")
    f_k = kernel(F.nvfp4_fake_quantize, x, global_scale=global_scale)
    assert_bits_equal(f_k, ref(F.nvfp4_fake_quantize, x, global_scale=global_scale), f"{what} fake")
    assert_bits_equal(f_k, ref(F.nvfp4_dequantize, p_r, b_r, g_r, x.dtype), f"{what} fake vs deq(quant)")


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*packed.shape[:-1], -1)


def e2m1_by_thresholds(q: torch.Tensor) -> torch.Tensor:
    """Independent E2M1 RNE (ModelOpt / TE boundaries): |q| <= 0.25 -> 0, < 0.75 -> 0.5,
    <= 1.25 -> 1, < 1.75 -> 1.5, <= 2.5 -> 2, < 3.5 -> 3, <= 5 -> 4, else 6; returns codes."""
    a = q.abs()
    idx = torch.full(a.shape, 7, dtype=torch.uint8)
    for bound, le, code in [(5.0, True, 6), (3.5, False, 5), (2.5, True, 4), (1.75, False, 3),
                            (1.25, True, 2), (0.75, False, 1), (0.25, True, 0)]:  # fmt: skip
        hit = (a <= bound) if le else (a < bound)
        idx = torch.where(hit, torch.tensor(code, dtype=torch.uint8), idx)
    return idx | (torch.signbit(q).to(torch.uint8) << 3)


# ----------------------------------------------------------------------------------------------
# hand-computed cases
# ----------------------------------------------------------------------------------------------

TIES = [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0)]


def test_e2m1_tie_table_reference():
    v = torch.tensor([t for t, _ in TIES])
    assert e2m1_round_list(v) == [r for _, r in TIES]
    # just off the ties, both ways
    up = torch.nextafter(v, torch.full_like(v, 10.0))
    down = torch.nextafter(v, torch.zeros_like(v))
    assert e2m1_round_list(up) == [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert e2m1_round_list(down) == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0]
    assert e2m1_round_list(torch.tensor([6.0, 7.0, 1e30, float("inf")])) == [6.0] * 4


def e2m1_round_list(v):
    return R.e2m1_round(v).tolist()


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_kernel)])
def test_e2m1_ties_through_nvfp4(backend):
    # global_scale 1 and block amax 6 make the block scale 1 and x / (bs * gs) == x.
    vals = [6.0] + [t for t, _ in TIES] + [-t for t, _ in TIES] + [5.5]
    x = torch.tensor([vals], dtype=torch.float32)
    expect = [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 7]
    run = kernel if backend == "triton" else ref
    packed, bs, gs = run(F.nvfp4_quantize, x, global_scale=1.0)
    assert bs.float().tolist() == [[1.0]] and gs.item() == 1.0
    assert unpack_e2m1(packed).tolist() == [expect]
    assert packed[0, 0].item() == expect[0] | (expect[1] << 4)  # element 0 in the low nibble
    deq = run(F.nvfp4_dequantize, packed, bs, gs, torch.float32)
    assert deq.tolist() == [[6.0, 0, 1, 1, 2, 2, 4, 4, -0.0, -1, -1, -2, -2, -4, -4, 6]]
    assert torch.signbit(deq[0, 8])  # -0.25 -> negative zero


def _mx_block(amax: float) -> list[float]:
    return [amax] + [amax / 4, -amax / 3] * 15 + [0.0]


MX_CASES = [
    # amax, rceil (byte, code of amax), floor (byte, code of amax)
    (448.0 * 8, (130, 0x7E), (130, 0x7E)),  # exactly 448 * 2^k: both rules agree
    (448.0 * 2.0**-20, (107, 0x7E), (107, 0x7E)),
    (float(torch.nextafter(torch.tensor(448.0 * 8), torch.tensor(1e9))), (131, 0x76), (130, 0x7E)),  # 224 vs 448
    (480.0, (128, 0x77), (127, 0x7E)),  # mantissa 1.875: rceil 240, floor saturates 480 -> 448
    (240.0, (127, 0x77), (126, 0x7E)),  # (224, 256): floor halves the scale and saturates
    (1.0, (119, 0x78), (119, 0x78)),  # 2^-8 scale, code 256
    (torch.finfo(torch.float32).max, (247, 0x78), (246, 0x7E)),  # 1.99 * 2^127: 2^120 / 2^119
]


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_kernel)])
def test_mxfp8_hand_cases(backend):
    run = kernel if backend == "triton" else ref
    x = torch.tensor([_mx_block(a) for a, _, _ in MX_CASES] + [[0.0] * 32], dtype=torch.float32)
    for rule, col in (("rceil", 1), ("floor", 2)):
        codes, scales = run(F.mxfp8_quantize, x, scale_rule=rule)
        got = [(s.item(), c.item()) for s, c in zip(scales[:-1, 0], codes.view(torch.uint8)[:-1, 0])]
        assert got == [case[col] for case in MX_CASES], rule
        assert scales[-1, 0].item() == 127 and codes.view(torch.uint8)[-1].eq(0).all()  # all-zero block


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_kernel)])
def test_mxfp8_subnormal_amax_clamps_to_byte_0(backend):
    run = kernel if backend == "triton" else ref
    x = torch.zeros(1, 32)
    x[0, 0] = 2.0**-130  # float32 subnormal amax: the exponent clamps to -127
    x[0, 1] = -(2.0**-135)
    x[0, 2] = 2.0**-149
    for rule in F.SCALE_RULES:
        codes, scales = run(F.mxfp8_quantize, x, scale_rule=rule)
        assert scales.item() == 0
        want = (x * 2.0**127).to(torch.float8_e4m3fn)  # 2^-3, -2^-8, 2^-22 -> 0 (positive)
        assert_bits_equal(codes, want, rule)
        deq = run(F.mxfp8_dequantize, codes, scales, torch.float32)
        assert deq[0, :2].tolist() == [2.0**-130, -(2.0**-135)]


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_kernel)])
def test_negative_zero_convention(backend):
    run = kernel if backend == "triton" else ref
    x = torch.tensor([[1.0, -0.0, 0.0, -1e-30] + [0.5] * 28])
    codes, scales = run(F.mxfp8_quantize, x)
    assert codes.view(torch.uint8)[0, 1:4].tolist() == [0x80, 0x00, 0x80]
    deq = run(F.mxfp8_dequantize, codes, scales, torch.bfloat16)
    assert torch.signbit(deq[0, 1:4]).tolist() == [True, False, True]
    packed, bs, gs = run(F.nvfp4_quantize, x)
    assert unpack_e2m1(packed)[0, 1:4].tolist() == [8, 0, 8]
    deq = run(F.nvfp4_dequantize, packed, bs, gs, torch.float32)
    assert torch.signbit(deq[0, 1:4]).tolist() == [True, False, True]


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_kernel)])
def test_nvfp4_scale_edge_cases(backend):
    run = kernel if backend == "triton" else ref
    gs = 2.0**-12  # a power of two: amax / 6 / gs is exact, block scale t = amax * 2^12 / 6
    u = 6 * gs  # amax giving t = 1
    x = torch.zeros(6, 16)
    x[0, 0] = 448 * u  # t = 448
    x[1, 0] = 896 * u  # t = 896 saturates to 448; x / d = 12 clamps to code 7 (6)
    x[1, 1] = 448 * u
    x[2, 0] = 3 * 2.0**-9 * u  # subnormal E4M3 block scale 3 * 2^-9 (byte 3)
    x[2, 1] = -(2.0**-9) * u  # x / d = -2
    x[3, 0] = 2.0**-10 * u  # t = 2^-10 exactly: the tie rounds to even, block scale 0
    x[3, 1] = -(2.0**-12) * u
    x[4, 0] = 1.0001 * 2.0**-10 * u  # just above the tie: the smallest subnormal, 2^-9
    # x[5]: all-zero block
    packed, bs, g = run(F.nvfp4_quantize, x, global_scale=gs)
    assert bs.view(torch.uint8).flatten().tolist() == [0x7E, 0x7E, 3, 0, 1, 0]
    codes = unpack_e2m1(packed)
    assert codes[0, 0] == 7 and codes[1, :2].tolist() == [7, 7]
    assert codes[2, :2].tolist() == [7, 8 | 4]  # x / d = 6 and -2
    assert codes[3, :2].tolist() == [0, 8]  # zero block scale: magnitude 0, sign kept
    assert codes[4, 0] == 5 and codes[5].eq(0).all()  # 6 * 1.0001 * 2^-10 / 2^-9 = 3.0003 -> 3
    deq = run(F.nvfp4_dequantize, packed, bs, g, torch.float32)
    assert deq[3].eq(0).all() and deq[5].eq(0).all() and torch.isfinite(deq).all()
    assert torch.signbit(deq[3, 1])
    # global scale 0 (an all-zero tensor): everything zero, no NaN
    packed, bs, g = run(F.nvfp4_quantize, torch.zeros(2, 32, dtype=torch.bfloat16))
    assert g.item() == 0 and not torch.signbit(g) and packed.eq(0).all() and bs.view(torch.uint8).eq(0).all()
    assert run(F.nvfp4_dequantize, packed, bs, g, torch.float32).eq(0).all()
    # a given global scale of 0 quantizes anything to zero
    packed, bs, g = run(F.nvfp4_quantize, x, global_scale=0.0)
    assert bs.view(torch.uint8).eq(0).all() and (unpack_e2m1(packed) & 7).eq(0).all()


def test_mxfp8_scale_exponent_is_exact():
    """Integer-exponent scale rules == exact rational arithmetic, near powers of two too."""
    g = torch.Generator().manual_seed(3)
    vals = (torch.rand(400, generator=g, dtype=torch.float64) * 300 - 150).exp2().float()
    edges = [448.0 * 2.0**k for k in range(-140, 120, 3)] + [2.0**k for k in range(-149, 128, 5)]
    vals = torch.cat([vals, torch.tensor(edges, dtype=torch.float32)])
    vals = torch.cat([vals, torch.nextafter(vals, torch.zeros_like(vals)), torch.nextafter(vals, vals * 4)])
    vals = torch.cat([vals, torch.tensor([0.0, torch.finfo(torch.float32).max, 2.0**-149])])
    vals = vals[torch.isfinite(vals)]
    rceil = R.mxfp8_scale_exponent(vals, "rceil").tolist()
    floor = R.mxfp8_scale_exponent(vals, "floor").tolist()
    for a, er, ef in zip(vals.tolist(), rceil, floor):
        if a == 0:
            assert er == ef == 0
            continue
        fa = Fraction(a)
        e = math.frexp(a)[1] - 9  # a candidate near ceil(log2(a / 448)), then adjust exactly
        while fa > 448 * Fraction(2) ** e:
            e += 1
        while fa <= 448 * Fraction(2) ** (e - 1):
            e -= 1
        assert er == max(-127, min(127, e)), a
        assert ef == max(-127, min(127, math.frexp(a)[1] - 1 - 8)), a


def test_rceil_never_needs_saturation():
    for x in (random_rows((64, 64), torch.float32), extreme_values(torch.float32)):
        xb = x.reshape(-1, 32)
        e = R.mxfp8_scale_exponent(xb.abs().amax(-1), "rceil")
        q = xb.double() * torch.pow(2.0, -e.double()).unsqueeze(-1)
        assert q.abs().max() <= 448


# ----------------------------------------------------------------------------------------------
# cross-checks against torch's own casts and independent decodings
# ----------------------------------------------------------------------------------------------


def test_e4m3_rounding_matches_torch_cast():
    g = torch.Generator().manual_seed(4)
    v = (torch.rand(20000, generator=g, dtype=torch.float64) * 44 - 30).exp2().float()
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (grid[1:] + grid[:-1]) / 2  # exact ties
    v = torch.cat([v, grid, mids, torch.nextafter(mids, grid[1:]), torch.nextafter(mids, grid[:-1])])
    want = v.clamp(max=448).to(torch.float8_e4m3fn).float()  # clamp: torch < 2.13 overflows to NaN
    assert_bits_equal(R.e4m3_round(v), want, "e4m3")


def test_e2m1_rounding_matches_thresholds():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(20000, generator=g) * 3
    ties = torch.tensor([t for t, _ in TIES] + [0.0, 6.0, 7.0])
    near = [torch.nextafter(ties, ties + 1), torch.nextafter(ties, ties - 1)]
    q = torch.cat([q, ties, -ties, *near, torch.tensor([-0.0])])
    got = R.e2m1_codes(R.e2m1_round(q), torch.signbit(q))
    assert torch.equal(got, e2m1_by_thresholds(q))


def test_decoders_match_torch():
    b = torch.arange(256, dtype=torch.uint8)
    assert_bits_equal(R.e8m0_decode(b), b.view(torch.float8_e8m0fnu).float(), "e8m0")
    fp4 = torch.tensor(R.E2M1_VALUES + tuple(-v for v in R.E2M1_VALUES))
    assert_bits_equal(R.e2m1_decode(torch.arange(16, dtype=torch.uint8)), fp4, "e2m1")


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_match_torch_casts(dtype):
    """Kernel codes and scales rebuilt through torch's float8_e4m3fn cast and threshold E2M1."""
    x = random_rows((16, 128), dtype, lo=-8, hi=8, seed=6)
    xf = x.float()
    for rule in F.SCALE_RULES:
        codes, scales = kernel(F.mxfp8_quantize, x, scale_rule=rule)
        e = scales.to(torch.int32) - 127
        q = xf.reshape(16, 4, 32) * (((127 - e) << 23).view(torch.float32)).unsqueeze(-1)
        want = q.clamp(-448, 448).to(torch.float8_e4m3fn).reshape(16, 128)
        assert_bits_equal(codes, want, f"mxfp8 {rule} vs torch cast")
    packed, bs, gs = kernel(F.nvfp4_quantize, x)
    assert_bits_equal(gs, xf.abs().max() / torch.tensor(2688.0), "global scale")
    amax = xf.reshape(16, 8, 16).abs().amax(-1)
    t = amax / torch.tensor(6.0) / gs
    assert_bits_equal(bs, t.clamp(max=448).to(torch.float8_e4m3fn), "nvfp4 block scales vs torch cast")
    d = (bs.float() * gs).unsqueeze(-1)
    xb = xf.reshape(16, 8, 16)
    q = torch.where(d == 0, xb * 0, xb / d)  # zero block scale: magnitude 0, sign kept
    assert (d == 0).any() and (d > 0).any()
    assert torch.equal(unpack_e2m1(packed), e2m1_by_thresholds(q).reshape(16, 128))


@needs_kernel
def test_dequant_all_codes():
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(8, 32)
    for byte in (0, 1, 100, 127, 200, 254, 255):
        scales = torch.full((8, 1), byte, dtype=torch.uint8)
        for od in OUT_DTYPES:
            k, r = kernel(F.mxfp8_dequantize, codes, scales, od), ref(F.mxfp8_dequantize, codes, scales, od)
            assert_bits_equal(k, r, f"{byte} {od}")
    packed = torch.arange(256, dtype=torch.uint8).reshape(32, 8)
    bs = torch.arange(0, 256, 8, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(32, 1)
    for gs in (1.0, 1e-30, 3.0e35, 0.0):
        for od in OUT_DTYPES:
            k, r = kernel(F.nvfp4_dequantize, packed, bs, gs, od), ref(F.nvfp4_dequantize, packed, bs, gs, od)
            assert_bits_equal(k, r, f"{gs} {od}")


# ----------------------------------------------------------------------------------------------
# kernels == reference, bitwise
# ----------------------------------------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_random(dtype):
    x = random_rows((4, 12, 96), dtype, seed=7)  # any leading shape; 3 MX blocks, 6 NVFP4 blocks
    check_all_mxfp8(x, "random")
    check_all_nvfp4(x, "random")
    check_all_nvfp4(x, "random, given gs", global_scale=torch.tensor(0.37))


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_extreme(dtype):
    x = extreme_values(dtype)
    check_all_mxfp8(x, "extreme")
    check_all_nvfp4(x, "extreme")
    check_all_nvfp4(x, "extreme, tiny gs", global_scale=1e-38)


@needs_kernel
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
def test_kernels_subnormal(dtype):
    x = subnormal_values(dtype)
    check_all_mxfp8(x, "subnormal")
    check_all_nvfp4(x, "subnormal")
    check_all_nvfp4(x[2:], "all-subnormal tensor")  # float32: the global scale itself is subnormal


@needs_kernel
def test_kernels_float16_and_layouts():
    x = random_rows((3, 64), torch.float16, lo=-4, hi=4, seed=8)
    check_all_mxfp8(x, "fp16")
    check_all_nvfp4(x, "fp16")
    xt = random_rows((64, 32), torch.bfloat16, seed=9).t()  # non-contiguous
    assert_bits_equal(kernel(F.mxfp8_quantize, xt)[0], ref(F.mxfp8_quantize, xt.contiguous())[0], "transposed")
    assert_bits_equal(kernel(F.nvfp4_quantize, xt)[0], ref(F.nvfp4_quantize, xt.contiguous())[0], "transposed")
    x1 = random_rows((64,), torch.float32, seed=10)  # 1-D
    check_all_mxfp8(x1, "1-D")
    check_all_nvfp4(x1, "1-D")
    for bsz in (16, 64):
        assert_bits_equal(
            kernel(F.mxfp8_quantize, x1, scale_block_size=bsz)[0], ref(F.mxfp8_quantize, x1, scale_block_size=bsz)[0], f"bs {bsz}"
        )


E2M1_DECISIONS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _grid_step(v: torch.Tensor, dtype: torch.dtype, k: torch.Tensor) -> torch.Tensor:
    """Positive values v rounded to `dtype`, then moved k representable values (k may be < 0)."""
    r = v.to(dtype)
    ib = torch.int16 if r.element_size() == 2 else torch.int32
    return (r.view(ib) + k.to(ib)).view(dtype)


def nvfp4_decision_blocks(dtype, gs: float, amax_lo: float, amax_hi: float, n_blocks: int = 192, seed: int = 0):
    """[n_blocks, 16] blocks whose elements sit on and next to the E2M1 decision points d * t
    (t = 0.25, ..., 5) of the block's own decode scale d = e4m3(amax / 6 / gs) * gs (no power of
    two): element 0 is the block amax, the others d * t rounded to `dtype` and moved -2..2
    representable values, with random signs."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n_blocks, generator=g, dtype=torch.float64)
    amax = torch.exp(u * (math.log(amax_hi) - math.log(amax_lo)) + math.log(amax_lo)).to(dtype)
    gsf = torch.tensor(gs, dtype=torch.float32)
    d = (R.e4m3_round(amax.float() / torch.tensor(6.0) / gsf) * gsf).double()
    t = torch.tensor(E2M1_DECISIONS, dtype=torch.float64)[torch.randint(0, 7, (n_blocks, 15), generator=g)]
    cand = _grid_step(d[:, None] * t, dtype, torch.randint(-2, 3, (n_blocks, 15), generator=g))
    cand = torch.where(torch.rand(n_blocks, 15, generator=g) < 0.5, -cand, cand)
    return torch.cat([amax[:, None], cand], dim=1)


@needs_kernel
@pytest.mark.parametrize(
    "dtype, gs, amax_lo, amax_hi",
    [
        (torch.float32, 0.0137, 0.5, 4.0e3),
        (torch.float32, 3.3e-30, 1.0e-29, 5.0e-27),
        (torch.float32, 7.0e-40, 5.0e-39, 1.0e-36),  # subnormal global and decode scales
        (torch.bfloat16, 0.0137, 0.5, 4.0e3),
        (torch.bfloat16, 1.1e-35, 1.0e-34, 1.0e-32),
        (torch.float16, 0.0137, 0.1, 30.0),
        (torch.float16, 2.1e-6, 1.0e-5, 5.0e-3),  # float16-subnormal elements
        (torch.float32, 2.0**-7, 0.5, 4.0e3),  # power-of-two scales: exact ties q == t
        (torch.bfloat16, 2.0**-7, 0.5, 4.0e3),
        (torch.float16, 2.0**-10, 1.0e-3, 30.0),
    ],
)
def test_nvfp4_decision_points(dtype, gs, amax_lo, amax_hi):
    """The kernels decide E2M1 codes without dividing (|x| against per-block bounds, see
    formats/triton.py); elements on and around every decision point, with decode scales that
    are not powers of two, give the reference's codes and values bit for bit."""
    x = nvfp4_decision_blocks(dtype, gs, amax_lo, amax_hi, seed=int(amax_lo * 1e3 + gs * 1e4) % 97)
    check_all_nvfp4(x, f"decision points {dtype} gs={gs}", global_scale=gs)
    check_all_nvfp4(x[:, torch.randperm(16, generator=torch.Generator().manual_seed(3))], "permuted", global_scale=gs)


@needs_kernel
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_nvfp4_hset2_compare_variant(dtype):
    """The NVFP4 quantize kernels' alternative packed comparison (set.gt.{bf16,f16}x2 instead of
    integer arithmetic, packed_compare="hset2"): the same bits on decision points, subnormal
    and extreme inputs (on CUDA this checks the hardware comparison's semantics)."""
    from msakit.quant.formats.triton import nvfp4_fake_quantize_triton, nvfp4_quantize_triton

    gs_dec = 0.0137 if dtype == torch.bfloat16 else 2.1e-6
    lo, hi = (0.5, 4.0e3) if dtype == torch.bfloat16 else (1.0e-5, 5.0e-3)
    cases = [
        (nvfp4_decision_blocks(dtype, gs_dec, lo, hi, seed=5), gs_dec),
        (nvfp4_decision_blocks(dtype, 2.0**-7, 0.5, 30.0, seed=6), 2.0**-7),
        (subnormal_values(dtype), None),
        (extreme_values(dtype), None),
        (random_rows((4, 12, 96), dtype, lo=-4, hi=4, seed=7), None),
    ]
    for x, gs in cases:
        p_r, b_r, g_r = ref(F.nvfp4_quantize, x, global_scale=gs)
        xk, gk = x.to(KDEV), g_r.to(KDEV)
        p_k, b_k = nvfp4_quantize_triton(xk, gk, packed_compare="hset2")
        assert_bits_equal(p_k.cpu(), p_r, f"hset2 packed {dtype}")
        assert_bits_equal(b_k.cpu(), b_r, f"hset2 block scales {dtype}")
        f_k = nvfp4_fake_quantize_triton(xk, gk, packed_compare="hset2")
        assert_bits_equal(f_k.cpu(), ref(F.nvfp4_fake_quantize, x, global_scale=gs), f"hset2 fake {dtype}")
    with pytest.raises(ValueError, match="packed_compare"):
        nvfp4_quantize_triton(x.to(KDEV), gk, packed_compare="vset2")


@needs_kernel
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
def test_nvfp4_per_group_global_scale(dtype):
    """A 1-D global_scale of G entries (rows split into G equal groups, each with its own scale)
    equals the reference applied group by group, bit for bit: quantize, and fake-quantize into
    every output dtype (one rounding of the float32 value).  G == 1 is the plain launcher; a G
    that does not split the rows is an error."""
    from msakit.quant.formats.triton import nvfp4_fake_quantize_triton, nvfp4_quantize_triton

    # 6 blocks per group: groups straddle the 4-block tiles below, and the 30 blocks leave the last
    # tile partial (the kernels' masked path), at a third of the interpreted programs of 18 per group
    G, N, K = 5, 3, 32
    x = random_rows((G, N, K), dtype, lo=-4, hi=4, seed=41)
    x[1, 2, :16] = 0
    x[3] = extreme_values(dtype, n_blocks=N * K // 32, seed=4).reshape(N, K)
    gs = torch.tensor([0.013, 2.0**-7, 0.0, 3.5e-3, 1.7], dtype=torch.float32)
    gs[3] = F.nvfp4_global_scale(x[3])
    xk, gk = x.to(KDEV), gs.to(KDEV)
    for tile in (None, 64):  # the default tile, and 4 blocks per program
        p_k, b_k = nvfp4_quantize_triton(xk, gk, tile_elems=tile)
        for g in range(G):
            p_r, b_r, _ = ref(F.nvfp4_quantize, x[g], global_scale=gs[g])
            assert_bits_equal(p_k[g].cpu(), p_r, f"grouped packed {dtype} group {g}")
            assert_bits_equal(b_k[g].cpu(), b_r, f"grouped block scales {dtype} group {g}")
        for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
            f_k = nvfp4_fake_quantize_triton(xk, gk, out_dtype=out_dtype, tile_elems=tile).cpu()
            for g in range(G):
                want = ref(F.nvfp4_fake_quantize, x[g].float(), global_scale=gs[g]).to(out_dtype)
                assert_bits_equal(f_k[g], want, f"grouped fake {dtype}->{out_dtype} group {g}")
    # rows 2D [G * N, K] split the same way; one entry is the plain (scalar) launcher
    f2 = nvfp4_fake_quantize_triton(xk.reshape(G * N, K), gk).cpu()
    assert_bits_equal(f2, nvfp4_fake_quantize_triton(xk, gk).cpu().reshape(G * N, K), "2-D rows")
    assert_bits_equal(nvfp4_fake_quantize_triton(xk, gk[1:2]).cpu(),
                      ref(F.nvfp4_fake_quantize, x, global_scale=gs[1]), "one-entry scale")  # fmt: skip
    with pytest.raises(ValueError, match="equal groups"):
        nvfp4_fake_quantize_triton(xk, gk[:4])


@needs_kernel
def test_kernels_misaligned_storage():
    """Views whose data pointer is not 4- / 8-byte aligned (the NVFP4 kernels read and write
    int32 / int64 views): copied, same bits as the reference."""
    base = random_rows((2 + 4 * 64,), torch.bfloat16, lo=-3, hi=3, seed=31).to(KDEV)
    x = base[1 : 1 + 4 * 64].view(4, 64)
    assert x.data_ptr() % 4 == 2
    check_all_nvfp4(x.cpu(), "aligned copy")
    p_k, b_k, g_k = kernel(F.nvfp4_quantize, x)
    p_r, b_r, g_r = ref(F.nvfp4_quantize, x.cpu())
    assert_bits_equal(p_k, p_r, "misaligned packed")
    assert_bits_equal(b_k, b_r, "misaligned block scales")
    assert_bits_equal(kernel(F.nvfp4_fake_quantize, x), ref(F.nvfp4_fake_quantize, x.cpu()), "misaligned fake")
    buf = torch.zeros(p_r.numel() + 4, dtype=torch.uint8, device=KDEV)
    pm = buf[4:].view(p_r.shape)
    pm.copy_(p_r.to(KDEV))
    assert pm.data_ptr() % 8 == 4
    for od in OUT_DTYPES:
        k, r = kernel(F.nvfp4_dequantize, pm, b_r, g_r, od), ref(F.nvfp4_dequantize, p_r, b_r, g_r, od)
        assert_bits_equal(k, r, f"misaligned deq {od}")


@needs_kernel
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
def test_amax_scale_kernel(dtype):
    """nvfp4_amax_scale_triton == (amax(|x|), nvfp4_global_scale_ref(x)) bit for bit, including
    subnormal-only and empty tensors, sizes that do not fill the last program, and NaN / inf."""
    from msakit.quant.formats.triton import nvfp4_amax_scale_triton

    xs = [
        random_rows((7, 96), dtype, seed=40),
        extreme_values(dtype),
        subnormal_values(dtype)[2:],
        torch.zeros(3, 16, dtype=dtype),
        -torch.zeros(0, 16, dtype=dtype),
        random_rows((5, 33), dtype, seed=41),
    ]
    for x in xs:
        for block in (64, 16384):
            amax, gs = nvfp4_amax_scale_triton(x.to(KDEV), block=block)
            want = x.abs().amax().float() if x.numel() else torch.zeros(())
            assert_bits_equal(amax.cpu(), want, f"amax {tuple(x.shape)}")
            assert_bits_equal(gs.cpu(), R.nvfp4_global_scale_ref(x), f"gs {tuple(x.shape)}")
    for bad in (float("inf"), float("nan")):
        x = random_rows((4, 32), dtype, seed=42)
        x[2, 5] = bad
        amax, _ = nvfp4_amax_scale_triton(x.to(KDEV))
        assert (torch.isinf if bad == float("inf") else torch.isnan)(amax.cpu())


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_float64_division_by_six_is_exact_for_16bit(dtype):
    """The NVFP4 kernels compute RN32(amax / 6) for a bfloat16 / float16 amax as
    RN32(RN64(amax * RN64(1/6))): exhaustively equal to the float32 division."""
    a = torch.arange(1, 0x7F80 if dtype == torch.bfloat16 else 0x7C00, dtype=torch.int16).view(dtype).float()
    want = a / torch.tensor(6.0)
    got = (a.double() * (1.0 / 6.0)).float()
    assert_bits_equal(got, want, f"{dtype} amax / 6")


def test_float64_reciprocal_division():
    """RN32(u / g) == RN32(RN64(u * RN64(1/g))) for float32 u, g (the block scale's division by
    the global scale), on random pairs, pairs with exact quotients, and subnormal operands."""
    g = torch.Generator().manual_seed(32)
    u = (torch.rand(200000, generator=g, dtype=torch.float64) * 120 - 60).exp2().float()
    d = (torch.rand(200000, generator=g, dtype=torch.float64) * 120 - 60).exp2().float()
    small = torch.randint(1, 1 << 12, (20000,), generator=g).float()
    u = torch.cat([u, small * 3, small, torch.tensor([2.0**-149, 3 * 2.0**-149, 2.0**-130])])
    d = torch.cat([d, small, small / 8, torch.tensor([2.0**-149, 2.0**-148, 7 * 2.0**-140])])
    want = u / d
    got = (u.double() * (1.0 / d.double())).float()
    normal = want.abs() >= torch.finfo(torch.float32).tiny  # below: block scale 0 either way
    assert_bits_equal(got[normal], want[normal], "u / gs")


def _property_body(lead, n32, lo, span, dtype, seed):
    """Random leading shape, K, dtype and per-row scales 10^U(lo, lo + span): kernel == reference."""
    shape = (*lead, 32 * n32)
    hi = min(lo + span, 36.0)
    if dtype == torch.float16:
        lo = min(max(lo, -9.0), 3.0)
        hi = min(lo + span, 4.0)
    x = random_rows(shape, dtype, lo=lo, hi=hi, seed=seed)
    for rule in F.SCALE_RULES:
        c_r, s_r = ref(F.mxfp8_quantize, x, scale_rule=rule)
        c_k, s_k = kernel(F.mxfp8_quantize, x, scale_rule=rule)
        assert_bits_equal(c_k, c_r, f"codes {rule}")
        assert_bits_equal(s_k, s_r, f"scales {rule}")
        assert_bits_equal(kernel(F.mxfp8_fake_quantize, x, scale_rule=rule), ref(F.mxfp8_dequantize, c_r, s_r, dtype))
    p_r, b_r, g_r = ref(F.nvfp4_quantize, x)
    p_k, b_k, _ = kernel(F.nvfp4_quantize, x)
    assert_bits_equal(p_k, p_r, "packed")
    assert_bits_equal(b_k, b_r, "block scales")
    assert_bits_equal(kernel(F.nvfp4_fake_quantize, x), ref(F.nvfp4_dequantize, p_r, b_r, g_r, dtype), "fake")


if given is not None:

    @needs_kernel
    @settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(
        lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
        n32=st.integers(1, 4),
        lo=st.floats(-40, 20),
        span=st.floats(0, 30),
        dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
        seed=st.integers(0, 2**31 - 1),
    )
    def test_kernels_property(lead, n32, lo, span, dtype, seed):
        _property_body(lead, n32, lo, span, dtype, seed)

else:  # pragma: no cover

    @pytest.mark.skip(reason="hypothesis is not installed")
    def test_kernels_property():
        pass


# ----------------------------------------------------------------------------------------------
# round trips
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_mxfp8_round_trip_error(dtype):
    x = random_rows((32, 256), dtype, lo=-20, hi=20, seed=11)
    xf = x.float().reshape(32, 8, 32)
    for rule in F.SCALE_RULES:
        codes, scales = ref(F.mxfp8_quantize, x, scale_rule=rule)
        deq = ref(F.mxfp8_dequantize, codes, scales, torch.float32).reshape(32, 8, 32)
        step = R.e8m0_decode(scales).unsqueeze(-1)
        # half an E4M3 ulp: 2^-4 relative for normals, 2^-10 * scale for subnormals
        bound = torch.maximum(xf.abs() * 2.0**-4, step * 2.0**-10)
        if rule == "floor":  # plus the saturation of mantissas above 1.75
            bound = torch.maximum(bound, xf.abs() - 448 * step)
        assert ((deq - xf).abs() <= bound).all(), rule
        assert (deq.abs() <= xf.abs().amax(-1, keepdim=True) * (1 + 2.0**-4)).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_round_trip_error(dtype):
    x = random_rows((32, 256), dtype, lo=-1, hi=1, seed=12)
    packed, bs, gs = ref(F.nvfp4_quantize, x)
    deq = ref(F.nvfp4_dequantize, packed, bs, gs, torch.float32).reshape(32, 16, 16)
    xf = x.float().reshape(32, 16, 16)
    d = (bs.float() * gs).unsqueeze(-1)
    # largest E2M1 half-gap is 1 (between 4 and 6); clamping at 6 loses at most 6 * 2^-4
    assert ((deq - xf).abs() <= d * 1.0 * (1 + 1e-6)).all()
    rel = (deq - xf).norm() / xf.norm()
    assert rel < 0.12, rel


@pytest.mark.parametrize("rule", F.SCALE_RULES)
def test_idempotence(rule):
    """quantize(dequantize(q)) == q with the same rule (and the same NVFP4 global scale):
    the check to run on checkpoint tensors to learn whether their scales are re-derivable."""
    x = random_rows((16, 128), torch.float32, lo=-3, hi=3, seed=13)
    codes, scales = ref(F.mxfp8_quantize, x, scale_rule=rule)
    c2, s2 = ref(F.mxfp8_quantize, ref(F.mxfp8_dequantize, codes, scales, torch.float32), scale_rule=rule)
    assert_bits_equal(c2, codes)
    assert_bits_equal(s2, scales)
    # NVFP4 only for blocks with normal E4M3 scales (their max code is always 6); a subnormal
    # block scale can leave a max code below 6, and re-deriving the scale then changes it.
    x = random_rows((16, 128), torch.float32, lo=-1, hi=1, seed=13)
    packed, bs, gs = ref(F.nvfp4_quantize, x)
    assert bs.float().min() >= 2.0**-6
    p2, b2, _ = ref(F.nvfp4_quantize, ref(F.nvfp4_dequantize, packed, bs, gs, torch.float32), global_scale=gs)
    assert_bits_equal(p2, packed)
    assert_bits_equal(b2, bs)


def test_global_scale_forms_agree():
    x = random_rows((4, 64), torch.bfloat16, seed=14)
    gs = F.nvfp4_global_scale(x)
    a = ref(F.nvfp4_quantize, x)
    for given in (gs, gs.item(), gs.double()):
        b = ref(F.nvfp4_quantize, x, global_scale=given)
        for u, v in zip(a, b):
            assert_bits_equal(u, v)


def test_public_default_backend_on_cpu_is_reference():
    x = random_rows((2, 64), torch.float32, seed=15)
    assert_bits_equal(F.mxfp8_quantize(x)[0], R.mxfp8_quantize_ref(x)[0])
    assert_bits_equal(F.nvfp4_fake_quantize(x), R.nvfp4_fake_quantize_ref(x))
    assert F.mxfp8_fake_quantize(x.requires_grad_()).requires_grad is False


# ----------------------------------------------------------------------------------------------
# argument checks
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_kernel)])
def test_value_errors(backend):
    dev = KDEV if backend == "triton" else "cpu"
    x = torch.randn(2, 64, device=dev)
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[1, 3] = bad
        for fn in (F.mxfp8_quantize, F.mxfp8_fake_quantize, F.nvfp4_quantize, F.nvfp4_fake_quantize):
            with pytest.raises(ValueError, match="NaN or inf"):
                fn(y, backend=backend)
        with pytest.raises(ValueError, match="NaN or inf"):
            F.nvfp4_quantize(y, global_scale=1.0, backend=backend)
    with pytest.raises(ValueError, match="divisible"):
        F.mxfp8_quantize(torch.randn(2, 48, device=dev), backend=backend)
    with pytest.raises(ValueError, match="divisible"):
        F.nvfp4_quantize(torch.randn(2, 40, device=dev), backend=backend)
    with pytest.raises(ValueError, match="scale_rule"):
        F.mxfp8_quantize(x, scale_rule="nearest", backend=backend)
    with pytest.raises(ValueError, match="block_size"):
        F.mxfp8_quantize(x, scale_block_size=24, backend=backend)
    with pytest.raises(ValueError, match="x must be"):
        F.mxfp8_quantize(x.double(), backend=backend)
    with pytest.raises(ValueError, match="x must be"):
        F.nvfp4_quantize(x.to(torch.int32), backend=backend)
    with pytest.raises(ValueError, match="global_scale"):
        F.nvfp4_quantize(x, global_scale=-1.0, backend=backend)
    with pytest.raises(ValueError, match="global_scale"):
        F.nvfp4_quantize(x, global_scale=torch.tensor([float("nan")]), backend=backend)
    with pytest.raises(ValueError, match="global_scale"):
        F.nvfp4_quantize(x, global_scale=torch.ones(2), backend=backend)
    codes, scales = F.mxfp8_quantize(x, backend=backend)
    with pytest.raises(ValueError, match="scales"):
        F.mxfp8_dequantize(codes, scales[:1], backend=backend)
    with pytest.raises(ValueError, match="multiple"):
        F.mxfp8_dequantize(codes, torch.zeros(2, 3, dtype=torch.uint8, device=dev), backend=backend)
    with pytest.raises(ValueError, match="codes must be"):
        F.mxfp8_dequantize(codes.view(torch.uint8), scales, backend=backend)
    with pytest.raises(ValueError, match="scales must be"):
        F.mxfp8_dequantize(codes, scales.float(), backend=backend)
    with pytest.raises(ValueError, match="block_size"):
        F.mxfp8_dequantize(codes, scales, scale_block_size=16, backend=backend)
    with pytest.raises(ValueError, match="dtype"):
        F.mxfp8_dequantize(codes, scales, torch.float64, backend=backend)
    packed, bs, gs = F.nvfp4_quantize(x, backend=backend)
    with pytest.raises(ValueError, match="8 x block_scales"):
        F.nvfp4_dequantize(packed, bs[:, :2], gs, backend=backend)
    with pytest.raises(ValueError, match="block_scales must be"):
        F.nvfp4_dequantize(packed, bs.view(torch.uint8), gs, backend=backend)
    with pytest.raises(ValueError, match="packed must be"):
        F.nvfp4_dequantize(packed.float(), bs, gs, backend=backend)
    with pytest.raises(ValueError, match="leading"):
        F.nvfp4_dequantize(packed[:1], bs, gs, backend=backend)
    with pytest.raises(ValueError, match="backend"):
        F.mxfp8_quantize(x, backend="cuda")


# ----------------------------------------------------------------------------------------------
# torchao, where the rules coincide
# ----------------------------------------------------------------------------------------------


def _torchao():
    pytest.importorskip("torchao")
    try:
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_mx
        from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale
    except ImportError as e:  # pragma: no cover - an incompatible torchao
        pytest.skip(f"torchao mx_formats not importable: {e}")
    return ScaleCalculationMode, to_mx, nvfp4_quantize, per_tensor_amax_to_scale


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rule", F.SCALE_RULES)
def test_mxfp8_agrees_with_torchao(dtype, rule):
    """torchao to_mx: same bits for blocks with a normal, non-zero amax.  (torchao gives an
    all-zero block byte 0 and divides float32-subnormal-amax blocks by 2^-126; its eager RCEIL
    uses ceil(log2(amax / 448)) in float32, inexact for amax within ~2^-17 of 1.75 * 2^k.)"""
    mode, to_mx, _, _ = _torchao()
    x = random_rows((64, 256), dtype, lo=-12, hi=12, seed=16)
    scale_ao, data_ao = to_mx(x, torch.float8_e4m3fn, 32, getattr(mode, rule.upper()))
    codes, scales = ref(F.mxfp8_quantize, x, scale_rule=rule)
    assert_bits_equal(scale_ao.view(torch.uint8), scales, "scales")
    assert_bits_equal(data_ao, codes, "codes")


@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_agrees_with_torchao(dtype):
    """torchao nvfp4_quantize with per_tensor_scale: identical block scales (ours are never
    below 2^-6 here, torchao's lower clamp); identical codes except where x / (bs * gs) and
    torchao's x * ((1 / gs) / bs) fall on two sides of an E2M1 rounding boundary."""
    _, _, nvfp4_quantize_ao, amax_to_scale = _torchao()
    x = random_rows((64, 256), dtype, lo=-1, hi=1, seed=17)
    gs = amax_to_scale(x.float().abs().max())
    scales_ao, packed_ao = nvfp4_quantize_ao(x, 16, gs)
    packed, bs, g = ref(F.nvfp4_quantize, x, global_scale=gs)
    assert bs.float().min() >= 2.0**-6
    assert_bits_equal(scales_ao, bs, "block scales")
    c_ao, c = unpack_e2m1(packed_ao), unpack_e2m1(packed)
    diff = c_ao != c
    assert diff.float().mean() < 1e-3
    assert ((c_ao.to(torch.int16) - c.to(torch.int16))[diff].abs() == 1).all()


def test_nvfp4_tie_rounding_differs_from_torchao_reciprocal():
    """Exact ties x / (bs * gs) round to even here; torchao 0.18 multiplies by
    (1 / gs) / bs, which lands an ulp above the tie (1.25 -> 1.5, 2.5 -> 3, 5 -> 6)."""
    bs = 15 * 2.0**-9  # E4M3 0x0F; with gs = 1 the block amax 6 * bs gives block scale bs
    x = torch.tensor([[6 * bs, 1.25 * bs, 2.5 * bs, 5 * bs] + [0.0] * 12])
    packed, scales, _ = ref(F.nvfp4_quantize, x, global_scale=1.0)
    assert scales.float().item() == bs
    assert unpack_e2m1(packed)[0, :4].tolist() == [7, 2, 4, 6]
    _, _, nvfp4_quantize_ao, _ = _torchao()
    _, packed_ao = nvfp4_quantize_ao(x, 16, torch.tensor(1.0))
    assert unpack_e2m1(packed_ao)[0, :4].tolist() in ([7, 3, 5, 7], [7, 2, 4, 6])
