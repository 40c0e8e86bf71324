"""bf16 linears of a whole SmolLM2-135M-shaped model, kvserve's kernel at this CPU's level
(AMX tiles, or the vector code of linear_vec.c) against oneDNN's prepacked matmul, at the
batch sizes the engine runs.

Every weight of the 30 layers (qkv 960x576, o 576x576, gate|up 3072x576, down 576x1536)
and the tied head (49152x576) is a separate random tensor, so each pass streams 270 MB
the way a decode step does, not a weight that sits in cache. kvserve runs gate|up as the
model does, one SwiGLU pass whose epilogue stores silu(gate) * up (oneDNN's pass is the
plain matmul). Times one pass (median of repeats) per row count, and next to it a plain
read of kvserve's weights (each viewed as float32 and summed by torch, call by call: the
bytes the pass must stream, the bandwidth one row's pass can at best reach). Prints a
table and writes JSON. With --quantization int8 kvserve's pass is its int8 linears
(int8_pack) and oneDNN's stays bf16.

    PYTHONPATH=. .venv/bin/python benchmarks/kernels/linear_kernels.py --rows 1 4 16 64 256 2048
    KVSERVE_CPU_ISA=avx512-bf16 PYTHONPATH=. .venv/bin/python benchmarks/kernels/linear_kernels.py --quantization int8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import OUT
from model.backends.cpu.isa import onednn_packs_bf16
from model.backends.cpu.kernels.linear import (
    int8_pack,
    linear_isa,
    swiglu_layout,
    tile_layout,
    tile_linear,
    tile_linear_supported,
)

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = (49152, 576)


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256, 2048])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--quantization", choices=["none", "int8"], default="none")
    ap.add_argument("--json", type=Path, default=OUT / "linear_kernels.json")
    args = ap.parse_args()
    probe = torch.empty(64, 32, dtype=torch.bfloat16)
    if not tile_linear_supported(probe):
        raise SystemExit("kvserve's bf16 linears are not built on this CPU: nothing to compare")

    torch.manual_seed(0)
    shapes = [s for _ in range(args.layers) for s in LAYER_SHAPES] + [HEAD]
    plain = [torch.randn(n, k).div_(k**0.5).to(torch.bfloat16) for n, k in shapes]
    gate_up = LAYER_SHAPES[2]
    int8 = args.quantization == "int8"
    kind = "int8" if int8 else "bf16"
    pack = int8_pack if int8 else tile_layout
    tiles = [pack(swiglu_layout(w) if w.shape == gate_up else w) for w in plain]
    # the reference: oneDNN's prepacked bf16 matmul, or torch's F.linear on a CPU where
    # oneDNN cannot pack bf16 (AVX2 only: model.backends.cpu.isa.onednn_packs_bf16)
    if onednn_packs_bf16():
        ref_name, refs = "oneDNN", [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in plain]

        def ref_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    else:
        ref_name, refs, ref_linear = "torch", plain, F.linear
    del plain
    flops_per_row = sum(2 * n * k for n, k in shapes)

    def tile_pass(xs) -> None:
        for x, w, shape in zip(xs, tiles, shapes, strict=True):
            tile_linear(x, w, None, swiglu=shape == gate_up, shape=shape if int8 else None)

    def ref_pass(xs) -> None:
        for x, w in zip(xs, refs, strict=True):
            ref_linear(x, w)

    words = [w.view(torch.float32) for w in tiles]  # every byte of the weights

    def read_pass() -> None:
        for w in words:
            w.sum()

    weight_bytes = sum(w.numel() * 4 for w in words)

    rows_out = []
    print(f"kvserve's {kind} kernel: {linear_isa(kind)}; threads {torch.get_num_threads()}")
    print(
        f"{'rows':>5} {'kvserve ms':>9} {ref_name + ' ms':>10} {'speed-up':>9} "
        f"{'kvserve TFLOP/s':>14} {'read ms':>8} {'kvserve GB/s':>12} {'read GB/s':>9}"
    )
    for m in args.rows:
        inputs = {k: torch.randn(m, k).to(torch.bfloat16) for k in {k for _, k in shapes}}
        xs = [inputs[k] for _, k in shapes]
        t_ms = median_ms(lambda xs=xs: tile_pass(xs), args.repeats)
        d_ms = median_ms(lambda xs=xs: ref_pass(xs), args.repeats)
        r_ms = median_ms(read_pass, args.repeats)
        tflops = m * flops_per_row / (t_ms / 1000) / 1e12
        gbs, read_gbs = weight_bytes / t_ms / 1e6, weight_bytes / r_ms / 1e6
        print(
            f"{m:5d} {t_ms:9.2f} {d_ms:10.2f} {d_ms / t_ms:8.2f}x {tflops:14.2f} "
            f"{r_ms:8.2f} {gbs:12.1f} {read_gbs:9.1f}"
        )
        rows_out.append({"rows": m, "kvserve_ms": t_ms, "reference_ms": d_ms, "read_ms": r_ms})
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "threads": torch.get_num_threads(),
                "weights": kind,
                "kernel": linear_isa(kind),
                "reference": ref_name,
                "weight_bytes": weight_bytes,
                "runs": rows_out,
            },
            indent=2,
        )
    )
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
