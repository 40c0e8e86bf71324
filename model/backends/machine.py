"""Measured physical limits of this machine: memory read bandwidth and matmul throughput.
They give the floors a model cannot beat here (decode: weight bytes / bandwidth;
prefill: 2 x parameters FLOPs per token / matmul throughput)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from model.backends.cpu.isa import onednn_packs_bf16
from model.backends.cpu.pages import HugeArena


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
    """Read bandwidth in bytes/s: the best of several full reductions over a large buffer.
    On the CPU the buffer is in huge pages where the packed weights are (model/backends/cpu/pages.py):
    a probe in 4 KB pages read ~20% slower on an AVX2 Zen 3 and set a floor the weights'
    memory beats."""
    n = mib * (1 << 20) // 4
    if torch.device(device).type == "cpu":
        x = HugeArena(n * 4).empty((n,), torch.float32).fill_(1.0)
    else:
        x = torch.ones(n, dtype=torch.float32, device=device)
    seconds = _best(lambda: x.sum(), repeats)
    return x.numel() * 4 / seconds


def matmul_throughput(
    dtype: torch.dtype, device: torch.device | str = "cpu", n: int = 2048, repeats: int = 3
) -> float:
    """FLOP/s of the matmuls kvserve runs in `dtype`: an n x n x n torch matmul (the best
    of several) and, on the CPU in bf16, kvserve's linear kernel (bf16_kernel_rate), the
    better of the two. Not torch's bf16 matmul where oneDNN has no bf16 path on this CPU
    (model.backends.cpu.isa.onednn_packs_bf16): there it is a reference loop (1.3 GFLOP/s on an AMD
    EPYC Zen 3, tens of seconds at n = 2048) that kvserve's linears do not use."""
    kernel = 0.0
    if torch.device(device).type == "cpu" and dtype == torch.bfloat16:
        kernel = bf16_kernel_rate()
        if kernel and not onednn_packs_bf16():
            return kernel
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    seconds = _best(lambda: a @ b, repeats)
    return max(kernel, 2 * n**3 / seconds)


def bf16_kernel_rate(rows: int = 256) -> float:
    """FLOP/s of kvserve's bf16 linear kernel at the level it runs here: `rows` rows
    through a 1536 x 576 weight (the 180M checkpoint's gate | up) that stays in cache, the
    best of 5 runs of 8 calls (0.26 s on 2 AVX2 cores: the model card's probe runs on the
    engine's thread); 0.0 where the kernel does not run."""
    from model.backends.cpu.kernels.linear import tile_layout, tile_linear, tile_linear_supported

    w = torch.randn(1536, 576).to(torch.bfloat16)
    if not tile_linear_supported(w):
        return 0.0
    packed, x = tile_layout(w), torch.randn(rows, 576).to(torch.bfloat16)
    tile_linear(x, packed, None)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(8):
            tile_linear(x, packed, None)
        best = min(best, (time.perf_counter() - t0) / 8)
    return 2 * rows * 1536 * 576 / best


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
