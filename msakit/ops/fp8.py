"""Per-row float8_e4m3fn quantization: the one fp8 helper of msakit (index scoring with
score_dtype="fp8", the paged cache's fp8 pools).

    codes, scale = quantize_fp8(x)        # x [..., D] -> codes e4m3 [..., D], scale float32 [...]
    x ~= codes.float() * scale[..., None]

scale = max(amax(|row|) / 448, smallest normal float32); codes = clamp(x / scale, -448, 448)
rounded to nearest even.  An all-zero row gets the smallest scale and zero codes; a row holding
NaN gets a NaN scale and NaN codes.  The Triton kernel equals the reference bit for bit.
"""

from __future__ import annotations

import torch

from .checks import FLOAT_DTYPES
from .dispatch import use_triton

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn

__all__ = ["FP8", "FP8_MAX", "quantize_fp8", "quantize_fp8_reference"]


def quantize_fp8_reference(x: torch.Tensor, chunk_rows: int = 1 << 18) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_fp8` in PyTorch, over chunks of `chunk_rows` rows so that the float32
    temporaries stay small (q_idx at 1M tokens is 2 GiB in fp32)."""
    D = x.shape[-1]
    rows = x.reshape(-1, D)
    xq = torch.empty(rows.shape, dtype=FP8, device=x.device)
    scale = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
    for r0 in range(0, rows.shape[0], chunk_rows):
        xf = rows[r0:r0 + chunk_rows].float()
        s = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
        xq[r0:r0 + chunk_rows] = (xf / s).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        scale[r0:r0 + chunk_rows] = s.squeeze(-1)
    return xq.view(x.shape), scale.view(x.shape[:-1])


def quantize_fp8(x: torch.Tensor, *, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """x float [..., D] (D >= 1) -> (codes float8_e4m3fn [..., D], scale float32 [...]); see the
    module docstring.  backend: "auto" | "triton" | "reference" (`msakit.ops.dispatch`)."""
    if not isinstance(x, torch.Tensor) or x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x must be a floating torch.Tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"x must have a last dimension >= 1 to quantize per row, got shape {tuple(x.shape)}")
    if use_triton("quantize_fp8", backend, x.device):
        from .fp8_triton import quantize_fp8_triton  # imported where it launches: triton is optional

        return quantize_fp8_triton(x)
    return quantize_fp8_reference(x)
