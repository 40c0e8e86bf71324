"""Run-time choice of device and dtype: CUDA in bf16 when present, else the CPU (bf16 where
kvserve's C kernels run, from AVX2 up; fp32 below)."""

from __future__ import annotations

import torch

from model.backends.cpu.isa import ISA_LEVELS, cpu_isa

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


def pick_dtype(name: str, device: torch.device, quantization: str = "none") -> torch.dtype:
    """'auto' is bf16 on CUDA, on CPUs where kvserve's bf16 kernels run (AVX2 and up:
    measured faster than fp32 at every level: docs/decisions.md) and for int8 weights
    (whose activations are
    bf16); fp32 on older CPUs."""
    if name == "auto":
        bf16 = (
            device.type == "cuda"
            or quantization not in ("none", "auto")
            or (device.type == "cpu" and cpu_isa() in ISA_LEVELS)
        )
        return torch.bfloat16 if bf16 else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {['auto', *DTYPES]}, got {name!r}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
