"""Measured physical limits of this machine: memory read bandwidth and matmul throughput.
They give the floors a model cannot beat here (decode: weight bytes / bandwidth;
prefill: 2 x parameters FLOPs per token / matmul throughput)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


def _best(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def memory_bandwidth(device: torch.device | str = "cpu", mib: int = 512, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s: the best of several full reductions over a large buffer."""
    x = torch.ones(mib * (1 << 20) // 4, dtype=torch.float32, device=device)
    seconds = _best(lambda: x.sum(), repeats)
    return x.numel() * 4 / seconds


def matmul_throughput(
    dtype: torch.dtype, device: torch.device | str = "cpu", n: int = 2048, repeats: int = 3
) -> float:
    """FLOP/s of an n x n x n matmul in `dtype` (the best of several)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    seconds = _best(lambda: a @ b, repeats)
    return 2 * n**3 / seconds


@dataclass(frozen=True, slots=True)
class Machine:
    device: str
    dtype: str
    bandwidth: float  # bytes/s
    matmul_flops: float  # FLOP/s

    @classmethod
    def measure(cls, dtype: torch.dtype, device: torch.device | str = "cpu") -> Machine:
        return cls(
            device=str(device),
            dtype=str(dtype).removeprefix("torch."),
            bandwidth=memory_bandwidth(device),
            matmul_flops=matmul_throughput(dtype, device),
        )
