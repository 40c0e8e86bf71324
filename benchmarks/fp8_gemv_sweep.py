"""The FP8 decode kernels' tiles swept on a GPU (model/backends/triton/fp8_gemv.py: the
one-row kernel on the CUDA cores, the tensor-core one for up to 16 rows), one row of
activations over the Llama-3.1-8B layer's projections and the 1B's gate|up, against
torch._scaled_mm and bf16 F.linear at the same shapes: µs and weight-read TB/s of each,
and each kind's best tile per shape. How ROW_TILE and DOT_TILE were chosen.

    PYTHONPATH=. python benchmarks/fp8_gemv_sweep.py --json out.json      # on a GPU
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from model.backends.fp8 import quantize_rows
from model.backends.triton.fp8_gemv import ROWS, _fp8_gemv_kernel, _fp8_gemv_row_kernel
from model.fp8 import quantize

# (N, K): q/k/v, o, gate|up, down of the 8B shape; then the 1B's gate|up
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (16384, 2048)]
DOT_TILES = list(itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (3, 4)))
ROW_TILES = list(itertools.product((4, 8, 16, 32, 64), (128, 256, 512, 1024), (2, 4, 8)))


def dot_launch(x, w, s, out, tile) -> Callable[[], None]:
    bn, bk, warps, stages = tile
    n, k = w.shape
    grid = (triton.cdiv(n, bn),)
    return lambda: _fp8_gemv_kernel[grid](
        x, w, s, s, out, 1, n, k, BLOCK_M=ROWS, BLOCK_N=bn, BLOCK_K=bk, HAS_BIAS=False,
        UPCAST=False, num_warps=warps, num_stages=stages,
    )  # fmt: skip


def row_launch(x, w, s, out, tile) -> Callable[[], None]:
    bn, bk, warps = tile
    n, k = w.shape
    grid = (triton.cdiv(n, bn),)
    return lambda: _fp8_gemv_row_kernel[grid](
        x, w, s, s, out, n, k, BLOCK_N=bn, BLOCK_K=bk, HAS_BIAS=False, num_warps=warps
    )


def sweep_shape(n: int, k: int) -> list[dict]:
    w, s = quantize(torch.randn(n, k, device="cuda") * 0.02)
    wb = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
    x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    xq, sx = quantize_rows(x)
    out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    runs = [("bf16 F.linear", "", 2 * n * k, lambda: F.linear(x, wb)),
            ("_scaled_mm", "", n * k, lambda: torch._scaled_mm(
                xq, w.t(), scale_a=sx, scale_b=s.t(), out_dtype=torch.bfloat16))]  # fmt: skip
    runs += [("dot", "/".join(map(str, t)), n * k, dot_launch(x, w, s, out, t)) for t in DOT_TILES]
    runs += [("one-row", "/".join(map(str, t)), n * k, row_launch(x, w, s, out, t)) for t in ROW_TILES]  # fmt: skip
    rows = []
    for kind, tile, nbytes, fn in runs:
        try:
            ms = do_bench(fn, warmup=3, rep=10)
        except Exception as exc:  # a tile that does not fit: noted, the sweep goes on
            print(f"N {n} K {k} {kind} {tile}: {type(exc).__name__}")
            continue
        rows.append(dict(n=n, k=k, kind=kind, cfg=tile, us=1000 * ms, tb_s=nbytes / ms / 1e9))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    rows: list[dict] = []
    for n, k in SHAPES:
        mine = sweep_shape(n, k)
        rows += mine
        for kind in ("bf16 F.linear", "_scaled_mm", "dot", "one-row"):
            best = min((r for r in mine if r["kind"] == kind), key=lambda r: r["us"], default=None)
            if best:
                print(f"N {n:6d} K {k:6d} {kind:14s} best {best['cfg']:12s} {best['us']:8.1f} us "
                      f"{best['tb_s']:6.2f} TB/s", flush=True)  # fmt: skip
        args.json.write_text(json.dumps(rows, indent=1))  # a run cut short keeps its shapes


if __name__ == "__main__":
    main()
