"""Quantization-aware training (QAT) in NVFP4 and MXFP8, and `convert` to packed inference weights.

    plan = quantization_plan(model)                  # "m3.1-flash": experts NVFP4, the rest MXFP8 / BF16 / FP32
    prepare_qat(model, plan)                         # in place; parameters stay the same objects
    for step ...:
        for micro in batches:  loss(model(micro)).backward()   # weights fake-quantized ONCE per step
        opt.step(); opt.zero_grad()                  # any optimizer step invalidates the weight caches
    convert(model)                                   # packed NVFP4 / MXFP8 modules for inference

Forward: every planned weight is replaced by its quantize-dequantize value (NVFP4 with w1/w3 of
an expert sharing one global scale; MXFP8 rceil; "bf16" weights rounded to bfloat16), and MXFP8
layers also fake-quantize their input activations along K (dynamic 1 x 32 blocks).  Backward is
the straight-through estimator: the gradient w.r.t. the dequantized weight (computed with the
quantized activations) goes unchanged to the full-precision master weight; the gradient
w.r.t. a quantized activation goes unchanged to the activation.  Routers ("fp32") are untouched.

Weights are fake-quantized once per optimizer step, not once per micro-batch: each module caches
its fake-quantized weight in the compute dtype (bfloat16 under autocast), keyed on the
parameters' version counters and storage, the compute dtype, a process-wide count of optimizer
steps (a global `torch.optim` post-step hook, so every optimizer -- fused ones included, which
do not bump version counters -- invalidates the caches) and `qat_step(model)` (call it after
updating weights by other means, e.g. through ``.data``).  Gradient checkpointing's recompute
and evaluation reuse the cache.  CUDA runs the fused Triton kernels (one launch per weight; the
routed experts of a layer, with one global scale per expert, in one launch per projection);
CPU runs the PyTorch reference (``backend=`` overrides).  No host syncs in the hot path.

Activation quantization is shared between the linears that read the same tensor (q/k/v_proj,
index_q/k_proj, shared-expert gate/up): one kernel per input, not per layer.

Frozen scales: `prepare_qat(..., frozen={entry: scales})` keeps given scales (a loaded
checkpoint's scales that our rule does not reproduce, see `msakit.quant.checkpoint`) while the
weights train: only the codes follow the weights.

Attachment goes through `msakit.models.hooks`: each prepared module's class is swapped
(`swap_class`) and its `_ModuleQAT` attached under "qat.module"; the model holds its `QATState`
under "qat" and a forward hook under the same key (`qat_state(model)` reads it).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook as _register_opt_hook

from msakit.models.hooks import add_hook, attach, attached, detach, remove_hooks, restore_class, swap_class
from msakit.nn.moe import GroupedExperts

from .formats import BACKENDS, SCALE_RULES
from .linear import (
    PackedEmbedding,
    PackedExperts,
    PackedLinear,
    compute_dtype,
    expert_global_scales,
    fake_quantize_weight,
    mxfp8_fake_quantize_to,
    packed_spec,
)
from .plan import module_kind, module_formats, quantization_plan, resolve_plan

__all__ = [
    "QATConfig",
    "QATLinear",
    "QATEmbedding",
    "QATGroupedExperts",
    "prepare_qat",
    "qat_step",
    "qat_stats",
    "is_qat",
    "module_qat",
    "qat_state",
    "remove_qat",
    "convert",
    "module_frozen_scales",
    "capture_weight_refresh",
]

QAT_KEY = "qat"  # `msakit.models.hooks` key of the model's QATState and its forward hook
MODULE_KEY = "qat.module"  # `msakit.models.hooks` key of a prepared module's _ModuleQAT
_OPT_STEPS = [0]
_HOOK: list[Any] = []


def _on_optimizer_step(optimizer, args, kwargs) -> None:
    _OPT_STEPS[0] += 1


def _ensure_optimizer_hook() -> None:
    if not _HOOK:
        _HOOK.append(_register_opt_hook(_on_optimizer_step))


@dataclass
class QATConfig:
    quantize_activations: bool = True  # MXFP8 layers fake-quantize their inputs (1 x 32, dynamic)
    scale_rule: str = "rceil"  # MXFP8 scale rule ("rceil" as cuBLAS / ModelOpt, or "floor")
    backend: str = "auto"  # "auto" (Triton on CUDA, reference on CPU), "triton", "reference"


@dataclass
class QATState:
    """What `prepare_qat` attaches to the model (`qat_state(model)`)."""

    plan: dict[str, str]
    config: QATConfig
    formats: dict[str, dict[str, str]]
    frozen: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    manual_steps: int = 0
    stats: Counter = field(default_factory=Counter)
    act_slot: tuple | None = None

    def epoch(self) -> tuple[int, int]:
        return (_OPT_STEPS[0], self.manual_steps)

    def clear_slot(self, *args: Any) -> None:
        self.act_slot = None

    def act(self, x: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
        """MXFP8 fake-quantized x (STE), written in dt; the last result is reused when the next
        layer reads the very same tensor (same object and version)."""
        try:
            ver = x._version
        except RuntimeError:  # inference tensors have no version counter
            ver = None
        ge = torch.is_grad_enabled()
        s = self.act_slot
        if s is not None and ver is not None and s[0] is x and s[1] == ver and s[2] == dt and s[3] == ge:
            self.stats["activation_reuses"] += 1
            return s[4]
        y = _ActSTE.apply(x, dt, self.config)
        self.stats["activation_quantizations"] += 1
        self.act_slot = (x, ver, dt, ge, y) if ver is not None else None
        return y


class _STE(torch.autograd.Function):
    """forward: the cached fake-quantized weight; backward: the gradient to the master weight."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, w_hat: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.dtype = w.dtype
        return w_hat.view_as(w_hat)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        return g.to(ctx.dtype), None


