"""Imports point one way: the package's layers, lazy (function-level) imports included.

Each module of ``specforge_kimi`` sits in one layer (docs/layout.md draws them); a module may import
from its own layer's package or from lower layers, never from a higher one, and the module graph
has no cycle. The imports are read from the source (an AST walk of every ``import`` statement,
inside functions too), so a lazy import that would close a circle at run time fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from package_modules import modules

#: Bottom first. A top-level module is its own unit; a subpackage is one unit.
LAYERS = [
    {"errors", "provenance", "scratch", "console", "durable", "procfs", "environment"},
    {"data"},
    {"targets"},
    {"drafts"},
    {"transport"},
    {"registration", ""},  # "" = the package's own __init__ (register() lazily imports registration)
    {"training"},
    {"servers"},
    {"plan"},
    {"setup"},
    {"run"},
    {"evaluate"},
    {"demo"},
    {"cli", "__main__", "capture_server"},
]
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


MODULES = modules()


def _unit(module: str) -> str:
    return module.split(".")[0] if module else ""


def _imports(module: str, path: Path) -> set[str]:
    """Modules of this package that ``module`` imports (``from X import name`` resolves ``X.name``
    when that is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
                target = "specforge_kimi" + ("." + target if target else "")
            else:
                target = node.module or ""
            names = [target] + [f"{target}.{a.name}" for a in node.names]
        for name in names:
            if name == "specforge_kimi" or name.startswith("specforge_kimi."):
                rel = name[len("specforge_kimi.") :] if name != "specforge_kimi" else ""
                if rel in MODULES and rel != module:
                    found.add(rel)
    return found


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def test_every_module_has_a_layer():
    missing = sorted({_unit(m) for m in MODULES} - set(RANK))
    assert not missing, f"units without a layer in LAYERS (add them to docs/layout.md too): {missing}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    up = sorted(d for d in GRAPH[module] if RANK[_unit(d)] > RANK[_unit(module)])
    assert not up, f"{module} (layer {RANK[_unit(module)]}) imports from a higher layer: {up}"


def test_no_import_cycle():
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(GRAPH[m]):
            if state.get(d) == 1:
                cycle = stack[stack.index(d) :] + [d]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)


def test_the_walk_sees_lazy_imports():
    """The walk is not vacuous: it finds a function-level import we know exists."""
    assert "registration" in GRAPH[""]  # register() imports it inside the function
