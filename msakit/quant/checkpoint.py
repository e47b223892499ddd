"""The ModelOpt ``MIXED_PRECISION`` checkpoint layout of the released MiniMax checkpoints.

Tensors (safetensors, HF names; the layout of ModelOpt's mixed MXFP8 / NVFP4 export, docs/formats.md):

| module | tensors |
|---|---|
| NVFP4 (routed experts ``...experts.E.w1/w3/w2``) | ``.weight`` uint8 [N, K/2], ``.weight_scale`` float8_e4m3fn [N, K/16], ``.weight_scale_2`` float32 [] (w1 and w3 equal), ``.input_scale`` float32 [] (1.0; optional on load) |
| MXFP8 (attention, index branch, shared experts, dense MLPs) | ``.weight`` float8_e4m3fn [N, K], ``.weight_scale_inv`` uint8 E8M0 [N, K/32] |
| BF16 / FP32 (embeddings + lm_head / routers) | ``.weight`` |
| everything else (norms, routing-correction bias) | as in the model |

``config.json`` carries the model config plus ``quantization_config`` = ``{"quant_method":
"modelopt", "quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": null, "exclude_modules":
[...], "quantized_layers": {module: {"quant_algo": "NVFP4", "group_size": 16} | {"quant_algo":
"MXFP8"}}}``; ``hf_quant_config.json`` holds the same under ``quantization`` with a ``producer``.
Reading also accepts the rule form ``quantized_layers_rule`` (the 3.1-Flash fixture), the
``language_model.`` prefix of VL checkpoints (vision tensors skipped) and ``hf_quant_config.json``
alone (`msakit.quant.plan.plan_from_quant_config`).

    save_quantized(model, path)          # a converted, QAT-prepared or plain model (then quantized by the plan)
    model = load_quantized(path)         # packed inference model; model.quant_report: the scale check
    model = load_for_qat(path)           # full-precision masters prepared for QAT, foreign scales frozen

Round trips are bit-exact: save -> load -> save gives the same tensors, and so does
load_for_qat -> convert.  Scale check (on load): each quantized tensor is dequantized and
re-quantized by our rule (MXFP8 rceil; NVFP4 global scale amax/2688 tied over w1/w3, block
scales RNE(amax_b/6/gs)).  Where the checkpoint's scales are reproduced, QAT may re-derive
them; where not (MSE-calibrated or Four-over-Six NVFP4 scales, another MXFP8 rule), the scales
are kept frozen during QAT and the report gives the rate.  An NVFP4 global scale is re-derived
exactly when it is RN(A / 2688) of some float32 A (the dequantized maximum RN(2688 * gs) then
gives it back; checked on 4M samples); one made otherwise (amax * (1/2688), an inverted encode
scale 2688/amax: ~10% of tensors) is not, and that tensor's scales are frozen.  An MXFP8 block
whose largest code rounded down to 224 re-derives (rceil) with half the scale and codes 448 --
the same values, other bits: its largest element(s) move one ulp outward in the master weight
(a relative change of 6e-8; "nudged" in the report), after which the rule gives the stored bits.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
from torch import nn

from msakit.config_io import read_config_json
from msakit.models.config import M3Config
from msakit.models.io import copy_tensors, hf_state_items, save_tensors, split_stacked
from msakit.models.modeling import M3ForCausalLM
from msakit.version import __version__

from .formats import E8M0_DTYPE, mxfp8_quantize
from .linear import (
    PackedEmbedding,
    PackedExperts,
    PackedLinear,
    expert_global_scales,
    nvfp4_global_scales,
    nvfp4_quantize_grouped,
    pack_weight,
    unpack_weight,
)
from .plan import (
    module_formats,
    module_kind,
    plan_from_quant_config,
    plan_to_quant_config,
    quantization_plan,
)
from .qat import prepare_qat, qat_state

__all__ = [
    "ScaleReport",
    "quantized_state_items",
    "save_quantized",
    "read_quantization_config",
    "load_quantized",
    "load_for_qat",
    "check_scales",
]

HF_QUANT_CONFIG = "hf_quant_config.json"
_PACKED_STACK = re.compile(
    r"^(?P<pre>.*\.experts)\.(?P<w>w[123])_(?P<s>weight|weight_scale|weight_scale_2|weight_scale_inv|input_scale)$")
_FREEZE = ("auto", "all", "none")


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def _model_plan(model: nn.Module, plan: Mapping[str, str] | None) -> dict[str, str]:
    st = qat_state(model)
    if st is not None:
        if plan is not None and dict(plan) != st.plan:
            raise ValueError("a QAT-prepared model is saved with its own plan; do not pass another one")
        return st.plan
    if plan is not None:
        return dict(plan)
    p = getattr(model, "quantization_plan_", None)
    if p is not None:
        return dict(p)
    if any(getattr(m, "quant_kind", None) is not None for m in model.modules()):
        raise ValueError("model holds packed weights but no quantization_plan_; pass the plan")
    return quantization_plan(model)


def _split_stacked(mod: str, w: str, tensors: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    E = next(iter(tensors.values())).shape[0]
    for e in range(E):
        for s, t in tensors.items():
            yield f"{mod}.{e}.{w}.{s}", t[e]


def quantized_state_items(model: nn.Module, plan: Mapping[str, str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) of a model in the quantized layout.  Packed modules give their
    stored tensors; full-precision (or QAT-prepared) modules are quantized by the plan here (a
    QAT model with its frozen scales and scale rule); stacked experts are split per expert."""
    plan = _model_plan(model, plan)
    st = qat_state(model)
    rule = st.config.scale_rule if st is not None else "rceil"
    backend = st.config.backend if st is not None else "auto"
    frozen = st.frozen if st is not None else {}
    fmts = module_formats(model, plan)
    handled: list[str] = []
    for mod_name, pf in fmts.items():
        m = model.get_submodule(mod_name)
        handled.append(mod_name + ".")
        kind = module_kind(m)
        fr = frozen.get(mod_name, {})
        if kind == "experts":
            if isinstance(m, PackedExperts):
                for w in ("w1", "w3", "w2"):
                    if m.formats[w] != pf[w]:
                        raise ValueError(f"{mod_name}.{w} is packed as {m.formats[w]} but the plan says {pf[w]}")
                    yield from _split_stacked(mod_name, w, m.packed_tensors(w))
                continue
            ws = {"w1": m.w1, "w3": m.w3, "w2": m.w2}
            gsh = expert_global_scales(ws, pf)
            for w in ("w1", "w3", "w2"):
                t = pack_weight(ws[w], pf[w], global_scale=gsh.get(w), frozen=fr.get(w), scale_rule=rule,
                                backend=backend, name=f"{mod_name}.{w}")
                yield from _split_stacked(mod_name, w, t)
            continue
        fmt = pf["weight"]
        if isinstance(m, (PackedLinear, PackedEmbedding)):
            if m.fmt != fmt:
                raise ValueError(f"{mod_name} is packed as {m.fmt} but the plan says {fmt}")
            tensors = m.packed_tensors()
        else:
            tensors = pack_weight(m.weight, fmt, frozen=fr.get("weight"), scale_rule=rule, backend=backend,
                                  name=mod_name)
        for s, t in tensors.items():
            yield f"{mod_name}.{s}", t
    for name, t in model.state_dict().items():
        if not any(name.startswith(h) for h in handled):
            yield name, t