class _ActSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dt: torch.dtype, cfg: QATConfig) -> torch.Tensor:  # type: ignore[override]
        ctx.dtype = x.dtype
        return mxfp8_fake_quantize_to(x, dt, scale_rule=cfg.scale_rule, backend=cfg.backend)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        return g.to(ctx.dtype), None, None


class _ModuleQAT:
    """Per-module QAT data: formats by parameter, frozen scales, the weight cache."""

    def __init__(self, state: QATState, formats: dict[str, str], frozen: dict[str, dict[str, Any]] | None,
                 act: bool, name: str) -> None:
        self.state = state
        self.formats = formats
        self.frozen = frozen or {}
        self.act = act
        self.name = name
        self.key: tuple | None = None
        self.cache: tuple[torch.Tensor, ...] | None = None
        self.refresher: _Refresher | None = None  # set by capture_weight_refresh

    def _frozen_on(self, p: str, device: torch.device) -> dict[str, Any] | None:
        fr = self.frozen.get(p)
        if fr is None:
            return None
        moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in fr.items()}
        self.frozen[p] = moved  # keep them on the weights' device
        return moved

    def _key(self, ws: tuple[torch.Tensor, ...], dt: torch.dtype) -> tuple:
        return (tuple((w._version, w.data_ptr(), w.device) for w in ws), dt, self.state.epoch())

    def compute(self, ws: dict[str, torch.Tensor], dt: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Fake-quantized copies of ws in dt (no caching)."""
        cfg = self.state.config
        dev = next(iter(ws.values())).device
        fr = {p: self._frozen_on(p, dev) for p in ws}
        gsh = expert_global_scales(ws, self.formats) if len(ws) > 1 else {}
        with torch.no_grad():
            return tuple(
                fake_quantize_weight(w, self.formats[p], dt, global_scale=gsh.get(p), frozen=fr[p],
                                     scale_rule=cfg.scale_rule, backend=cfg.backend)
                for p, w in ws.items()
            )

    def fake_weights(self, ws: dict[str, torch.Tensor], dt: torch.dtype) -> tuple[torch.Tensor, ...]:
        """The fake-quantized weights (cached; recomputed after an optimizer step)."""
        key = self._key(tuple(ws.values()), dt)
        if key != self.key or self.cache is None:
            r = self.refresher
            if r is not None and dt == r.dtype:
                r.run()  # every member at once (one CUDA graph replay)
                if self.key == key:
                    return self.cache  # type: ignore[return-value]
            self.cache = self.compute(ws, dt)
            self.key = key
            self.state.stats["weight_quantizations"] += len(ws)
        return self.cache

    def ste(self, ws: dict[str, torch.Tensor], dt: torch.dtype) -> tuple[torch.Tensor, ...]:
        return tuple(_STE.apply(w, c) for w, c in zip(ws.values(), self.fake_weights(ws, dt)))


class _Refresher:
    """Recomputes the fake-quantized weights of all member modules together, into fixed buffers:
    by replaying one CUDA graph (CUDA) or eagerly.  Built by `capture_weight_refresh`."""

    def __init__(self, state: "QATState", members: list[tuple[_ModuleQAT, nn.Module]], dtype: torch.dtype) -> None:
        self.state, self.members, self.dtype = state, members, dtype
        self.graph: Any = None
        self.outputs: list[tuple[torch.Tensor, ...]] = []

    def __deepcopy__(self, memo: dict) -> None:
        # a copied model (e.g. for `convert`) re-quantizes per module: the graph writes into
        # the original model's buffers, and a CUDA graph cannot be copied
        return None

    def compute_all(self) -> list[tuple[torch.Tensor, ...]]:
        return [m.compute(_qat_weights(mod), self.dtype) for m, mod in self.members]

    def run(self) -> None:
        if self.graph is not None:
            self.graph.replay()  # rewrites self.outputs in place
        else:
            self.outputs = self.compute_all()
        n = 0
        for (m, mod), out in zip(self.members, self.outputs):
            ws = _qat_weights(mod)
            m.cache, m.key = out, m._key(tuple(ws.values()), self.dtype)
            n += len(ws)
        self.state.stats["weight_quantizations"] += n
        self.state.stats["weight_refreshes"] += 1


def _qat_weights(mod: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters a QAT module fake-quantizes, by name (the keys of its formats)."""
    if isinstance(mod, QATGroupedExperts):
        return {"w1": mod.w1, "w3": mod.w3, "w2": mod.w2}
    return {"weight": mod.weight}


def capture_weight_refresh(model: nn.Module, dtype: torch.dtype = torch.bfloat16, *, graph: bool | None = None) -> int:
    """Recompute all fake-quantized weights of a QAT model together after each optimizer step,
    as one CUDA graph (graph=None: on CUDA) instead of one Python call and a few launches per
    weight (launch and Python overhead; benchmarks/NOTES.md has the per-step cost).  dtype: the compute dtype of the forward (bfloat16 under autocast);
    a module asked for another dtype, or holding frozen scales, keeps the per-module path.
    Weights must keep their storage (in-place optimizer updates).  Returns the member count."""
    st = _state(model)
    members = []
    for mod in model.modules():
        q = module_qat(mod)
        if q is not None and not q.frozen and not isinstance(mod, QATEmbedding):
            members.append((q, mod))
    if not members:
        return 0
    dev = next(iter(_qat_weights(members[0][1]).values())).device
    use_graph = (dev.type == "cuda") if graph is None else graph
    r = _Refresher(st, members, dtype)
    if use_graph:
        s = torch.cuda.Stream(dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):  # warm-up: compiles the kernels, settles the allocator
            r.compute_all()
        torch.cuda.current_stream(dev).wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            r.outputs = r.compute_all()
        r.graph = g
    for m, _ in members:
        m.refresher = r
    r.run()
    return len(members)


def module_qat(module: nn.Module) -> _ModuleQAT | None:
    """The QAT data `prepare_qat` attached to one of its modules (None for other modules)."""
    return attached(module, MODULE_KEY)


class _QATModule:
    """What the QAT classes share: `_qat`, the module's attached QAT data."""

    @property
    def _qat(self) -> _ModuleQAT:
        return attached(self, MODULE_KEY)


class QATLinear(_QATModule, nn.Linear):
    """nn.Linear whose forward uses the fake-quantized weight (and, for MXFP8, fake-quantized
    inputs).  Same parameters and state_dict as the nn.Linear it was made from."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self._qat
        dt = compute_dtype(x.device.type, self.weight.dtype)
        (w,) = q.ste(_qat_weights(self), dt)
        if q.act:
            x = q.state.act(x, dt)
        return F.linear(x, w, self.bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", qat={self._qat.formats['weight']}, act_quant={self._qat.act}"


class QATEmbedding(_QATModule, nn.Embedding):
    """nn.Embedding looking up rows of the fake-quantized (bf16-rounded) table."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        (w,) = self._qat.ste(_qat_weights(self), self.weight.dtype)
        return F.embedding(ids, w, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse)


class QATGroupedExperts(_QATModule, GroupedExperts):
    """Routed experts whose `expert_weights()` are the fake-quantized stacked weights."""

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dt = compute_dtype(self.w1.device.type, self.w1.dtype)
        return self._qat.ste(_qat_weights(self), dt)  # type: ignore[return-value]


_QAT_CLASSES = {nn.Linear: QATLinear, nn.Embedding: QATEmbedding, GroupedExperts: QATGroupedExperts}


def qat_state(model: nn.Module) -> QATState | None:
    """What `prepare_qat` attached to `model` (None when it is not prepared)."""
    st = attached(model, QAT_KEY)
    return st if isinstance(st, QATState) else None


def is_qat(model: nn.Module) -> bool:
    return qat_state(model) is not None


def _state(model: nn.Module) -> QATState:
    st = qat_state(model)
    if st is None:
        raise ValueError("model is not prepared for QAT (call prepare_qat first)")
    return st


def qat_step(model: nn.Module) -> None:
    """Invalidate every fake-quantized weight cache of `model` (needed only after weight updates
    that neither an optimizer step nor an in-place op on the parameters made, e.g. via .data)."""
    _state(model).manual_steps += 1


def qat_stats(model: nn.Module) -> dict[str, int]:
    """Counters: weight_quantizations (tensors fake-quantized), activation_quantizations,
    activation_reuses."""
    return dict(_state(model).stats)


def _check_config(scale_rule: str, backend: str) -> None:
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def module_frozen_scales(model: nn.Module, plan: Mapping[str, str],
                         frozen: Mapping[str, Mapping[str, torch.Tensor]] | None) -> dict[str, dict[str, dict[str, Any]]]:
    """Frozen scales by plan entry (checkpoint names: {"...experts.7.w1": {"weight_scale": ...,
    "weight_scale_2": ...}, "...q_proj": {"weight_scale_inv": ...}}) -> by msakit module and
    parameter, stacked over experts with a boolean ``mask`` [E] of the frozen experts.

    w1 and w3 of an NVFP4 expert share a global scale: freeze both or neither (ValueError)."""
    if not frozen:
        return {}
    if not isinstance(frozen, Mapping):
        raise ValueError(f"frozen must be a dict {{entry name: scales}}, got {type(frozen).__name__}")
    entries = {e.name: e for e in resolve_plan(model, plan)}
    out: dict[str, dict[str, dict[str, Any]]] = {}
    stacked: dict[tuple[str, str], dict[int, Mapping[str, torch.Tensor]]] = {}
    for name, sc in frozen.items():
        e = entries.get(name)
        if e is None:
            raise ValueError(f"frozen scales given for {name!r}, which is not in the plan")
        if e.fmt not in ("nvfp4", "mxfp8"):
            raise ValueError(f"frozen scales given for {name!r}, planned as {e.fmt!r} (only nvfp4 / mxfp8 have scales)")
        keys = ("weight_scale", "weight_scale_2") if e.fmt == "nvfp4" else ("weight_scale_inv",)
        if not isinstance(sc, Mapping) or any(k not in sc for k in keys):
            raise ValueError(f"frozen scales of {name!r} ({e.fmt}) need {keys}")
        spec = packed_spec(e.fmt, e.shape)
        clean: dict[str, torch.Tensor] = {}
        for k in keys:
            t = sc[k] if isinstance(sc[k], torch.Tensor) else torch.as_tensor(sc[k], dtype=torch.float32)
            if k == "weight_scale_2":
                if t.numel() != 1 or not t.is_floating_point():
                    raise ValueError(f"frozen weight_scale_2 of {name!r} must be one float, got {t.dtype} {tuple(t.shape)}")
                t = t.float().reshape(())
            elif tuple(t.shape) != tuple(spec[k][0]):
                raise ValueError(f"frozen {k} of {name!r} has shape {tuple(t.shape)}, expected {tuple(spec[k][0])}")
            elif k == "weight_scale" and t.dtype != torch.float8_e4m3fn:
                raise ValueError(f"frozen weight_scale of {name!r} must be float8_e4m3fn, got {t.dtype}")
            elif k == "weight_scale_inv":
                if t.dtype == getattr(torch, "float8_e8m0fnu", None):
                    t = t.view(torch.uint8)
                if t.dtype != torch.uint8:
                    raise ValueError(f"frozen weight_scale_inv of {name!r} must be uint8 (E8M0 bytes), got {t.dtype}")
            clean[k] = t
        if e.expert is None:
            out.setdefault(e.module, {})[e.param] = clean
        else:
            stacked.setdefault((e.module, e.param), {})[e.expert] = clean
    fmts = module_formats(model, plan) if stacked else {}
    for (mod, p), by_e in stacked.items():
        m = model.get_submodule(mod)
        E = m.num_experts
        fmt = fmts[mod][p]
        shape = (m.intermediate_size, m.hidden_size) if p in ("w1", "w3") else (m.hidden_size, m.intermediate_size)
        spec = packed_spec(fmt, (E, *shape))
        mask = torch.zeros(E, dtype=torch.bool)
        st = {k: torch.zeros(shp, dtype=dt) for k, (shp, dt) in spec.items() if k in ("weight_scale", "weight_scale_2",
                                                                                      "weight_scale_inv")}
        for ex, sc in by_e.items():
            mask[ex] = True
            for k in st:
                st[k][ex] = sc[k].to(st[k].device)
        st["mask"] = mask
        out.setdefault(mod, {})[p] = st
    for mod, ps in out.items():  # tied NVFP4 w1/w3 global scales
        if "w1" in fmts.get(mod, {}) and fmts[mod].get("w1") == "nvfp4" and fmts[mod].get("w3") == "nvfp4":
            m1, m3 = ps.get("w1"), ps.get("w3")
            mk1 = m1["mask"] if m1 else torch.zeros(model.get_submodule(mod).num_experts, dtype=torch.bool)
            mk3 = m3["mask"] if m3 else torch.zeros_like(mk1)
            if not torch.equal(mk1, mk3):
                bad = torch.nonzero(mk1 ^ mk3).reshape(-1).tolist()
                raise ValueError(f"{mod}: experts {bad[:8]} freeze only one of w1 / w3, which share one NVFP4 global "
                                 "scale: freeze both or neither")
            if m1 and not torch.equal(m1["weight_scale_2"][mk1], m3["weight_scale_2"][mk1]):
                raise ValueError(f"{mod}: frozen w1 and w3 global scales (weight_scale_2) differ; they must be shared")
    return out


def prepare_qat(
    model: nn.Module,
    plan: Mapping[str, str] | None = None,
    *,
    recipe: str = "m3.1-flash",
    quantize_activations: bool = True,
    scale_rule: str = "rceil",
    backend: str = "auto",
    frozen: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
) -> nn.Module:
    """Prepare `model` for QAT in place (modules change class; parameters stay the same
    objects, so an existing optimizer keeps working) and return it.

    plan: {HF module name: fmt} (default `quantization_plan(model, recipe)`); frozen: scales to
    keep by plan entry (see `module_frozen_scales`).  `qat_step(model)` invalidates its weight
    caches by hand."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
    if is_qat(model):
        raise ValueError("model is already prepared for QAT")
    if any(getattr(m, "quant_kind", None) is not None for m in model.modules()):
        raise ValueError("model holds packed (converted) weights; QAT needs full-precision master weights "
                         "(msakit.quant.load_for_qat loads a quantized checkpoint for QAT)")
    _check_config(scale_rule, backend)
    plan = dict(quantization_plan(model, recipe) if plan is None else plan)
    fmts = module_formats(model, plan)
    frozen_m = module_frozen_scales(model, plan, frozen)
    state = QATState(plan=plan, config=QATConfig(bool(quantize_activations), scale_rule, backend), formats=fmts,
                     frozen=frozen_m)
    for mod_name, pf in fmts.items():
        m = model.get_submodule(mod_name)
        kind = module_kind(m)
        if kind == "experts":
            if all(f == "fp32" and getattr(m, w).dtype == torch.float32 for w, f in pf.items()):
                continue
            qat_cls = QATGroupedExperts
            act = False
        else:
            fmt = pf["weight"]
            if fmt == "fp32" and m.weight.dtype == torch.float32:
                continue  # routers: kept as they are
            if fmt == "bf16" and m.weight.dtype == torch.bfloat16:
                continue
            qat_cls = QATLinear if kind == "linear" else QATEmbedding
            act = kind == "linear" and fmt == "mxfp8" and quantize_activations
        base = next((b for b in _QAT_CLASSES if type(m) is b), None)
        if base is None:
            raise ValueError(f"{mod_name}: cannot prepare a {type(m).__name__} for QAT (expected nn.Linear, "
                             "nn.Embedding or GroupedExperts)")
        swap_class(m, qat_cls)
        attach(m, MODULE_KEY, _ModuleQAT(state, dict(pf), frozen_m.get(mod_name), act, mod_name))
    _ensure_optimizer_hook()
    add_hook(model, QAT_KEY, state.clear_slot)
    attach(model, QAT_KEY, state)
    return model


def _unwrap(model: nn.Module) -> QATState:
    state = _state(model)
    for m in model.modules():
        if detach(m, MODULE_KEY) is not None:
            restore_class(m)
    remove_hooks(model, QAT_KEY)
    detach(model, QAT_KEY)
    return state


def remove_qat(model: nn.Module) -> nn.Module:
    """Undo `prepare_qat` (full-precision forward again); returns the model."""
    _unwrap(model)
    return model


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def convert(
    model: nn.Module,
    plan: Mapping[str, str] | None = None,
    *,
    recipe: str = "m3.1-flash",
    quantize_activations: bool | None = None,
    scale_rule: str | None = None,
    backend: str | None = None,
    frozen: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
) -> nn.Module:
    """Swap in packed weights for inference, in place; returns the model.

    A QAT-prepared model converts with its own plan, settings and frozen scales, and its
    forward afterwards equals the QAT forward (the same dequantized weights, the same activation
    quantization).  A plain model converts by `plan` (default: `quantization_plan(model,
    recipe)`): post-training quantization.  Routers ("fp32") stay nn.Linear.  The plan is kept
    as ``model.quantization_plan_`` (what `save_quantized` writes)."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
    if is_qat(model):
        if plan is not None or frozen is not None:
            raise ValueError("a QAT-prepared model converts with its own plan and frozen scales; do not pass them")
        state = _unwrap(model)
        plan, fmts, frozen_m, cfg = state.plan, state.formats, state.frozen, state.config
    else:
        cfg = QATConfig(True if quantize_activations is None else bool(quantize_activations),
                        scale_rule or "rceil", backend or "auto")
        _check_config(cfg.scale_rule, cfg.backend)
        plan = dict(quantization_plan(model, recipe) if plan is None else plan)
        fmts = module_formats(model, plan)
        frozen_m = module_frozen_scales(model, plan, frozen)
    if quantize_activations is not None:
        cfg.quantize_activations = bool(quantize_activations)
    for mod_name, pf in fmts.items():
        m = model.get_submodule(mod_name)
        if getattr(m, "quant_kind", None) is not None:
            continue  # already packed
        kind = module_kind(m)
        fr = frozen_m.get(mod_name, {})
        if kind == "experts":
            if all(f == "fp32" and getattr(m, w).dtype == torch.float32 for w, f in pf.items()):
                continue
            new: nn.Module = PackedExperts.from_float(m, pf, frozen=fr, scale_rule=cfg.scale_rule, backend=cfg.backend,
                                                      name=mod_name)
        elif kind == "linear":
            fmt = pf["weight"]
            if fmt == "fp32" and m.weight.dtype == torch.float32:
                continue
            new = PackedLinear.from_float(m, fmt, frozen=fr.get("weight"),
                                          quantize_input=fmt == "mxfp8" and cfg.quantize_activations,
                                          scale_rule=cfg.scale_rule, backend=cfg.backend, name=mod_name)
        else:
            fmt = pf["weight"]
            if fmt == "fp32" and m.weight.dtype == torch.float32:
                continue
            new = PackedEmbedding.from_float(m, fmt)
        _set_submodule(model, mod_name, new)
    model.quantization_plan_ = dict(plan)
    return model
