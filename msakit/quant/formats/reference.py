"""Pure-PyTorch reference of the MXFP8 and NVFP4 block formats: the definition the Triton
kernels (``triton.py``) are bit-exact with.  See docs/formats.md for the layouts.

Both formats block the LAST dimension.  Every function here is a small pure function that
assumes valid arguments (finite input, K divisible by the block): the public entry points in
``msakit.quant.formats`` validate and dispatch.

Element rounding is written as "round to a grid" with ``torch.frexp`` (exact exponent),
a power-of-two quantum (exact scaling) and ``torch.round`` (round half to even), which is
independent of both torch's own float8 cast and the kernels' integer bit manipulation; the
tests cross-check all three.

Conventions (the same in the kernels, and documented in docs/formats.md):

* Negative zero: the sign bit of every code is the sign bit of the input element, so -0.0
  and negative values that round to zero give the negative-zero code (E4M3 0x80, E2M1 8) and
  dequantize to -0.0.  This is what the hardware conversions (``cvt.rn.satfinite``), torch's
  ``.to(float8_e4m3fn)`` and torchao's ``f32_to_f4_unpacked`` do.
* MXFP8 scale exponents are computed from the float32 bits of the block amax (integer
  exponent arithmetic, no log2) and clamped to the E8M0 range [-127, 127]; an all-zero block
  gets exponent 0 (byte 127) and zero codes.
* NVFP4: a block whose amax is 0, or whose scale ``amax/6/global_scale`` rounds to E4M3 zero
  (<= 2^-10), and every block when ``global_scale == 0``, gets block scale 0; elements whose
  decode scale ``block_scale * global_scale`` is 0 (those blocks, or a float32 underflow of
  the product) get magnitude code 0 -- no division by zero, no NaN -- and dequantize to
  (signed) zero.  A scale ``amax/6/global_scale`` above 448 (possible only with a given
  global scale) saturates to 448.
* All float arithmetic is float32 with IEEE round-to-nearest-even; divisions are true
  divisions by tensors on the same device (torch turns a division by a Python/CPU scalar on
  CUDA into a multiplication by the reciprocal, which rounds differently).
"""

from __future__ import annotations

import torch

__all__ = [
    "E4M3_MAX",
    "E2M1_MAX",
    "E8M0_BIAS",
    "NVFP4_BLOCK",
    "NVFP4_GLOBAL_DIVISOR",
    "SCALE_RULES",
    "pow2",
    "e4m3_round",
    "e2m1_round",
    "e2m1_codes",
    "e2m1_decode",
    "e8m0_decode",
    "mxfp8_scale_exponent",
    "mxfp8_quantize_ref",
    "mxfp8_dequantize_ref",
    "mxfp8_fake_quantize_ref",
    "nvfp4_global_scale_ref",
    "nvfp4_quantize_ref",
    "nvfp4_dequantize_ref",
    "nvfp4_fake_quantize_ref",
]

E4M3_MAX = 448.0  # 1.75 * 2^8, largest finite float8_e4m3fn
E2M1_MAX = 6.0  # largest E2M1 magnitude
E8M0_BIAS = 127
NVFP4_BLOCK = 16
NVFP4_GLOBAL_DIVISOR = E2M1_MAX * E4M3_MAX  # 2688: global_scale = amax / 2688 (a decode scale)
SCALE_RULES = ("rceil", "floor")

# E2M1 magnitudes by code index 0..7; code = sign << 3 | index.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# ----------------------------------------------------------------------------------------------
# Element grids
# ----------------------------------------------------------------------------------------------


def pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e as float32 for integer e in [-126, 127], built from the exponent bits (exact)."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def _round_to_grid(v: torch.Tensor, mbits: int, emin: int, vmax: float) -> torch.Tensor:
    """Round |v| (float32, finite or +inf) to the nearest value of a float format with `mbits`
    mantissa bits and minimum normal exponent `emin` (subnormals below 2^emin), ties to even,
    saturating at `vmax`.  Returns the non-negative float32 magnitude."""
    a = v.abs()
    _, fexp = torch.frexp(a)  # a = m * 2^fexp, m in [0.5, 1): floor(log2 a) = fexp - 1
    e = torch.clamp(fexp - 1, min=emin, max=127)  # frexp(0) and frexp(inf) give exponent 0
    quantum = pow2(e - mbits)  # spacing of the grid around a (>= 2^(emin - mbits))
    q = torch.round(a / quantum) * quantum  # exact scaling; torch.round is half-to-even
    return torch.clamp(q, max=vmax)


