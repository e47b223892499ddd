"""CUDA-graph capture and the per-model state pool, shared by plain and speculative decoding.

`capture_graph(fn, device)` warms up a step that reads only static buffers under torch's sync
check (any host sync raises) and captures it as one CUDA graph; `GraphCaptureError` says which
stage failed and where; `graph_warning` warns once per reason when a decoder falls back to eager
steps.  `StatePool` keeps generation states (caches, static buffers, captured graphs) across
calls, per model and shape key, dropped when `model_state_key` (modes and weights) changes.
"""

from __future__ import annotations

import traceback
import warnings
import weakref
from collections import OrderedDict
from typing import Any, Callable

import torch

from msakit.nn.moe import grouped_mm_trial

__all__ = ["GraphCaptureError", "LENGTH_QUANTUM", "MAX_STATES", "StatePool", "capture_graph", "graph_warning",
           "model_state_key", "round_length", "error_site"]

_GRAPH_WARNED: set[str] = set()


def graph_warning(reason: str) -> None:
    if reason not in _GRAPH_WARNED:
        _GRAPH_WARNED.add(reason)
        warnings.warn(f"msakit: CUDA-graph decode disabled, decoding eagerly: {reason}", RuntimeWarning,
                      stacklevel=4)


def error_site(e: BaseException) -> str:
    """' at FILE:LINE (function)' of the innermost msakit frame of e's traceback ('' if none)."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "msakit" in f.filename.replace("\\", "/")]
    if not frames:
        return ""
    f = frames[-1]
    path = f.filename.replace("\\", "/")
    return f" at {path[path.rfind('msakit/'):]}:{f.lineno} ({f.name})"


class GraphCaptureError(RuntimeError):
    """`capture_graph` failed: `stage` is "warm-up" or "capture"; `out` the warm-up's output
    (None when the warm-up itself failed)."""

    def __init__(self, stage: str, error: BaseException, out: Any = None) -> None:
        super().__init__(f"{stage}: {type(error).__name__}: {error}")
        self.stage, self.error, self.out = stage, error, out

    def describe(self, what: str) -> str:
        e = self.error
        verb = "failed" if self.stage == "warm-up" else "could not be captured"
        return f"{what} {verb}{error_site(e)} ({type(e).__name__}: {str(e).strip()[:300]})"


def capture_graph(fn: Callable[[], Any], device: torch.device) -> tuple[Any, "torch.cuda.CUDAGraph", Any]:
    """Warm up and capture `fn` (a step that reads only static buffers) as one CUDA graph.

    The warm-up is a real call of fn() on a side stream with torch's sync debug mode set to
    "error", so any host sync raises; then fn() is captured on that stream.  Returns (the
    warm-up's output, the graph, the captured call's output buffers); raises GraphCaptureError.
    A sync error inside torch._grouped_mm does not mark it failed for good (`grouped_mm_trial`)."""
    cur = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device=device)
    side.wait_stream(cur)
    prev = torch.cuda.get_sync_debug_mode()
    try:
        with torch.cuda.stream(side), grouped_mm_trial():
            torch.cuda.set_sync_debug_mode("error")
            try:
                out = fn()
            finally:
                torch.cuda.set_sync_debug_mode(prev)
    except Exception as e:  # noqa: BLE001 - the caller falls back to eager
        cur.wait_stream(side)
        raise GraphCaptureError("warm-up", e) from e
    cur.wait_stream(side)
    for o in out if isinstance(out, (tuple, list)) else (out,):
        o.record_stream(cur)
    graph = torch.cuda.CUDAGraph()
    try:
        with grouped_mm_trial(), torch.cuda.graph(graph, stream=side):
            captured = fn()
    except Exception as e:  # noqa: BLE001
        raise GraphCaptureError("capture", e, out) from e
    return out, graph, captured


MAX_STATES = 2  # per model and pool, least recently used dropped first
LENGTH_QUANTUM = 128  # max_len is rounded up to a multiple of this, so nearby lengths share a decoder


def model_state_key(*models: Any) -> tuple:
    """What a captured step of `models` depends on besides its own buffers: each attention
    module's mode and every parameter's storage, dtype and shape (a replaced or moved weight, a
    QAT wrapper, a mode switch all change it)."""
    out = []
    for model in models:
        modes = tuple(m.mode for m in model.msa_layers()) if hasattr(model, "msa_layers") else ()
        out.append((modes, tuple((p.data_ptr(), p.dtype, tuple(p.shape)) for p in model.parameters())))
    return tuple(out)


def round_length(n: int) -> int:
    """n rounded up to a multiple of LENGTH_QUANTUM (the length a pooled state is built for)."""
    return -(-int(n) // LENGTH_QUANTUM) * LENGTH_QUANTUM


class StatePool:
    """Generation states (caches, static buffers, captured CUDA graphs) kept across calls, per
    model (weakly: a pooled state must hold no reference to the model) and per shape key, the
    `size` most recently used of each model.  `get(model, state, key, make)` returns the state
    stored under `key` (reset through its `reset()`) when it was made for the same `state` (a
    tuple of `model_state_key` parts, the model's own first) and is not in use, else a new
    `make()` (stored when the key is free); states made for another state of the model itself
    are dropped.  States have an `in_use` flag, set here and cleared by their owner when the
    call ends."""

    def __init__(self, size: int = MAX_STATES) -> None:
        self.size = size
        self._by_model: "weakref.WeakKeyDictionary[Any, OrderedDict]" = weakref.WeakKeyDictionary()

    def get(self, model: Any, state: tuple, key: Any, make: Callable[[], Any]) -> Any:
        pool = self._by_model.get(model)
        if pool is None:
            pool = self._by_model[model] = OrderedDict()
        for k in [k for k, (st, _) in pool.items() if st[0] != state[0]]:  # the model itself changed
            del pool[k]
        st, obj = pool.get(key, (None, None))
        if obj is None or st != state or obj.in_use:
            obj = make()
            if st != state or key not in pool:
                pool[key] = (state, obj)
        else:
            obj.reset()
        if key in pool:
            pool.move_to_end(key)
        while len(pool) > self.size:
            pool.popitem(last=False)
        obj.in_use = True
        return obj

    def clear(self, model: Any = None) -> None:
        if model is None:
            self._by_model.clear()
        else:
            self._by_model.pop(model, None)
