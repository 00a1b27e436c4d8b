"""The package's import graph, read from the source: no cycle (type-only and function-level
imports count: they tie the modules as much as the others), and no import from a lower
layer to a higher one.

Layers, low to high: the core (Triton kernels and the eager DeepSeek-V4 CPU ops, then the
hierarchy; torch only), the pieces built on it (speculation presets, the config, the CPU
shims, the passkey prompts), the FlashMLA routing, vLLM's glue (``integration``), then what
users run (engine arguments, the demo and its model builders, Ray P/D, the tools and the
CLI)."""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PKG = "vllm_dhisparse"
LAYERS = [
    ("triton_kernels", "eager_v4"),
    ("hierarchy",),
    ("spec", "config", "compat", "needle"),
    ("flashmla",),
    ("integration",),
    ("engine_args",),
    ("demo", "demo_build", "ray_pd"),
    ("tools", ""),  # "": the package's __init__
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}
# inside integration/: shared modules, then folders by process, then the front
GLUE = [
    ("support", "metadata", "kv_spec", "draft_ring"),
    ("metrics", "handoff", "host_prefix"),
    ("engine_core", "layers"),
    ("worker",),
    ("connector", "extension_points", "plugin"),
]
GLUE_RANK = {name: rank for rank, names in enumerate(GLUE) for name in names}


def modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    out = {}
    for path in (root / PKG).rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(root: pathlib.Path) -> dict[str, set[str]]:
    """module -> the package's modules it imports, anywhere in its text."""
    mods = modules(root)

    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                names = [f"{base}.{a.name}" for a in node.names]
            for name in names:
                target = known(name)
                if target and target.startswith(PKG) and target != mod \
                        and not mod.startswith(target + "."):
                    graph[mod].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def layer(mod: str) -> int:
    return RANK[mod.split(".")[1] if "." in mod else ""]


def glue_layer(mod: str) -> int | None:
    parts = mod.split(".")
    return GLUE_RANK[parts[2]] if len(parts) > 2 and parts[1] == "integration" else None


def upward(graph: dict[str, set[str]]) -> list[str]:
    def up(a: str, b: str) -> bool:
        if layer(b) != layer(a):
            return layer(b) > layer(a)
        ga, gb = glue_layer(a), glue_layer(b)
        return ga is not None and gb is not None and gb > ga
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if up(a, b))


def test_every_module_has_a_layer():
    mods = modules(ROOT)
    assert [m for m in mods if (m.split(".") + [""])[1] not in RANK] == []
    glue = [m for m in mods if m.startswith(f"{PKG}.integration.")]
    assert [m for m in glue if m.split(".")[2] not in GLUE_RANK] == []


def test_no_import_cycle():
    assert cycles(imports(ROOT)) == []


def test_no_import_from_a_lower_layer_to_a_higher_one():
    assert upward(imports(ROOT)) == []


def test_the_checks_see_a_cycle_and_an_upward_import(tmp_path):
    """Both checks fail on the kind of import they forbid (they can fail)."""
    pkg = tmp_path / PKG
    (pkg / "hierarchy").mkdir(parents=True)
    (pkg / "integration").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "hierarchy" / "__init__.py").write_text("")
    (pkg / "integration" / "__init__.py").write_text("")
    (pkg / "hierarchy" / "a.py").write_text("from typing import TYPE_CHECKING\n"
                                            "if TYPE_CHECKING:\n    from .b import B\n")
    (pkg / "hierarchy" / "b.py").write_text("def f():\n    from . import a\n")
    (pkg / "hierarchy" / "c.py").write_text("from ..integration import support\n")
    (pkg / "integration" / "support.py").write_text("from vllm_dhisparse.hierarchy.a import x\n")
    for folder, text in (("layers", "from ..worker import side\n"), ("worker", "")):
        (pkg / "integration" / folder).mkdir()
        (pkg / "integration" / folder / "__init__.py").write_text("")
        (pkg / "integration" / folder / "side.py").write_text(text)
    graph = imports(tmp_path)
    assert cycles(graph) == [[f"{PKG}.hierarchy.a", f"{PKG}.hierarchy.b"]]
    assert upward(graph) == [f"{PKG}.hierarchy.c -> {PKG}.integration.support",
                             f"{PKG}.integration.layers.side -> {PKG}.integration.worker.side"]