def e4m3_round(v: torch.Tensor) -> torch.Tensor:
    """|v| rounded to float8_e4m3fn (RNE, subnormals at 2^-9, saturating at 448), as float32."""
    return _round_to_grid(v.float(), 3, -6, E4M3_MAX)


def e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """|v| rounded to E2M1 (RNE, 0.5 subnormal, saturating at 6), as float32.
    Ties: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4."""
    return _round_to_grid(v.float(), 1, 0, E2M1_MAX)


def e2m1_codes(mag: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """E2M1 magnitudes (exact grid values) and sign flags -> uint8 codes 0..15."""
    # 2*mag is in {0, 1, 2, 3, 4, 6, 8, 12}; map it to the index 0..7.
    lut = torch.tensor([0, 1, 2, 3, 4, 0, 5, 0, 6, 0, 0, 0, 7], dtype=torch.uint8, device=mag.device)
    idx = lut[(mag * 2).to(torch.int64)]
    return idx | (negative.to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 -> float32 values (code 8 is -0.0)."""
    vals = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    c = codes.to(torch.int64)
    mag = vals[c & 7]
    return torch.where((c & 8) != 0, -mag, mag)


def e8m0_decode(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> float32 2^(byte - 127); byte 0 is 2^-127 (subnormal), 255 is NaN."""
    b = scales.to(torch.int32)
    normal = (b << 23).view(torch.float32)  # exact for 1..254
    out = torch.where(b == 0, torch.full_like(normal, 2.0**-127), normal)
    return torch.where(b == 255, torch.full_like(normal, float("nan")), out)


# ----------------------------------------------------------------------------------------------
# MXFP8
# ----------------------------------------------------------------------------------------------


def mxfp8_scale_exponent(amax: torch.Tensor, scale_rule: str = "rceil") -> torch.Tensor:
    """Unbiased E8M0 exponent (int32, in [-127, 127]) of blocks with float32 amax >= 0.

    With amax = m * 2^E, m in [1, 2) (E from the float32 exponent bits):
      rceil: 2^ceil(log2(amax / 448)); amax/448 = (m/1.75) * 2^(E-8), so the exponent is
             E - 8 when m <= 1.75 (mantissa bits <= 0x600000) and E - 7 otherwise.
      floor: 2^(floor(log2 amax) - 8) = 2^(E - 8).
    A float32-subnormal amax (< 2^-126) needs an exponent below -127 under either rule: it is
    clamped to -127.  The largest float32 amax needs 120 (rceil) / 119 (floor), so the upper
    clamp at 127 never binds.  amax == 0 gives exponent 0 (scale 1, byte 127)."""
    bits = amax.float().view(torch.int32)
    biased = bits >> 23
    mant = bits & 0x7FFFFF
    e = biased - 127 - 8
    if scale_rule == "rceil":
        e = e + (mant > 0x600000).to(torch.int32)
    elif scale_rule != "floor":
        raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")
    e = torch.where(biased == 0, torch.full_like(e, -127), e)
    e = torch.clamp(e, -127, 127)
    return torch.where(bits == 0, torch.zeros_like(e), e)


def mxfp8_quantize_ref(
    x: torch.Tensor, *, scale_block_size: int = 32, scale_rule: str = "rceil"
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (codes float8_e4m3fn [..., K], scales uint8 E8M0 [..., K/scale_block_size]).

    codes = RNE_E4M3(x / 2^e), saturating at +/-448 (only "floor" ever needs it: under "rceil"
    amax / 2^e <= 448 exactly, and RNE cannot round a value <= 448 above 448)."""
    K = x.shape[-1]
    xb = x.float().reshape(*x.shape[:-1], K // scale_block_size, scale_block_size)
    amax = xb.abs().amax(dim=-1)
    e = mxfp8_scale_exponent(amax, scale_rule)
    q = xb * pow2(-e).unsqueeze(-1)  # exact: 2^-e is a normal float32 for e in [-127, 120]
    mag = e4m3_round(q)
    signed = torch.where(torch.signbit(xb), -mag, mag)  # keeps -0.0
    codes = signed.to(torch.float8_e4m3fn).reshape(x.shape)  # exact: values are on the grid
    scales = (e + E8M0_BIAS).to(torch.uint8)
    return codes, scales


def mxfp8_dequantize_ref(
    codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """(codes [..., K], scales [..., K/bs]) -> code * 2^(scale - 127) in `dtype`.

    The float32 product is exact unless it leaves the float32 normal range; it is then rounded
    once more (RNE) to `dtype`.  Values that round above dtype's max become inf."""
    K = codes.shape[-1]
    nb = scales.shape[-1]
    c = codes.float().reshape(*codes.shape[:-1], nb, K // nb)
    out = c * e8m0_decode(scales).unsqueeze(-1)
    return out.reshape(codes.shape).to(dtype)


def mxfp8_fake_quantize_ref(x: torch.Tensor, *, scale_block_size: int = 32, scale_rule: str = "rceil") -> torch.Tensor:
    """dequantize(quantize(x)) in x's dtype."""
    codes, scales = mxfp8_quantize_ref(x, scale_block_size=scale_block_size, scale_rule=scale_rule)
    return mxfp8_dequantize_ref(codes, scales, dtype=x.dtype)


# ----------------------------------------------------------------------------------------------
# NVFP4
# ----------------------------------------------------------------------------------------------


def _const(value: float, like: torch.Tensor) -> torch.Tensor:
    return torch.full((), value, dtype=torch.float32, device=like.device)


def nvfp4_global_scale_ref(x: torch.Tensor) -> torch.Tensor:
    """The decode global scale amax(|x|) / 2688 as a float32 0-d tensor (0 for an all-zero x)."""
    amax = x.abs().amax().float() if x.numel() else torch.zeros((), device=x.device)
    return amax / _const(NVFP4_GLOBAL_DIVISOR, amax)


def nvfp4_quantize_ref(
    x: torch.Tensor, *, global_scale: torch.Tensor | float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., K] -> (packed uint8 [..., K/2], block_scales float8_e4m3fn [..., K/16],
    global_scale float32 0-d).

    block_scale = RNE_E4M3_sat(amax_block / 6 / global_scale)  (0 where amax_block == 0 or
                  global_scale == 0)
    code        = RNE_E2M1_sat(x / (block_scale * global_scale))  (magnitude 0 where the
                  float32 product block_scale * global_scale is 0), sign bit from x,
    element 2j in the low nibble of byte j, element 2j+1 in the high nibble."""
    K = x.shape[-1]
    if global_scale is None:
        gs = nvfp4_global_scale_ref(x)
    else:
        gs = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device).reshape(())
    xb = x.float().reshape(*x.shape[:-1], K // NVFP4_BLOCK, NVFP4_BLOCK)
    amax = xb.abs().amax(dim=-1)
    t = amax / _const(E2M1_MAX, amax) / gs
    t = torch.where((amax == 0) | (gs == 0), torch.zeros_like(t), t)  # no 0/0, no x/0
    bs = e4m3_round(t)  # non-negative float32 on the E4M3 grid
    d = (bs * gs).unsqueeze(-1)  # float32 decode scale of each block
    q = torch.where(d == 0, torch.zeros_like(xb), xb / d)
    mag = e2m1_round(q)
    codes = e2m1_codes(mag, torch.signbit(xb)).reshape(x.shape)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, bs.to(torch.float8_e4m3fn), gs


def nvfp4_dequantize_ref(
    packed: torch.Tensor,
    block_scales: torch.Tensor,
    global_scale: torch.Tensor | float,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """(packed [..., K/2], block_scales [..., K/16], global_scale) -> x_hat [..., K] in dtype.

    x_hat = RN_dtype((e2m1 * block_scale) * global_scale): the first product is exact in
    float32, the second is rounded once to float32, then to dtype."""
    lo = packed & 0xF
    hi = packed >> 4
    codes = torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    K = codes.shape[-1]
    vals = e2m1_decode(codes).reshape(*codes.shape[:-1], K // NVFP4_BLOCK, NVFP4_BLOCK)
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=packed.device).reshape(())
    out = (vals * block_scales.float().unsqueeze(-1)) * gs
    return out.reshape(codes.shape).to(dtype)


def nvfp4_fake_quantize_ref(x: torch.Tensor, *, global_scale: torch.Tensor | float | None = None) -> torch.Tensor:
    """dequantize(quantize(x)) in x's dtype."""
    packed, bs, gs = nvfp4_quantize_ref(x, global_scale=global_scale)
    return nvfp4_dequantize_ref(packed, bs, gs, dtype=x.dtype)
