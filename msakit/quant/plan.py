"""Quantization plans: which format each weight of an M3 model gets, in checkpoint (HF) names.

A plan is a plain ``{module name: format}`` dict, format one of ``"nvfp4" | "mxfp8" | "bf16" |
"fp32"``.  Names are the HF checkpoint module names (``model.layers.3.self_attn.q_proj``,
``model.layers.3.block_sparse_moe.experts.7.w1``, ``lm_head``), even though msakit stores the
routed experts stacked (``...block_sparse_moe.experts.w1`` [E, I, H]): the plan speaks the
checkpoint's language, and `resolve_plan` / `plan_tensor` map its entries to the stacked
tensors (``experts.7.w1`` -> ``experts.w1[7]``).

Entries cover every weight matrix: linear layers (attention, index branch, shared experts,
dense MLPs, routers, lm_head), the embedding and each routed expert projection.  Norms and the
routing-correction bias are not in a plan (they are small and never quantized).

Recipes (`quantization_plan(model, recipe)`), by module role:

| role | m3.1-flash | nvfp4-experts | nvfp4 | mxfp8 | bf16 |
|---|---|---|---|---|---|
| routed experts (``experts.E.w1/w3/w2``) | nvfp4 | nvfp4 | nvfp4 | mxfp8 | bf16 |
| attention ``q/k/v/o_proj``, index ``index_q/k_proj`` | mxfp8 | bf16 | nvfp4 | mxfp8 | bf16 |
| shared experts, dense MLPs (``gate/up/down_proj``) | mxfp8 | bf16 | nvfp4 | mxfp8 | bf16 |
| router ``block_sparse_moe.gate`` | fp32 | fp32 | fp32 | fp32 | fp32 |
| ``model.embed_tokens``, ``lm_head`` (and any other module) | bf16 | bf16 | bf16 | bf16 | bf16 |

"nvfp4" (every transformer-stack weight NVFP4, weight-only like the experts) is a stress recipe:
its PTQ loss gap is large enough to measure what QAT recovers on small models, where the
released recipe's gap is within noise.  "m3.1-flash" is the released MiniMax-M3.1-Flash layout (ModelOpt ``MIXED_PRECISION``); NVFP4
w1 and w3 of one expert share one global scale (`nvfp4_scale_groups`).  Blocks run along the
input dimension K (NVFP4 16, MXFP8 32), which must divide K.

A plan read from a checkpoint's ``quantization_config`` (`plan_from_quant_config`) accepts the
ModelOpt explicit ``quantized_layers`` map, the rule form ``quantized_layers_rule`` (regexes,
as in the 3.1-Flash fixture), ``exclude_modules`` (names, globs or ``re:`` regexes), single
algorithm ModelOpt configs (``quant_algo`` "NVFP4" / "MXFP8") and the vendor MXFP8 config
(``quant_method`` "mxfp8" with ``ignored_layers``).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from msakit.models import M3Config, M3ForCausalLM
from msakit.models.io import few_names
from msakit.nn.moe import GroupedExperts

__all__ = [
    "FORMATS",
    "RECIPES",
    "BLOCK",
    "PlanEntry",
    "module_role",
    "module_kind",
    "plan_entries",
    "quantization_plan",
    "validate_plan",
    "resolve_plan",
    "plan_tensor",
    "plan_counts",
    "module_formats",
    "nvfp4_scale_groups",
    "plan_from_quant_config",
    "plan_to_quant_config",
]

FORMATS = ("nvfp4", "mxfp8", "bf16", "fp32")
BLOCK = {"nvfp4": 16, "mxfp8": 32}  # block length along K
QUANT_ALGO = {"nvfp4": "NVFP4", "mxfp8": "MXFP8"}
_ALGO_FMT = {"NVFP4": "nvfp4", "MXFP8": "mxfp8"}

ROLES = ("routed_expert", "router", "shared_expert", "index", "attention", "dense_mlp", "embedding", "head", "other")
_ROLE_RES = (
    ("routed_expert", re.compile(r"(?:^|.*\.)block_sparse_moe\.experts\.\d+\.w[123]$")),
    ("router", re.compile(r"(?:^|.*\.)block_sparse_moe\.gate$")),
    ("shared_expert", re.compile(r"(?:^|.*\.)shared_experts\.(?:gate|up|down)_proj$")),
    ("index", re.compile(r"(?:^|.*\.)self_attn\.index_[qk]_proj$")),
    ("attention", re.compile(r"(?:^|.*\.)self_attn\.[qkvo]_proj$")),
    ("dense_mlp", re.compile(r"(?:^|.*\.)mlp\.(?:gate|up|down)_proj$")),
    ("embedding", re.compile(r"(?:^|.*\.)embed_tokens$")),
    ("head", re.compile(r"^(?:.*\.)?lm_head$")),
)

RECIPES: dict[str, dict[str, str]] = {
    "m3.1-flash": dict(routed_expert="nvfp4", attention="mxfp8", index="mxfp8", shared_expert="mxfp8",
                       dense_mlp="mxfp8", router="fp32", embedding="bf16", head="bf16", other="bf16"),
    "nvfp4-experts": dict(routed_expert="nvfp4", attention="bf16", index="bf16", shared_expert="bf16",
                          dense_mlp="bf16", router="fp32", embedding="bf16", head="bf16", other="bf16"),
    "nvfp4": dict(routed_expert="nvfp4", attention="nvfp4", index="nvfp4", shared_expert="nvfp4",
                  dense_mlp="nvfp4", router="fp32", embedding="bf16", head="bf16", other="bf16"),
    "mxfp8": dict(routed_expert="mxfp8", attention="mxfp8", index="mxfp8", shared_expert="mxfp8",
                  dense_mlp="mxfp8", router="fp32", embedding="bf16", head="bf16", other="bf16"),
    "bf16": dict(routed_expert="bf16", attention="bf16", index="bf16", shared_expert="bf16",
                 dense_mlp="bf16", router="fp32", embedding="bf16", head="bf16", other="bf16"),
}
_PREFIXES = ("language_model.",)
_EXPERT_NAME = re.compile(r"^(?P<pre>.*\.experts)\.(?P<e>\d+)\.(?P<w>w[123])$")


@dataclass(frozen=True)
class PlanEntry:
    """One weight matrix of the model, under its checkpoint name.

    ``module``/``param``/``expert`` locate the tensor in msakit: ``model.get_submodule(module)``
    holds it as ``param`` (``"weight"``, or ``"w1"``/``"w3"``/``"w2"`` of stacked experts, then
    indexed by ``expert``).  ``shape`` is the checkpoint shape [N, K] (blocks run along K);
    ``kind`` is "linear", "embedding" or "experts"; ``fmt`` is None until a plan assigns one."""

    name: str
    role: str
    kind: str
    module: str
    param: str
    expert: int | None
    shape: tuple[int, int]
    fmt: str | None = None

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]


def module_role(name: str) -> str:
    """The role of a module, from its HF name (see the recipe table)."""
    for pre in _PREFIXES:
        if name.startswith(pre):
            name = name[len(pre):]
    for role, rx in _ROLE_RES:
        if rx.match(name):
            return role
    return "other"


def _as_model(model: Any) -> nn.Module:
    if isinstance(model, nn.Module):
        return model

    if isinstance(model, M3Config):
        with torch.device("meta"):
            return M3ForCausalLM(model, init=False)
    raise ValueError(f"model must be an nn.Module (e.g. M3ForCausalLM) or an M3Config, got {type(model).__name__}")


def module_kind(m: nn.Module) -> str | None:
    """"experts" (GroupedExperts and its QAT / packed forms), "linear", "embedding" or None."""

    if isinstance(m, GroupedExperts):
        return "experts"
    if isinstance(m, nn.Linear):
        return "linear"
    if isinstance(m, nn.Embedding):
        return "embedding"
    return getattr(m, "quant_kind", None)  # msakit.quant.linear's packed modules


def plan_entries(model: Any) -> list[PlanEntry]:
    """Every weight matrix of `model` (an nn.Module, QAT-prepared or converted, or an M3Config,
    built on the meta device) as `PlanEntry`s in module order, fmt None."""
    model = _as_model(model)
    out: list[PlanEntry] = []
    for mname, m in model.named_modules():
        kind = module_kind(m)
        if kind is None:
            continue
        if kind == "experts":
            E, H, I = m.num_experts, m.hidden_size, m.intermediate_size
            for e in range(E):
                for w, shape in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
                    name = f"{mname}.{e}.{w}"
                    out.append(PlanEntry(name, "routed_expert", kind, mname, w, e, shape))
        elif kind == "linear":
            out.append(PlanEntry(mname, module_role(mname), kind, mname, "weight", None,
                                 (int(m.out_features), int(m.in_features))))
        elif kind == "embedding":
            out.append(PlanEntry(mname, module_role(mname), kind, mname, "weight", None,
                                 (int(m.num_embeddings), int(m.embedding_dim))))
    return out


def _check_entry(entry: PlanEntry, fmt: Any) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"plan entry {entry.name!r}: format must be one of {FORMATS}, got {fmt!r}")
    if entry.role == "router" and fmt != "fp32":
        raise ValueError(f"plan entry {entry.name!r}: routers stay 'fp32' (the MoE computes its router logits in "
                         f"float32 from the weight directly), got {fmt!r}")
    if fmt in BLOCK:
        if entry.kind == "embedding":
            raise ValueError(f"plan entry {entry.name!r}: an embedding can only be 'bf16' or 'fp32', got {fmt!r}")
        K = entry.shape[1]
        if K % BLOCK[fmt]:
            raise ValueError(f"plan entry {entry.name!r}: {fmt} needs the input dimension K={K} to be a multiple of "
                             f"{BLOCK[fmt]}")


def quantization_plan(model: Any, recipe: str = "m3.1-flash") -> dict[str, str]:
    """{HF module name: "nvfp4" | "mxfp8" | "bf16" | "fp32"} for every weight matrix of `model`
    (an nn.Module, possibly on the meta device, or an M3Config) under `recipe` (see `RECIPES`).

    Raises ValueError for an unknown recipe, or a layer whose input dimension the format's block
    does not divide."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; known: {', '.join(RECIPES)}")
    table = RECIPES[recipe]
    plan: dict[str, str] = {}
    for entry in plan_entries(model):
        fmt = table[entry.role]
        _check_entry(entry, fmt)
        plan[entry.name] = fmt
    return plan


