"""The house's size and room rules, checked (DESIGN.md): no function of model/ or service/
over 60 lines, so each reads in a sitting, except the listed ones, each with why; and
the engine's rooms (service/engine/: process, core, exec, kv, sample, text) keep their floors."""

import ast
from pathlib import Path

from tests.test_imports import importers_of

ROOT = Path(__file__).resolve().parents[1]
FUNCTION_MAX_LINES = 60

# longer by nature, and why
LONGER = {
    "model/backends/triton/kernels.py::_paged_attention_kernel": "a Triton kernel is one "
    "jit function, its tile loop read as one (helpers are inlined into it anyway)",
    "model/backends/triton/kernels.py::_decode_split_kernel": "a Triton kernel",
    "model/backends/triton/kernels.py::_attend_tile": "a Triton kernel's tile step",
    "service/api/metrics.py::Metrics.__init__": "declares every metric family, one "
    "statement each: a table, not logic",
}


def function_lengths() -> dict[str, int]:
    """Every function and method of model/ and service/ by `path::Class.name`, with its
    lines (decorators and docstring included)."""
    sizes = {}
    for path in sorted([*(ROOT / "model").rglob("*.py"), *(ROOT / "service").rglob("*.py")]):
        where = path.relative_to(ROOT).as_posix()
        for name, node in _functions(ast.parse(path.read_text()), ""):
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            sizes[f"{where}::{name}"] = node.end_lineno - start + 1  # type: ignore[operator]
    return sizes


def _functions(tree: ast.AST, prefix: str):  # type: ignore[no-untyped-def]
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield prefix + node.name, node
            yield from _functions(node, prefix + node.name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, prefix + node.name + ".")


def test_no_function_is_over_60_lines_but_the_listed() -> None:
    sizes = function_lengths()
    assert len(sizes) > 1000  # the sources were read
    long = {name: n for name, n in sizes.items() if n > FUNCTION_MAX_LINES}
    assert {n: s for n, s in long.items() if n not in LONGER} == {}
    assert [n for n in LONGER if n not in long] == []  # split, or renamed: off the list


# the engine's rooms, top floor first: each imports only from its own room and those
# below it; the records every room shares (request, batch, output) lie under them all
ENGINE_FLOORS = [("process",), ("core",), ("exec",), ("kv", "sample", "text"), ("",)]


def _floor(module: str) -> int:
    room = module.removeprefix("service.engine.").split(".")[0]
    room = room if (ROOT / "service/engine" / room).is_dir() else ""
    return next(i for i, rooms in enumerate(ENGINE_FLOORS) if room in rooms)


def _room(module: str) -> str:
    parts = module.removeprefix("service.engine.").split(".")
    return parts[0] if len(parts) > 1 else ""


def test_the_engine_rooms_import_only_down_their_floors() -> None:
    edges = [e.split(" -> ") for e in importers_of("service.engine", "service.engine")]
    assert len(edges) > 50  # the graph was read
    up = [
        f"{a} -> {b}"
        for a, b in edges
        if _floor(b) < _floor(a) or (_floor(b) == _floor(a) and _room(a) != _room(b))
    ]
    assert up == []
