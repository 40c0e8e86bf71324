"""The import graph of model/ and service/, read from the sources: no module imports one
that imports it back (at any depth, counting imports inside functions and TYPE_CHECKING
blocks), and imports go down the floors DESIGN.md draws: model <- service.engine <-
service.api, with the hardware behind model/backends."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("model", "service")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _known(name: str) -> str | None:
    """The project module `name` is, or lies in (a name imported from a module)."""
    while name and name not in modules():
        name = name.rpartition(".")[0]
    return name or None


@cache
def imports() -> dict[str, frozenset[str]]:
    """Each project module's project imports, wherever in the file they stand."""
    graph = {}
    for name, path in modules().items():
        found: set[str | None] = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(_known(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parent, *([base] if base else [])])
                found.update(_known(f"{base}.{a.name}") or _known(base) for a in node.names)
        graph[name] = frozenset(m for m in found if m and m != name)
    return graph


def cycles() -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    graph, index, low, stack, on, out = imports(), {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while (w := stack.pop()) != v:
                on.discard(w)
                group.append(w)
            on.discard(v)
            if group:
                out.append(sorted([v, *group]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def importers_of(prefix: str, where: str) -> list[str]:
    """'a -> b' for each module under `where` that imports one under `prefix`."""
    return [
        f"{m} -> {d}"
        for m, deps in sorted(imports().items())
        if m == where or m.startswith(where + ".")
        for d in sorted(deps)
        if d == prefix or d.startswith(prefix + ".")
    ]


def test_the_reader_sees_the_imports() -> None:
    """The graph is read right: known edges of each kind are in it."""
    graph = imports()
    assert "model.config" in graph["model.transformer"]  # from model.config import X
    assert "model.backends.base" in graph["model.attention"]  # from a package's module
    assert "service.engine.request" in graph["service.engine.core.scheduler"]
    assert len(graph) > 60


def test_no_import_circles() -> None:
    assert cycles() == []


# the service's leaves, which any floor of it may read: the settings, the limits on what a
# request may ask, the processes' names
SERVICE_LEAVES = ("service.config", "service.limits", "service.proctitle")


def test_imports_go_one_way_down_the_floors() -> None:
    assert importers_of("service", "model") == []  # the model knows nothing of serving
    assert importers_of("service.api", "service.engine") == []
    # the engine reaches nothing of the service above it (the builder, the servers, the
    # CLI): what it needs built is handed to it
    upward = [
        edge
        for edge in importers_of("service", "service.engine")
        if not edge.split(" -> ")[1].startswith(("service.engine", *SERVICE_LEAVES))
    ]
    assert upward == []


def test_the_model_core_reaches_the_hardware_through_the_backend_interface() -> None:
    """model/ outside backends/ imports base (the interface) and reference (the plain
    torch backend), never the package that chooses among them nor a hardware backend."""
    core = [
        m
        for m in imports()
        if m.startswith("model.") and not m.startswith("model.backends") and m != "model"
    ]
    reached = {
        d
        for m in core
        for d in imports()[m]
        if d == "model.backends" or d.startswith("model.backends.")
    }
    assert reached <= {"model.backends.base", "model.backends.reference"}, sorted(reached)