def _entries_by_name(model: Any) -> dict[str, PlanEntry]:
    return {e.name: e for e in plan_entries(model)}


def validate_plan(model: Any, plan: Mapping[str, str], *, complete: bool = False) -> None:
    """Raises ValueError if `plan` names a module `model` lacks, gives an unknown format, a block
    that does not divide K, or (complete=True) leaves a weight matrix out."""
    resolve_plan(model, plan, complete=complete)


def resolve_plan(model: Any, plan: Mapping[str, str], *, complete: bool = False) -> list[PlanEntry]:
    """The plan's entries located in `model` (module, parameter, expert index, shape, fmt), in
    model order.  The helper from checkpoint names to msakit's stacked tensors."""
    if not isinstance(plan, Mapping):
        raise ValueError(f"plan must be a dict {{module name: format}}, got {type(plan).__name__}")
    entries = _entries_by_name(model)
    unknown = [n for n in plan if _strip(n) not in entries]
    if unknown:
        raise ValueError(f"plan names {len(unknown)} module(s) the model does not have: {few_names(unknown, 5)}")
    if complete:
        missing = [n for n in entries if n not in plan and not any(_strip(k) == n for k in plan)]
        if missing:
            raise ValueError(f"plan leaves out {len(missing)} weight matrix(es): {few_names(missing, 5)}")
    fmts = {_strip(n): f for n, f in plan.items()}
    out = []
    for name, entry in entries.items():
        if name in fmts:
            _check_entry(entry, fmts[name])
            out.append(PlanEntry(**{**entry.__dict__, "fmt": fmts[name]}))
    return out


