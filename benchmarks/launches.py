"""A GPU step's kernels by class, from torch.profiler's device events: how many launches
and how much GPU time each class takes a step (gpu_decode.py's table; the GPU tests pin
the launches a decoder layer makes with it). Kernels replayed from a CUDA graph are
device events too, so a graph's step is counted kernel by kernel."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch

# (class, substrings of the kernel names it takes), first match wins: kvserve's Triton
# kernels by their names, cuBLAS/CUTLASS GEMMs by their families' names
CLASSES = (
    ("attention", ("paged_attention", "decode_split", "combine_splits")),
    ("norm", ("rms_norm",)),
    ("rope_store", ("rope_store",)),
    ("silu_mul", ("silu_mul",)),
    ("fp8_quant", ("quantize_rows",)),
    ("gemm", ("gemm", "gemv", "int4_", "cutlass", "xmma", "nvjet", "splitk", "cublas", "f8f8")),
    ("copy", ("memcpy", "memset")),
)


def classify(name: str) -> str:
    low = name.lower()
    return next((c for c, parts in CLASSES if any(p in low for p in parts)), "other")


def census(step: Callable[[], object], steps: int) -> dict:
    """Run step() `steps` times under the profiler -> per step: launches and GPU µs by
    class, their totals, and the kernel names of the class "other" (what a new fusion
    could take)."""
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    counts: Counter[str] = Counter()
    micros: Counter[str] = Counter()
    others: Counter[str] = Counter()
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        kind = classify(event.name)
        counts[kind] += 1
        micros[kind] += event.time_range.elapsed_us()
        if kind == "other":
            others[event.name[:80]] += 1
    return {
        "launches": {k: v / steps for k, v in sorted(counts.items())},
        "gpu_us": {k: v / steps for k, v in sorted(micros.items())},
        "launches_total": sum(counts.values()) / steps,
        "gpu_us_total": sum(micros.values()) / steps,
        "other_kernels": {k: v / steps for k, v in others.most_common(12)},
    }
