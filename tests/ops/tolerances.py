"""Tolerances for comparing two float computations that differ only in summation order (kernel
configs, chunkings, the interpreter's BLAS against torch's): a sum of n terms in a dtype of
machine epsilon eps can differ by up to ~n * eps * sum|terms| between two orders, so the bound
scales with the reduction length; `assert_close_sums` makes the absolute part relative to the
largest magnitude of the expected tensor.  These hold on any CPU (Intel, AMD) and BLAS."""

from __future__ import annotations

import torch


def sum_tol(dtype: torch.dtype, n: int, safety: float = 4.0) -> float:
    """Relative tolerance of a length-n reduction accumulated in `dtype` (fp16/bf16 inputs:
    their own epsilon, since the kernels round partials to the input dtype)."""
    return safety * max(1, int(n)) * torch.finfo(dtype).eps


def assert_close_sums(actual: torch.Tensor, expected: torch.Tensor, *, n: int, dtype: torch.dtype | None = None,
                      msg: str = "") -> None:
    """actual == expected up to reordering a length-n sum (NaN / inf must sit at the same places)."""
    tol = sum_tol(dtype or expected.dtype, n)
    fin = torch.isfinite(expected)
    assert torch.equal(fin, torch.isfinite(actual)), f"{msg}: non-finite entries differ"
    assert torch.equal(actual[~fin].nan_to_num(7.0), expected[~fin].nan_to_num(7.0)), f"{msg}: non-finite values differ"
    e, a = expected[fin].double(), actual[fin].double()
    scale = float(e.abs().max()) if e.numel() else 0.0
    torch.testing.assert_close(a, e, rtol=tol, atol=tol * max(scale, 1e-30), msg=msg or None)
