"""The house's arrows, read from the source's imports (every import, inside functions and under
TYPE_CHECKING included): packages import only downwards through the layers of docs/architecture.md,
no module takes part in an import cycle, and no module imports another package's underscore names."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "msakit"

# layer of each top-level part of msakit: a part may import parts of a lower layer, and parts of
# its own layer only where SAME_LAYER allows it (peers without cycles)
LAYERS = {
    "config_io": 0, "version": 0, "jsonl": 0, "run_folder": 0, "cost": 1, "sampling": 0, "ops": 0,
    "cache": 1,
    "nn": 2,
    "models": 3,
    "generate": 4, "graphs": 4, "train": 4, "speculative": 4, "eval": 4, "quant": 4, "distributed": 4,
    "commands": 5, "cli": 6, "__main__": 7, "__init__": 7,
}
SAME_LAYER = {  # (importer, imported) among peers; the graph of these pairs has no cycle
    ("cost", "config_io"), ("run_folder", "version"),
    ("generate", "graphs"), ("speculative", "generate"), ("speculative", "graphs"), ("speculative", "train"),
    ("speculative", "quant"), ("train", "distributed"), ("train", "generate"),
}


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def _imports(mods: dict[str, Path]) -> dict[str, set[tuple[str, str]]]:
    """module -> {(imported module, imported name or "")} over msakit's modules."""
    out: dict[str, set[tuple[str, str]]] = {}
    for name, path in mods.items():
        found: set[tuple[str, str]] = set()
        pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")
                    base = base[: len(base) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if not target.startswith("msakit"):
                    continue
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    found.add((sub, "") if sub in mods else (target, a.name))
            elif isinstance(node, ast.Import):
                found |= {(a.name, "") for a in node.names if a.name.startswith("msakit")}
        out[name] = {(t if t in mods else t.rpartition(".")[0], n) for t, n in found}
    return out


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_packages_import_downwards_only():
    mods = _modules()
    bad = []
    for m, deps in _imports(mods).items():
        a = _part(m)
        for t, _ in deps:
            b = _part(t)
            if a == b or (a, b) in SAME_LAYER:
                continue
            if LAYERS[b] >= LAYERS[a]:
                bad.append(f"{m} -> {t}")
    assert not bad, bad


def test_no_import_cycle_between_modules():
    mods = _modules()
    graph = {m: {t for t, _ in deps if t != m and t in mods} for m, deps in _imports(mods).items()}
    # a package's __init__ re-exporting its submodules is not an edge back from them
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_no_module_takes_another_packages_underscore_names():
    bad = []
    for m, deps in _imports(_modules()).items():
        for t, name in deps:
            if name.startswith("_") and not name.startswith("__") and _part(t) != _part(m):
                bad.append(f"{m}: {t}.{name}")
    assert not bad, bad
    for path in PKG.rglob("*.py"):  # nor from other libraries
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and not (node.level or (node.module or "").startswith("msakit")):
                names = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                assert not names, f"{path}: from {node.module} import {names}"