def plan_tensor(model: nn.Module, entry: PlanEntry | str) -> torch.Tensor:
    """The full-precision weight of a plan entry (a view into the stacked expert tensor for
    ``...experts.E.wX``).  Raises ValueError for a converted (packed) module."""
    if isinstance(entry, str):
        e = _entries_by_name(model).get(_strip(entry))
        if e is None:
            raise ValueError(f"model has no weight matrix named {entry!r}")
        entry = e
    mod = model.get_submodule(entry.module)
    t = getattr(mod, entry.param, None)
    if not isinstance(t, torch.Tensor) or getattr(mod, "quant_kind", None) is not None:
        raise ValueError(f"{entry.name}: module {entry.module} holds packed weights, not a full-precision tensor")
    return t[entry.expert] if entry.expert is not None else t


def plan_counts(model: Any, plan: Mapping[str, str]) -> dict[str, int]:
    """Parameters per format {fmt: count} (all four formats, zeros included)."""
    counts = {f: 0 for f in FORMATS}
    for e in resolve_plan(model, plan):
        counts[e.fmt] += e.numel
    return counts


def module_formats(model: Any, plan: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """{msakit module name: {param: fmt}} -- the plan grouped by the modules that hold the
    tensors (``...experts``: {"w1": ..., "w3": ..., "w2": ...}).  Stacked experts must share one
    format per projection; a plan that mixes formats across the experts of one layer, or covers
    only some of them, raises ValueError (msakit stores them as one tensor)."""
    entries = resolve_plan(model, plan)
    grouped: dict[str, dict[str, set]] = {}
    count: dict[tuple[str, str], int] = {}
    model_ = _as_model(model)
    for e in entries:
        grouped.setdefault(e.module, {}).setdefault(e.param, set()).add(e.fmt)
        count[(e.module, e.param)] = count.get((e.module, e.param), 0) + 1
    out: dict[str, dict[str, str]] = {}
    for mod, params in grouped.items():
        out[mod] = {}
        for p, fmts in params.items():
            if len(fmts) > 1:
                raise ValueError(f"plan gives {mod}.*.{p} several formats ({sorted(fmts)}): the routed experts of one "
                                 "layer are stored stacked and must share one format per projection")
            m = model_.get_submodule(mod)
            if module_kind(m) == "experts" and count[(mod, p)] != m.num_experts:
                raise ValueError(f"plan covers {count[(mod, p)]} of the {m.num_experts} experts of {mod}.*.{p}: "
                                 "give every expert of a layer a format")
            out[mod][p] = next(iter(fmts))
    return out


def nvfp4_scale_groups(plan: Mapping[str, str]) -> list[tuple[str, ...]]:
    """Names that share one NVFP4 global scale (``weight_scale_2``): (w1, w3) of each routed
    expert whose two projections are both NVFP4 (the fused gate/up GEMM needs one scale); every
    other NVFP4 entry alone."""
    nv = [n for n, f in plan.items() if f == "nvfp4"]
    done: set[str] = set()
    groups: list[tuple[str, ...]] = []
    nvset = set(nv)
    for n in nv:
        if n in done:
            continue
        m = _EXPERT_NAME.match(n)
        if m and m["w"] in ("w1", "w3"):
            other = f"{m['pre']}.{m['e']}.{'w3' if m['w'] == 'w1' else 'w1'}"
            if other in nvset:
                pair = (n, other) if m["w"] == "w1" else (other, n)
                groups.append(pair)
                done.update(pair)
                continue
        groups.append((n,))
        done.add(n)
    return groups


# ---------------------------------------------------------------------------------------------
# quantization_config (config.json) <-> plan
# ---------------------------------------------------------------------------------------------


def _strip(name: str) -> str:
    for pre in _PREFIXES:
        if name.startswith(pre):
            return name[len(pre):]
    return name


def _pattern_matches(pattern: str, name: str) -> bool:
    """ModelOpt-style module pattern: ``re:<regex>`` (full match), else a glob / exact name.
    Tried on the bare name and with the ``language_model.`` prefix of the VL checkpoints."""
    cands = (name, "language_model." + name)
    if pattern.startswith("re:"):
        rx = re.compile(pattern[3:])
        return any(rx.fullmatch(c) for c in cands)
    return any(fnmatch.fnmatchcase(c, pattern) for c in cands)


def _algo_fmt(spec: Any, where: str) -> str:
    if isinstance(spec, str):
        spec = {"quant_algo": spec}
    if not isinstance(spec, Mapping):
        raise ValueError(f"{where}: expected {{'quant_algo': ...}}, got {spec!r}")
    algo = str(spec.get("quant_algo", "")).upper()
    if algo not in _ALGO_FMT:
        raise ValueError(f"{where}: unsupported quant_algo {spec.get('quant_algo')!r} (supported: NVFP4, MXFP8)")
    fmt = _ALGO_FMT[algo]
    gs = spec.get("group_size")
    if gs is not None and int(gs) != BLOCK[fmt]:
        raise ValueError(f"{where}: {algo} with group_size {gs} is unsupported (only {BLOCK[fmt]})")
    return fmt


def plan_from_quant_config(qcfg: Mapping[str, Any], model: Any) -> dict[str, str]:
    """The plan a checkpoint's ``quantization_config`` (or ``hf_quant_config.json``'s
    ``quantization``) describes for `model`.

    Precedence per weight matrix: an explicit ``quantized_layers`` entry, then the first
    matching ``quantized_layers_rule`` regex, then the config-wide algorithm (single-algorithm
    configs), else unquantized: "fp32" for routers, "bf16" for everything else (excluded
    modules included).  Raises ValueError for an unsupported method or algorithm, and for an
    explicit entry that names no module of the model."""
    if not isinstance(qcfg, Mapping):
        raise ValueError(f"quantization_config must be a JSON object, got {type(qcfg).__name__}")
    method = str(qcfg.get("quant_method", "modelopt")).lower()
    algo = qcfg.get("quant_algo")
    layers: Mapping[str, Any] = {}
    rules: Mapping[str, Any] = {}
    default: str | None = None
    if method == "mxfp8":  # the vendor M3-MXFP8 config
        bs = qcfg.get("weight_block_size", [1, 32])
        if list(bs) != [1, 32]:
            raise ValueError(f"quantization_config: mxfp8 weight_block_size {bs} is unsupported (only [1, 32])")
        excludes = list(qcfg.get("ignored_layers") or [])
        default = "mxfp8"
    elif method == "modelopt":
        excludes = list(qcfg.get("exclude_modules") or [])
        if algo is None or str(algo).upper() == "MIXED_PRECISION":
            layers = qcfg.get("quantized_layers") or {}
            rules = qcfg.get("quantized_layers_rule") or {}
            if not isinstance(layers, Mapping) or not isinstance(rules, Mapping):
                raise ValueError("quantization_config: quantized_layers / quantized_layers_rule must be objects")
            if not layers and not rules:
                raise ValueError("quantization_config: MIXED_PRECISION without quantized_layers or quantized_layers_rule")
        else:
            default = _algo_fmt({"quant_algo": algo, "group_size": qcfg.get("group_size")}, "quantization_config")
    else:
        raise ValueError(f"quantization_config: unsupported quant_method {qcfg.get('quant_method')!r} "
                         "(supported: modelopt, mxfp8)")
    explicit = {_strip(k): _algo_fmt(v, f"quantized_layers[{k!r}]") for k, v in layers.items()}
    rule_list = [(k, _algo_fmt(v, f"quantized_layers_rule[{k!r}]")) for k, v in rules.items()]
    for k in rules:
        if not isinstance(k, str):
            raise ValueError(f"quantized_layers_rule keys must be strings, got {k!r}")
    entries = plan_entries(model)
    names = {e.name for e in entries}
    stray = [k for k in explicit if k not in names]
    if stray:
        raise ValueError(f"quantization_config.quantized_layers names {len(stray)} module(s) the model does not have: "
                         f"{few_names(stray, 5)}")
    plan: dict[str, str] = {}
    for e in entries:
        fmt = explicit.get(e.name)
        if fmt is None:
            for pat, f in rule_list:
                if _pattern_matches(pat, e.name):
                    fmt = f
                    break
        if fmt is None and default is not None and e.kind != "embedding" \
                and not any(_pattern_matches(p, e.name) for p in excludes):
            fmt = default
        if fmt is None:
            fmt = "fp32" if e.role == "router" else "bf16"
        _check_entry(e, fmt)
        plan[e.name] = fmt
    return plan


def plan_to_quant_config(plan: Mapping[str, str]) -> dict[str, Any]:
    """ModelOpt ``MIXED_PRECISION`` quantization_config: ``quantized_layers`` lists every NVFP4
    ({"quant_algo": "NVFP4", "group_size": 16}) and MXFP8 ({"quant_algo": "MXFP8"}) module,
    ``exclude_modules`` the unquantized ones."""
    quantized: dict[str, Any] = {}
    exclude: list[str] = []
    for name, fmt in plan.items():
        if fmt == "nvfp4":
            quantized[name] = {"quant_algo": "NVFP4", "group_size": 16}
        elif fmt == "mxfp8":
            quantized[name] = {"quant_algo": "MXFP8"}
        elif fmt in ("bf16", "fp32"):
            exclude.append(name)
        else:
            raise ValueError(f"plan entry {name!r}: unknown format {fmt!r}")
    return {
        "quant_method": "modelopt",
        "quant_algo": "MIXED_PRECISION",
        "kv_cache_quant_algo": None,
        "exclude_modules": exclude,
        "quantized_layers": quantized,
    }
