"""`msakit.ops.fp8.quantize_fp8` as one Triton pass (read x, write the e4m3 codes and the
per-row float32 scales), bit for bit the reference's rounding."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import interpret_mode

__all__ = ["quantize_fp8_triton"]

FP8_TINY = tl.constexpr(torch.finfo(torch.float32).tiny)  # the smallest scale (all-zero rows)


@triton.jit
def _quantize_fp8_kernel(x_ptr, xq_ptr, s_ptr, n_rows, D, stride_x,
                         BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, CAST: tl.constexpr):
    """Per-row float8_e4m3fn quantization, `msakit.ops.fp8.quantize_fp8_reference` bit for bit.

    CAST=False (the interpreter, whose float32 -> e4m3 conversion does not round to nearest
    even) writes the clamped float32 quotients for the host to convert.
    """
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    r_ok = r < n_rows
    m = r_ok[:, None] & (d < D)[None, :]
    r64 = r.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * stride_x + d[None, :], mask=m, other=0.0).to(tl.float32)
    # IEEE-rounded divisions (Triton's `/` is the approximate div.full.f32), as torch divides
    s = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), 1), tl.full([BLOCK_R], 448.0, tl.float32)), FP8_TINY)
    # a row holding NaN gets a NaN scale and NaN codes, as torch's amax gives (the max above
    # ignores NaN on the GPU): its scores are then NaN, i.e. never selected
    s = tl.where(tl.max((x != x).to(tl.int32), 1) > 0, float("nan"), s)
    y = tl.math.div_rn(x, tl.broadcast_to(s[:, None], [BLOCK_R, BLOCK_D]))
    y = tl.minimum(tl.maximum(y, -448.0, propagate_nan=tl.PropagateNan.ALL), 448.0, propagate_nan=tl.PropagateNan.ALL)
    if CAST:
        y = y.to(tl.float8e4nv)
    tl.store(xq_ptr + r64[:, None] * D + d[None, :], y, mask=m)
    tl.store(s_ptr + r64, s, mask=r_ok)



def quantize_fp8_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`msakit.ops.fp8.quantize_fp8` in one Triton pass (read x, write codes and scales)."""
    D = x.shape[-1]
    rows = x.reshape(-1, D)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    n = rows.shape[0]
    cast = not interpret_mode()
    xq = torch.empty((n, D), dtype=torch.float8_e4m3fn if cast else torch.float32, device=x.device)
    scale = torch.empty(n, dtype=torch.float32, device=x.device)
    block_d = max(16, 1 << max(0, (D - 1).bit_length()))
    block_r = max(1, min(64, 8192 // block_d))
    if n > 0:
        _quantize_fp8_kernel[(triton.cdiv(n, block_r),)](
            rows, xq, scale, n, D, rows.stride(0), BLOCK_R=block_r, BLOCK_D=block_d, CAST=cast, num_warps=4,
        )
    if not cast:
        xq = xq.to(torch.float8_e4m3fn)
    return xq.view(x.shape), scale.view(x.shape[:-1])
