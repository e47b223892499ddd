"""The meaning of the packed GEMMs: dequantize the packed weight, then multiply.

Weight layouts per group g of G (the ModelOpt checkpoint tensors, docs/formats.md):

    nvfp4  codes uint8 [G, N, K/2] (element 2j in the low nibble of byte j, 2j+1 in the high one),
           block scales float8_e4m3fn [G, N, K/16], global scales float32 [G];
           w[g, n, k] = RN_dtype((e2m1(code) * block_scale) * global_scale[g])
           (the first product is exact in float32, the second rounded once to float32)
    mxfp8  codes float8_e4m3fn [G, N, K], scales uint8 E8M0 [G, N, K/32];
           w[g, n, k] = RN_dtype(code * 2^(scale - 127))

These are the values `msakit.quant.unpack_weight` returns and QAT trained with.

    grouped_mm(x, counts, w)   x [M, K] sorted by group (counts[g] consecutive rows of group g)
                               -> y [M, N]: the rows of group g times w[g].T, float32
                               accumulation, rounded to x's dtype (the weights are dequantized
                               into x's dtype)
    scaled_mm(xc, xs, w)       both operands MXFP8 (x codes float8_e4m3fn [M, K], x scales uint8
                               [M, K/32], w one group) -> y[m, n] = sum_k x_hat[m, k] w_hat[n, k]
                               in float32, rounded to the output dtype

Written independently of `msakit.quant.formats` (ops sit below quant); tests check the two agree.
"""

from __future__ import annotations

import torch

__all__ = ["E2M1_VALUES", "dequantize_reference", "grouped_mm_reference", "scaled_mm_reference"]

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude by code & 7; code & 8 is the sign


def _e8m0(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> float32 2^(byte - 127) (byte 0: 2^-127, byte 255: NaN)."""
    b = scales.to(torch.int32)
    out = torch.where(b == 0, torch.full(b.shape, 2.0**-127, device=b.device), (b << 23).view(torch.float32))
    return torch.where(b == 255, torch.full_like(out, float("nan")), out)


def dequantize_reference(weight: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor | None, fmt: str,
                         dtype: torch.dtype) -> torch.Tensor:
    """Packed weight of G groups (layouts above) -> [G, N, K] in `dtype`."""
    if fmt == "nvfp4":
        codes = torch.stack((weight & 0xF, weight >> 4), dim=-1).reshape(*weight.shape[:-1], -1).long()
        lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=weight.device)
        e2m1 = torch.where((codes & 8) != 0, -lut[codes & 7], lut[codes & 7])
        bs = scales.float().repeat_interleave(16, dim=-1)
        gs = global_scale.float().reshape(-1, 1, 1)
        return ((e2m1 * bs) * gs).to(dtype)
    if fmt == "mxfp8":
        return (weight.float() * _e8m0(scales).repeat_interleave(32, dim=-1)).to(dtype)
    raise ValueError(f"fmt must be 'nvfp4' or 'mxfp8', got {fmt!r}")


def grouped_mm_reference(x: torch.Tensor, counts: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                         global_scale: torch.Tensor | None, fmt: str) -> torch.Tensor:
    """y [M, N] in x's dtype; one matmul per group (a host sync for the counts)."""
    w = dequantize_reference(weight, scales, global_scale, fmt, x.dtype)
    parts = torch.split(x, [int(c) for c in counts.tolist()])
    y = [p @ w[g].T for g, p in enumerate(parts)]
    return torch.cat(y) if y else x.new_zeros(0, w.shape[1])


def scaled_mm_reference(x_codes: torch.Tensor, x_scales: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                        out_dtype: torch.dtype) -> torch.Tensor:
    """y [M, N] = dequant(x) @ dequant(w).T in float32 (both operands exact there), in out_dtype."""
    xf = dequantize_reference(x_codes.unsqueeze(0), x_scales.unsqueeze(0), None, "mxfp8", torch.float32)[0]
    wf = dequantize_reference(weight.unsqueeze(0), scales.unsqueeze(0), None, "mxfp8", torch.float32)[0]
    return (xf @ wf.T).to(out_dtype)
