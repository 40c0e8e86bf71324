"""Run-time choice of device and dtype: CUDA in bf16 when present, else the CPU (bf16
where it has AMX tiles, fp32 otherwise)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (empty where it does not)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(
        next((line.split() for line in text.splitlines() if line.startswith("flags")), [])
    )


def cpu_has_amx() -> bool:
    """Whether the CPU has the AMX tile unit with bf16 support."""
    return {"amx_tile", "amx_bf16"} <= cpu_flags()


def cpu_vector_isa() -> str:
    """The widest vector instruction set the C kernels' -march=native build uses here."""
    flags = cpu_flags()
    if "avx512_bf16" in flags:
        return "avx512-bf16"
    if "avx512f" in flags:
        return "avx512f"
    return "avx2" if "avx2" in flags else "baseline"


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' is bf16 on CUDA and on CPUs with AMX (about 3x fp32's throughput there,
    benchmarks/RESULTS.md), fp32 on other CPUs."""
    if name == "auto":
        bf16 = device.type == "cuda" or (device.type == "cpu" and cpu_has_amx())
        return torch.bfloat16 if bf16 else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {['auto', *DTYPES]}, got {name!r}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