def _compute_dtype_of(model: nn.Module) -> torch.dtype:
    norm = getattr(getattr(model, "model", None), "norm", None)
    if norm is not None and hasattr(norm, "weight"):
        return norm.weight.dtype
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def save_quantized(model: nn.Module, path: str | Any, plan: Mapping[str, str] | None = None, *,
                   max_shard_size: int | str = "5GB") -> Path:
    """Write config.json (with ``quantization_config``), hf_quant_config.json and the
    safetensors shards of `model` in the ModelOpt MIXED_PRECISION layout; returns the folder."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "to_dict"):
        raise ValueError("save_quantized needs an M3ForCausalLM-like model (with .config)")
    plan = _model_plan(model, plan)
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    items = list(quantized_state_items(model, plan))
    qcfg = plan_to_quant_config(plan)
    d = cfg.replace(torch_dtype=str(_compute_dtype_of(model)).replace("torch.", "")).to_dict()
    d["quantization_config"] = qcfg
    (folder / "config.json").write_text(json.dumps(d, indent=2) + "\n", encoding="utf-8")
    hf = {"producer": {"name": "msakit", "version": __version__}, "quantization": qcfg}
    (folder / HF_QUANT_CONFIG).write_text(json.dumps(hf, indent=2) + "\n", encoding="utf-8")
    save_tensors(items, folder, max_shard_size=max_shard_size)
    return folder


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


def read_quantization_config(path: str | Any) -> tuple[dict, dict]:
    """(config.json as a dict, its quantization config) of a checkpoint folder: config.json's
    ``quantization_config`` (top level or in ``text_config``), else hf_quant_config.json's
    ``quantization``.  Raises FileNotFoundError / ValueError."""
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder not found: {folder}")
    raw, cpath = read_config_json(folder / "config.json")
    if not isinstance(raw, dict):
        raise ValueError(f"{cpath}: config must be a JSON object")
    q = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
    if q is None and (folder / HF_QUANT_CONFIG).is_file():
        try:
            q = json.loads((folder / HF_QUANT_CONFIG).read_text(encoding="utf-8")).get("quantization")
        except (json.JSONDecodeError, AttributeError) as e:
            raise ValueError(f"{folder / HF_QUANT_CONFIG}: not valid ({e})") from None
    if not q:
        raise ValueError(f"{folder}: no quantization_config in config.json nor {HF_QUANT_CONFIG}: not a quantized "
                         "checkpoint (use M3ForCausalLM.from_pretrained)")
    return raw, q


def _dtype(name: Any, default: torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if not name:
        return default
    t = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(t, torch.dtype) or not t.is_floating_point:
        raise ValueError(f"unsupported torch_dtype {name!r}")
    return t


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def _packed_skeleton(model: nn.Module, plan: Mapping[str, str], dtype: torch.dtype) -> None:
    """Replace the planned modules of a meta-device model by empty packed ones."""
    for mod_name, pf in module_formats(model, plan).items():
        m = model.get_submodule(mod_name)
        kind = module_kind(m)
        if kind == "experts":
            if all(f == "fp32" and getattr(m, w).dtype == torch.float32 for w, f in pf.items()):
                continue
            new: nn.Module = PackedExperts(m.num_experts, m.hidden_size, m.intermediate_size, pf, alpha=m.alpha,
                                           limit=m.limit, compute_dtype=dtype, device="meta")
        elif kind == "linear":
            fmt = pf["weight"]
            if fmt == "fp32" and m.weight.dtype == torch.float32:
                continue
            new = PackedLinear(m.in_features, m.out_features, fmt, compute_dtype=dtype, device="meta")
        else:
            fmt = pf["weight"]
            if fmt == "fp32" and m.weight.dtype == torch.float32:
                continue
            new = PackedEmbedding(m.num_embeddings, m.embedding_dim, fmt, compute_dtype=dtype,
                                  padding_idx=m.padding_idx, device="meta")
        _set_submodule(model, mod_name, new)


def _target_items(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor to copy into) for a skeleton model: views of the stacked buffers
    (float expert stacks split by `hf_state_items`, packed ones here)."""
    return split_stacked(hf_state_items(model), _PACKED_STACK, "{pre}.{e}.{w}.{s}")


