"""`routed_experts`: the weighted sum of each token's routed SwiGLU-OAI experts (`reference.py`),
with a Triton kernel for few (token, slot) pairs (`triton.py`: decoding)."""

from __future__ import annotations

import torch

from ..checks import check_tensor
from ..dispatch import use_triton
from .reference import routed_experts_reference, swiglu_oai

__all__ = ["routed_experts", "routed_experts_reference", "swiglu_oai"]


@torch.library.custom_op("msakit::routed_experts", mutates_args=())
def _routed_experts_op(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                       w2: torch.Tensor, alpha: float, limit: float, backend: str) -> torch.Tensor:
    if use_triton("routed_experts", backend, x.device):
        from .triton import routed_experts_triton

        return routed_experts_triton(x, idx, w, w1, w3, w2, alpha, limit)
    return routed_experts_reference(x, idx, w, w1, w3, w2, alpha, limit)


@_routed_experts_op.register_fake
def _routed_experts_fake(x, idx, w, w1, w3, w2, alpha, limit, backend):
    return torch.empty((x.shape[0], w2.shape[1]), dtype=torch.float32, device=x.device)


def routed_experts(
    x: torch.Tensor,
    idx: torch.Tensor,
    w: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    *,
    alpha: float = 1.702,
    limit: float = 7.0,
    backend: str = "auto",
) -> torch.Tensor:
    """y [N, H] float32 = sum_j w[n, j] * expert_{idx[n, j]}(x[n]) (no autograd: inference).

    x [N, H] (fp16 / bf16 / fp32: the projections' dtype); idx int [N, k] expert ids in [0, E);
    w [N, k] routing weights; w1 (gate) / w3 (up) [E, I, H] and w2 (down) [E, H, I], any
    strides and floating dtype (rounded to x's dtype on load).  backend: "auto" (the Triton
    kernel on CUDA), "triton", "reference".
    """
    check_tensor("x", x, 2)
    check_tensor("w", w, 2)
    for name, t in (("w1", w1), ("w3", w3), ("w2", w2)):
        check_tensor(name, t, 3)
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"idx must be an int32 / int64 tensor [N, k], got {getattr(idx, 'dtype', type(idx).__name__)} "
                         f"of shape {tuple(getattr(idx, 'shape', ()))}")
    N, H = x.shape
    E, I, H1 = w1.shape
    if idx.shape[0] != N or w.shape != idx.shape:
        raise ValueError(f"idx and w must have shape [N={N}, k], got {tuple(idx.shape)} and {tuple(w.shape)}")
    if H1 != H or w3.shape != w1.shape or tuple(w2.shape) != (E, H, I):
        raise ValueError(f"w1 / w3 must be [E, I, H={H}] and w2 [E, H, I], got {tuple(w1.shape)}, {tuple(w3.shape)}, "
                         f"{tuple(w2.shape)}")
    for name, t in (("idx", idx), ("w", w), ("w1", w1), ("w3", w3), ("w2", w2)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    if x.dtype == torch.float64:
        raise ValueError("x must be fp16, bf16 or fp32, got float64")
    return _routed_experts_op(x.contiguous(), idx.contiguous(), w.contiguous(), w1, w3, w2, float(alpha),
                              float(limit), backend)
