"""A kernel source of model/backends/cpu/kernels as it is in this tree or as it was at
another commit (with the headers beside it then), compiled with given flags and loaded;
and the timing loop that alternates two builds' calls in one process. What
linear_baseline.py and attention_baseline.py are made of: a kernel change measured
without the drift between two runs minutes apart that a shared machine shows."""

from __future__ import annotations

import ctypes
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from model.backends.cpu.kernels.build import HERE, LINK_FLAGS, c_compiler

ROOT = Path(__file__).resolve().parents[2]
# where the kernel sources lie, now and in commits before model/backends/cpu/ held them
SOURCE_DIRS = (HERE.relative_to(ROOT), Path("model/kernels"))


def _listing(rev: str) -> tuple[Path, list[str]]:
    """The kernels' folder at commit `rev` and its file names."""
    for rel in SOURCE_DIRS:
        out = subprocess.run(
            ["git", "ls-tree", "--name-only", f"{rev}:{rel}"], cwd=ROOT, capture_output=True,
            text=True,
        )  # fmt: skip
        if out.returncode == 0:
            return rel, out.stdout.split()
    raise SystemExit(f"no kernel sources at {rev} (looked in {', '.join(map(str, SOURCE_DIRS))})")


def library_at(rev: str | None, source: str, flags: list[str], tmp: Path) -> ctypes.CDLL:
    """`source` (a file of the kernels' folder) built with `flags` in a fresh folder under
    tmp: this tree's files (rev None) or those at commit `rev`."""
    src = tmp / (rev or "tree").replace("/", "_") / "src"
    src.mkdir(parents=True)
    if rev is None:
        names = [source, *(p.name for p in HERE.glob("*.h"))]
        for name in names:
            (src / name).write_bytes((HERE / name).read_bytes())
    else:
        rel, listing = _listing(rev)
        for name in [source, *(n for n in listing if n.endswith(".h"))]:
            text = subprocess.run(
                ["git", "show", f"{rev}:{rel / name}"], cwd=ROOT, capture_output=True, check=True
            ).stdout
            (src / name).write_bytes(text)
    compiler = c_compiler()
    if compiler is None:
        raise SystemExit("no C compiler (cc or gcc) to build the kernels with")
    obj, lib = src.parent / "kernel.o", src.parent / "kernel.so"
    subprocess.run([compiler, *flags, "-c", str(src / source), "-o", str(obj)], check=True)
    subprocess.run([compiler, *LINK_FLAGS, str(obj), "-o", str(lib), "-lm"], check=True)
    return ctypes.CDLL(str(lib))


def alternate(a: Callable[[], None], b: Callable[[], None], repeats: int) -> tuple[float, float]:
    """Median ms of a and of b over repeats turns, each turn's first alternating."""
    ta, tb = alternate_parts({"": a}, {"": b}, repeats)
    return ta[""], tb[""]


def alternate_parts(
    a: dict[str, Callable[[], None]], b: dict[str, Callable[[], None]], repeats: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Median ms of each part of a and of b over repeats turns: a turn runs all of one
    side's parts in order, then the other's, the first side alternating."""
    for side in (a, b):
        for fn in side.values():
            fn()
    times: tuple[dict, dict] = ({p: [] for p in a}, {p: [] for p in b})
    for i in range(repeats):
        order = ((a, times[0]), (b, times[1]))
        for side, out in order if i % 2 == 0 else order[::-1]:
            for part, fn in side.items():
                start = time.perf_counter()
                fn()
                out[part].append(time.perf_counter() - start)
    return tuple({p: 1000 * statistics.median(t) for p, t in side.items()} for side in times)
