"""Choosing between a Triton kernel and the pure-PyTorch reference.

Every public op takes `backend="auto" | "triton" | "reference"`:
- "auto": the Triton kernel for CUDA tensors, the reference otherwise (CPU tensors, or CUDA
  without a usable Triton, which warns once because the reference is far slower);
- "triton": the kernel, also for CPU tensors when TRITON_INTERPRET=1 (how the CPU tests run
  kernels); an error when Triton cannot run;
- "reference": the reference.
"""

from __future__ import annotations

import os
import warnings

import torch

BACKENDS = ("auto", "triton", "reference")
_warned: set[str] = set()


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - triton missing on this platform
        return False
    return True


def interpret_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def warn_once(key: str, message: str) -> None:
    """A RuntimeWarning the first time `key` is seen in this process (skipped while torch.compile
    traces: a warning would break the graph; the next eager call warns)."""
    if key not in _warned and not torch.compiler.is_compiling():
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def use_triton(op: str, backend: str, device: torch.device) -> bool:
    """True when `op` should run its Triton kernel on tensors of `device`."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "reference":
        return False
    if backend == "triton":
        if not triton_available():
            raise ValueError(f"backend='triton' for {op}: triton is not installed")
        if device.type != "cuda" and not interpret_mode():
            raise ValueError(
                f"backend='triton' for {op} needs CUDA tensors, or TRITON_INTERPRET=1 (set before importing triton) "
                f"to interpret the kernel on {device.type}"
            )
        return True
    if device.type == "cuda":
        if triton_available():
            return True
        warn_once(op, f"msakit: triton is unavailable, {op} falls back to the slow PyTorch reference on CUDA")
    return False
