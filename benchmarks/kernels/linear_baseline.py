"""kvserve's linears against the same source at another commit, both built at this CPU's
level (or KVSERVE_CPU_ISA's) and loaded into one process, their calls alternating: the
vector code (model/backends/cpu/kernels/linear_vec.c), or at the amx level the bf16 tiles
(linear_bf16.c; int8 is linear_vec.c's amx build there too). A change to the kernel
measured without the drift between two runs minutes apart that a shared machine shows.

The weights are those of the 180M Llama-3-style checkpoint cpu_peers.py serves (30 layers
of qkv 960x576, o 576x576, gate|up 3072x576 as one SwiGLU pass, down 576x1536; the head
128256x576), each a separate random tensor, so a pass streams the weights from memory
the way a decode step does; they sit in one huge-page arena, as the engine's do
(model/backends/cpu/pages.py). Per row count, the median of --repeats turns for each build, a turn
being its layers' 120 linears and then its head, in a decode step's order; the two
builds take turns going first. A part timed alone over and over finds some of itself
still in L3 from its last pass, which a step never does (on a CPU with a large L3 the
head alone measured far faster than inside the engine's decode step: docs/decisions.md).
--kind int8 times the int8 linears (int8_pack's weights) instead. Prints a table and
writes JSON. Check a result against the same source at both ends (--baseline HEAD on a
clean tree): at 2,048 int8 rows on the AMX machine that check gave ratios of 0.82-1.01
(the build made first faster in four of five runs), where bf16 stayed within 0.5%.

    PYTHONPATH=. .venv/bin/python benchmarks/kernels/linear_baseline.py --baseline HEAD~1 --rows 1 16 256
"""

from __future__ import annotations

import argparse
import ctypes
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import OUT
from benchmarks.kernels.kernel_at import alternate_parts, library_at
from model.backends.cpu.isa import isa_flags
from model.backends.cpu.kernels.build import BASE_FLAGS, bind
from model.backends.cpu.kernels.linear import (
    VECTOR_FLAGS,
    int8_pack,
    linear_isa,
    linear_kernel,
    swiglu_layout,
    tile_layout,
)
from model.backends.cpu.pages import HugeArena

LAYER = [(960, 576, False), (576, 576, False), (3072, 576, True), (576, 1536, False)]
HEAD = (128256, 576, False)


def source_of(kind: str, level: str) -> str:
    """Where the `kind` linears at `level` are: linear_bf16.c's tiles for bf16 at amx, else
    linear_vec.c."""
    return "linear_bf16.c" if kind == "bf16" and level == "amx" else "linear_vec.c"


def build_at(rev: str, level: str, tmp: Path, kind: str) -> ctypes._CFuncPtr:
    """The `kind` linear as its source (source_of) and headers were at `rev`, built for
    `level`: linear_bf16, or linear_vec.c's linear_bf16_vec or linear_int8."""
    if source_of(kind, level) == "linear_bf16.c":
        lib = library_at(rev, "linear_bf16.c", BASE_FLAGS, tmp)
        bind(lib, "linear_bf16_init", "linear_bf16")
        if not lib.linear_bf16_init():
            raise SystemExit("the OS refuses the AMX tile state")
        return lib.linear_bf16
    lib = library_at(rev, "linear_vec.c", [*VECTOR_FLAGS, *isa_flags(level)], tmp)
    name = "linear_int8" if kind == "int8" else "linear_bf16_vec"
    bind(lib, name)
    return getattr(lib, name)


def passes(fn: ctypes._CFuncPtr, weights: list, shapes: list, m: int) -> Callable[[], None]:
    """One pass of fn over the weights at m rows (inputs and outputs made once)."""
    xs = {k: torch.randn(m, k).to(torch.bfloat16) for k in {k for _, k, _ in shapes}}
    outs = [
        torch.empty(m, n // 2 if swiglu else n, dtype=torch.bfloat16) for n, _, swiglu in shapes
    ]
    scratch = torch.empty(m, max(n // 2 for n, _, _ in shapes), dtype=torch.bfloat16)
    threads = torch.get_num_threads()
    calls = [
        (xs[k].data_ptr(), w.data_ptr(), o.data_ptr(), scratch.data_ptr() if sw else None, n, k)
        for w, o, (n, k, sw) in zip(weights, outs, shapes, strict=True)
    ]

    def run() -> None:
        for x, w, o, s, n, k in calls:
            fn(x, w, None, o, s, m, n, k, threads)

    run.keep = (xs, outs, scratch)  # the buffers live as long as the pass
    return run


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--baseline", required=True, help="the commit to compare with")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256, 2048])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--kind", choices=["bf16", "int8"], default="bf16", help="the weights")
    ap.add_argument("--json", type=Path, default=OUT / "linear_baseline.json")
    args = ap.parse_args()
    level = linear_isa(args.kind)
    now = linear_kernel(args.kind)
    if now is None:
        raise SystemExit("kvserve's vector linears are not built on this CPU")
    torch.manual_seed(0)
    layer_shapes = LAYER * 30
    weights = []
    for n, k, swiglu in [*layer_shapes, HEAD]:
        w = torch.randn(n, k).div_(k**0.5).to(torch.bfloat16)
        w = swiglu_layout(w) if swiglu else w
        weights.append(int8_pack(w) if args.kind == "int8" else tile_layout(w))
    arena = HugeArena(HugeArena.size_of(weights))  # where the engine puts them
    weights = [arena.take(w) for w in weights]
    parts = {"layers": (weights[:-1], layer_shapes), "head": (weights[-1:], [HEAD])}
    rows_out = []
    with tempfile.TemporaryDirectory() as tmp:
        base = build_at(args.baseline, level, Path(tmp), args.kind)
        print(f"{source_of(args.kind, level)} at {level}, {args.kind}, threads {torch.get_num_threads()}: "
              f"this tree against {args.baseline}")  # fmt: skip
        print(f"{'rows':>5} {'part':>6} {'now ms':>9} {'baseline ms':>12} {'now/baseline':>13}")
        for m in args.rows:
            t_now, t_base = alternate_parts(
                {part: passes(now, ws, shapes, m) for part, (ws, shapes) in parts.items()},
                {part: passes(base, ws, shapes, m) for part, (ws, shapes) in parts.items()},
                args.repeats,
            )
            for part in parts:
                now_ms, base_ms = t_now[part], t_base[part]
                print(f"{m:5d} {part:>6} {now_ms:9.2f} {base_ms:12.2f} {now_ms / base_ms:13.3f}")
                rows_out.append({"rows": m, "part": part, "now_ms": now_ms, "baseline_ms": base_ms})
    args.json.parent.mkdir(parents=True, exist_ok=True)
    report = {"level": level, "kind": args.kind, "baseline": args.baseline, "runs": rows_out}
    args.json.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