_EXACT = (torch.uint8, torch.float8_e4m3fn)


def _check_stored(raw: str, name: str, sl: Any, tgt: torch.Tensor) -> str | None:
    """A stored tensor's problem (shape, or dtype against the packed layout), or None."""
    shape = tuple(sl.get_shape())
    if shape != tuple(tgt.shape) and not (tgt.dim() == 0 and shape in ((1,), ())):
        return f"{raw} shape {list(shape)} (expected {list(tgt.shape)})"
    dt = sl.get_dtype()
    if tgt.dtype in _EXACT:
        ok = {torch.uint8: ("U8",) + (("F8_E8M0",) if name.endswith("weight_scale_inv") else ()),
              torch.float8_e4m3fn: ("F8_E4M3",)}[tgt.dtype]
        if dt not in ok:
            return f"{raw} dtype {dt} (expected {ok[0]})"
    elif dt not in ("F32", "BF16", "F16", "F64"):
        return f"{raw} dtype {dt} (expected a float tensor)"
    return None


def _as_stored(src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    if E8M0_DTYPE is not None and src.dtype == E8M0_DTYPE:
        src = src.view(torch.uint8)
    return src.reshape(tgt.shape) if tgt.dim() == 0 else src


@torch.no_grad()
def _load_tensors(model: nn.Module, folder: Path) -> None:
    targets = dict(_target_items(model))
    absent = copy_tensors(folder, targets, what="its quantization_config", check=_check_stored,
                          mismatch="mismatched", optional=lambda name: name.endswith(".input_scale"), convert=_as_stored)
    for name in absent:  # weight-only exports: the input scales are unused on Hopper
        targets[name].fill_(1.0)


def load_quantized(path: str | Any, *, device: Any = None, dtype: torch.dtype | None = None, mode: str = "sparse",
                   check_scales: bool = True, scale_rule: str = "rceil", backend: str = "auto") -> nn.Module:
    """A quantized checkpoint -> `M3ForCausalLM` with packed modules (dequantize-then-matmul
    inference).  Its plan is ``model.quantization_plan_``; with `check_scales`, the scale
    check's `ScaleReport` is ``model.quant_report`` (else None).  `dtype` is the compute dtype of
    the unquantized parts (default: config.json's torch_dtype, else float32)."""
    folder = Path(path)
    raw, qcfg = read_quantization_config(folder)
    try:
        cfg = M3Config.from_dict(raw)
    except ValueError as e:
        raise ValueError(f"{folder / 'config.json'}: {e}") from None
    dt = _dtype(dtype, _dtype(raw.get("torch_dtype") or (raw.get("text_config") or {}).get("torch_dtype"),
                              torch.float32))
    with torch.device("meta"):
        model = M3ForCausalLM(cfg, mode=mode, init=False)
    plan = plan_from_quant_config(qcfg, model)
    model.to(dt)
    _packed_skeleton(model, plan, dt)
    model.to_empty(device=torch.device(device) if device is not None else torch.device("cpu"))
    _load_tensors(model, folder)
    model.quantization_plan_ = plan
    for m in model.modules():
        if hasattr(m, "backend") and getattr(m, "quant_kind", None):
            m.backend = backend
        if isinstance(m, PackedLinear):
            m.scale_rule = scale_rule
    model.quant_report = _check(model, plan, scale_rule, backend)[0] if check_scales else None
    return model


# ---------------------------------------------------------------------------------------------
# The scale check
# ---------------------------------------------------------------------------------------------


@dataclass
class ScaleReport:
    """How many quantized tensors (one per expert projection) our rule reproduces.  ``frozen``
    counts those it does not (their scales stay frozen in QAT); ``nudged`` the MXFP8 tensors
    reproduced only after moving the largest element(s) of ``nudged_blocks`` blocks (largest
    code 224) one ulp outward in the master weight."""

    scale_rule: str
    tensors: dict[str, int] = field(default_factory=lambda: {"nvfp4": 0, "mxfp8": 0})
    frozen: dict[str, int] = field(default_factory=lambda: {"nvfp4": 0, "mxfp8": 0})
    blocks: dict[str, int] = field(default_factory=lambda: {"nvfp4": 0, "mxfp8": 0})
    mismatched_blocks: dict[str, int] = field(default_factory=lambda: {"nvfp4": 0, "mxfp8": 0})
    nudged: int = 0
    nudged_blocks: int = 0
    frozen_names: list[str] = field(default_factory=list)

    def rate(self, fmt: str | None = None) -> float:
        """Share of tensors whose scales are kept frozen (0.0 = the rule reproduces all)."""
        fs = [fmt] if fmt else list(self.tensors)
        n = sum(self.tensors[f] for f in fs)
        return sum(self.frozen[f] for f in fs) / n if n else 0.0

    def block_rate(self, fmt: str | None = None) -> float:
        """Share of blocks that the rule does not reproduce (after the nudges)."""
        fs = [fmt] if fmt else list(self.blocks)
        n = sum(self.blocks[f] for f in fs)
        return sum(self.mismatched_blocks[f] for f in fs) / n if n else 0.0

    def summary(self) -> str:
        parts = [f"{f}: {self.frozen[f]}/{self.tensors[f]} tensors frozen ({self.rate(f):.1%}), "
                 f"{self.mismatched_blocks[f]}/{self.blocks[f]} blocks differ" for f in self.tensors if self.tensors[f]]
        return (f"scale check ({self.scale_rule}): " + ("; ".join(parts) or "nothing quantized")
                + f"; {self.nudged} MXFP8 tensors reproduced after a one-ulp nudge of {self.nudged_blocks} blocks")

    def to_dict(self) -> dict:
        return {"scale_rule": self.scale_rule, "tensors": self.tensors, "frozen": self.frozen, "blocks": self.blocks,
                "mismatched_blocks": self.mismatched_blocks, "nudged": self.nudged,
                "nudged_blocks": self.nudged_blocks, "rate": self.rate(), "block_rate": self.block_rate(),
                "frozen_names": self.frozen_names[:50]}


@dataclass
class _Result:
    name: str
    fmt: str
    ok: bool
    nudged: bool
    scales: dict[str, torch.Tensor]


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def _slice_ok(bad: torch.Tensor, lead: tuple[int, ...]) -> torch.Tensor:
    """Per leading index: no bad block (bad [*lead, N, nb]) -> bool [G]."""
    G = 1
    for d in lead:
        G *= d
    return bad.reshape(G, -1).any(-1).logical_not()


def _check_mxfp8(name: str, t: Mapping[str, torch.Tensor], rule: str, backend: str,
                 rep: ScaleReport) -> tuple[list[bool], list[bool], torch.Tensor]:
    """Per slice (ok, nudged) and the (nudged) float32 master values of one MXFP8 tensor."""
    codes, scales = t["weight"], _u8(t["weight_scale_inv"])
    if bool((scales == 255).any()):
        raise ValueError(f"{name}: weight_scale_inv holds the E8M0 NaN byte 255 (a corrupt checkpoint)")
    x = unpack_weight(t, "mxfp8", torch.float32, backend=backend)
    lead = tuple(codes.shape[:-2])
    nb = scales.shape[-1]
    xb = x.reshape(*codes.shape[:-1], nb, -1)
    nudged = torch.zeros(scales.shape, dtype=torch.bool, device=x.device)
    if rule == "rceil":
        # A block whose largest code rounded down to 224 re-derives with half the scale (the same
        # values, other bits): moving its largest element(s) one ulp outward restores the scale.
        cmax = codes.float().abs().reshape(xb.shape).amax(-1)
        amax = xb.abs().amax(-1, keepdim=True)
        nudged = (cmax == 224) & (amax.squeeze(-1) > 0)
        hit = nudged.unsqueeze(-1) & (xb.abs() == amax)
        inf = torch.full_like(xb, float("inf"))
        xb = torch.where(hit, torch.nextafter(xb, torch.where(xb < 0, -inf, inf)), xb)
        x = xb.reshape(codes.shape)
    c2, s2 = mxfp8_quantize(x, scale_rule=rule, backend=backend, check_finite=False)
    cb = (_u8(c2) != _u8(codes)).reshape(*codes.shape[:-1], nb, -1).any(-1)
    bad = cb | (s2 != scales)
    rep.blocks["mxfp8"] += bad.numel()
    rep.mismatched_blocks["mxfp8"] += int(bad.sum())
    ok = _slice_ok(bad, lead)
    nd = _slice_ok(nudged, lead).logical_not() & ok
    rep.nudged_blocks += int((nudged & ~bad).sum())
    if not bool(ok.all()):  # frozen slices keep the exact dequantized values
        x0 = unpack_weight(t, "mxfp8", torch.float32, backend=backend)
        keep = ok.reshape(*lead, 1, 1) if lead else ok.reshape(1, 1)
        x = torch.where(keep, x, x0)
    return ok.tolist(), nd.tolist(), x


def _check_nvfp4(tensors: list[Mapping[str, torch.Tensor]], backend: str,
                 rep: ScaleReport) -> tuple[list[bool], list[bool], list[torch.Tensor]]:
    """A tie group (w1, w3) or a single NVFP4 tensor: per slice (ok, nudged = False) and the
    float32 master values."""
    xs = [unpack_weight(t, "nvfp4", torch.float32, backend=backend) for t in tensors]
    gs = tensors[0]["weight_scale_2"].float()
    lead = tuple(gs.shape)
    G = max(1, gs.numel())
    tie_ok = torch.ones(G, dtype=torch.bool, device=gs.device)
    for t in tensors[1:]:
        tie_ok &= (t["weight_scale_2"].float() == gs).reshape(G)
    blocks_ok = torch.ones(G, dtype=torch.bool, device=gs.device)
    for t, x in zip(tensors, xs):
        p2, b2 = nvfp4_quantize_grouped(x, t["weight_scale_2"].float(), backend=backend)
        pb = (p2 != t["weight"]).reshape(*p2.shape[:-1], -1, 8).any(-1)
        bad = pb | (_u8(b2) != _u8(t["weight_scale"]))
        rep.blocks["nvfp4"] += bad.numel()
        rep.mismatched_blocks["nvfp4"] += int(bad.sum())
        blocks_ok &= _slice_ok(bad, lead)
    exact = (nvfp4_global_scales(*xs) == gs).reshape(G)
    ok = blocks_ok & tie_ok & exact
    oks = ok.tolist()
    nudges = [False] * G
    return oks, nudges, xs


def _check(model: nn.Module, plan: Mapping[str, str], rule: str,
           backend: str) -> tuple[ScaleReport, list[_Result], dict[tuple[str, str], torch.Tensor]]:
    """The scale check of a packed model: report, per plan entry results, and the float32
    master values {(module, param): tensor} (dequantized, nudged where that reproduces)."""
    rep = ScaleReport(rule)
    results: list[_Result] = []
    masters: dict[tuple[str, str], torch.Tensor] = {}
    for mod_name, pf in module_formats(model, plan).items():
        m = model.get_submodule(mod_name)
        if isinstance(m, PackedExperts):
            groups: list[tuple[str, ...]] = []
            if pf["w1"] == "nvfp4" and pf["w3"] == "nvfp4":
                groups.append(("w1", "w3"))
            groups += [(w,) for w in ("w1", "w3", "w2") if not any(w in g for g in groups)]
            for g in groups:
                fmt = pf[g[0]]
                ts = [m.packed_tensors(w) for w in g]
                if fmt == "mxfp8":
                    oks, nds, x = _check_mxfp8(f"{mod_name}.{g[0]}", ts[0], rule, backend, rep)
                    xs = [x]
                elif fmt == "nvfp4":
                    oks, nds, xs = _check_nvfp4(ts, backend, rep)
                else:
                    masters[(mod_name, g[0])] = unpack_weight(ts[0], fmt, torch.float32)
                    continue
                for w, t, x in zip(g, ts, xs):
                    masters[(mod_name, w)] = x
                    for e, (ok, nd) in enumerate(zip(oks, nds)):
                        sc = {k: v[e] for k, v in t.items() if k != "weight"}
                        results.append(_Result(f"{mod_name}.{e}.{w}", fmt, ok, nd, sc))
        elif isinstance(m, (PackedLinear, PackedEmbedding)):
            t = m.packed_tensors()
            if m.fmt == "mxfp8":
                oks, nds, x = _check_mxfp8(mod_name, t, rule, backend, rep)
            elif m.fmt == "nvfp4":
                oks, nds, xs = _check_nvfp4([t], backend, rep)
                x = xs[0]
            else:
                masters[(mod_name, "weight")] = unpack_weight(t, m.fmt, torch.float32)
                continue
            masters[(mod_name, "weight")] = x
            results.append(_Result(mod_name, m.fmt, oks[0], nds[0], {k: v for k, v in t.items() if k != "weight"}))
    for r in results:
        rep.tensors[r.fmt] += 1
        if not r.ok:
            rep.frozen[r.fmt] += 1
            rep.frozen_names.append(r.name)
        elif r.nudged:
            rep.nudged += 1
    return rep, results, masters


def check_scales(model: nn.Module, plan: Mapping[str, str] | None = None, *, scale_rule: str = "rceil",
                 backend: str = "auto") -> ScaleReport:
    """Check a packed model's scales against our rule (see the module docstring)."""
    plan = _model_plan(model, plan)
    return _check(model, plan, scale_rule, backend)[0]


@torch.no_grad()
def load_for_qat(path: str | Any, *, device: Any = None, dtype: torch.dtype = torch.float32, mode: str = "sparse",
                 freeze: str = "auto", scale_rule: str = "rceil", backend: str = "auto",
                 quantize_activations: bool = True) -> nn.Module:
    """A quantized checkpoint -> a full-precision `M3ForCausalLM` prepared for QAT.

    Master weights are the dequantized checkpoint (float32 by default; MXFP8 blocks with
    largest code 224 nudged by one ulp, see the module docstring).  freeze: "auto"
    keeps the scales our rule does not reproduce frozen (``model.quant_report.rate()``), "all"
    freezes every scale (ModelOpt's QAT), "none" re-derives all.  At step 0 the QAT forward uses
    exactly the checkpoint's dequantized weights, and `convert` gives back the checkpoint's
    tensors bit for bit."""
    if freeze not in _FREEZE:
        raise ValueError(f"freeze must be one of {_FREEZE}, got {freeze!r}")
    packed = load_quantized(path, device=device, mode=mode, check_scales=False, scale_rule=scale_rule, backend=backend)
    plan = packed.quantization_plan_
    rep, results, masters = _check(packed, plan, scale_rule, backend)
    with torch.device("meta"):
        model = M3ForCausalLM(packed.config, mode=mode, init=False)
    model.to(dtype)
    model.to_empty(device=packed.device)
    handled = []
    for (mod_name, p), x in masters.items():
        getattr(model.get_submodule(mod_name), p).copy_(x)
        handled.append(mod_name + ".")
    pstate = packed.state_dict()
    for name, t in model.state_dict().items():
        if not any(name.startswith(h) for h in handled):
            t.copy_(pstate[name])
    frozen: dict[str, dict[str, torch.Tensor]] = {}
    for r in results:
        if freeze == "all" or (freeze == "auto" and not r.ok):
            keep = ("weight_scale", "weight_scale_2") if r.fmt == "nvfp4" else ("weight_scale_inv",)
            frozen[r.name] = {k: r.scales[k] for k in keep}
    prepare_qat(model, plan, frozen=frozen, scale_rule=scale_rule, backend=backend,
                quantize_activations=quantize_activations)
    model.quant_report = rep
    return model
