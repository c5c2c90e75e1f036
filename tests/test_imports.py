"""The import graph of ``dflash/``: no module imports itself back, directly or around a loop.

The graph is read from the source with :mod:`ast` (nothing is imported): every ``import`` and
``from … import`` of a ``dflash`` module anywhere in a file (function bodies included), except
inside ``if TYPE_CHECKING:`` blocks. ``from pkg import name`` points at ``pkg.name`` when that is
a module, else at ``pkg``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def module_files(root: Path) -> dict[str, Path]:
    """``{dotted module name: file}`` of every ``.py`` under ``root/dflash`` (a package is its ``__init__``)."""
    out = {}
    for path in sorted((root / "dflash").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def import_graph(root: Path) -> dict[str, set[str]]:
    """``{module: dflash modules it imports}`` (self-imports dropped)."""
    modules = module_files(root)

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        skip = _type_checking_nodes(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets.update(owner(a.name) for a in node.names if a.name.split(".")[0] == "dflash")
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    head = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(head + ([base] if base else []))
                if base.split(".")[0] != "dflash":
                    continue
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.add(full if full in modules else owner(base))
        targets.discard(None)
        targets.discard(name)
        graph[name] = targets  # type: ignore[assignment]
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_graph_reader_sees_lazy_relative_and_package_imports(tmp_path):
    """The reader on a made-up package: a function-level import, a relative one, a package
    import and a TYPE_CHECKING-only one; the two real loops are found, the type-only one is not."""
    pkg = tmp_path / "dflash"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from dflash.sub.b import thing\n")
    (pkg / "a.py").write_text("def f():\n    from dflash.sub import c\n")
    (pkg / "sub" / "b.py").write_text("from . import c\nthing = 1\n")
    (pkg / "sub" / "c.py").write_text("import dflash.a\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dflash import e\n")
    (pkg / "e.py").write_text("from dflash.d import x\n")
    graph = import_graph(tmp_path)
    assert graph["dflash.a"] == {"dflash.sub.c"}
    assert graph["dflash.sub.b"] == {"dflash.sub.c"}
    assert graph["dflash.sub.c"] == {"dflash.a"}
    assert graph["dflash.sub"] == {"dflash.sub.b"}
    assert graph["dflash.d"] == set()
    assert graph["dflash.e"] == {"dflash.d"}
    assert find_cycles(graph) == [["dflash.a", "dflash.sub.c"]]


def test_no_import_cycles_in_dflash():
    graph = import_graph(ROOT)
    assert len(graph) > 50  # the whole package was read
    pairs = sorted((a, b) for a in graph for b in graph[a] if a < b and a in graph.get(b, ()))
    assert pairs == [], f"modules that import each other: {pairs}"
    assert find_cycles(graph) == [], "import cycles: " + "; ".join(" -> ".join(c) for c in find_cycles(graph))


@pytest.mark.parametrize("module, forbidden", [
    ("dflash.training.reference", "dflash.runtime"),
    ("dflash.training.evaluation", "dflash.training.trainer"),
    ("dflash.runtime.drafter", "dflash.training.reference"),
])
def test_layering(module, forbidden):
    """The single-process oracle imports nothing of the runtime; evaluation never imports the
    trainer; the production drafter worker never imports the oracle."""
    graph = import_graph(ROOT)
    bad = sorted(m for m in graph[module] if m == forbidden or m.startswith(forbidden + "."))
    assert bad == [], f"{module} imports {bad}"
