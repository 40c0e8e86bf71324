"""CPU kernels in plain C, compiled once per machine with the system C compiler and
loaded with ctypes. Where no compiler is available the callers fall back to torch ops.

The build goes to $KVSERVE_KERNEL_CACHE (default ~/.cache/kvserve/kernels), named by a
hash of the source and flags, so a changed kernel is rebuilt and a built one is reused.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("kvserve.kernels")

SOURCE = Path(__file__).with_name("paged_decode.c")
# -ffast-math lets gcc vectorize the reductions and call glibc's vector expf; the kernel
# uses no infinities or NaNs (the running max starts at -1e30).
FLAGS = [
    "-O3",
    "-march=native",
    "-mprefer-vector-width=512",
    "-ffast-math",
    "-fopenmp",
    "-shared",
    "-fPIC",
]


def _cache_dir() -> Path:
    default = Path.home() / ".cache" / "kvserve" / "kernels"
    return Path(os.environ.get("KVSERVE_KERNEL_CACHE", default))


@functools.cache
def _library(head_dim: int, block_size: int, group: int) -> ctypes.CDLL | None:
    if os.environ.get("KVSERVE_DISABLE_KERNELS"):
        return None
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: paged decode attention uses the torch path")
        return None
    flags = [*FLAGS, f"-DHEAD_DIM={head_dim}", f"-DBLOCK_SIZE={block_size}", f"-DGROUP={group}"]
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    target = _cache_dir() / f"paged_decode-d{head_dim}-bs{block_size}-g{group}-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            proc = subprocess.run(
                [compiler, *flags, str(SOURCE), "-o", str(out), "-lm"],
                capture_output=True,
                text=True,
                check=False,
            )
            if proc.returncode != 0:
                log.warning(
                    "building %s failed, using the torch path:\n%s", SOURCE.name, proc.stderr
                )
                return None
            os.replace(out, target)
    lib = ctypes.CDLL(str(target))
    for name in ("paged_decode_f32", "paged_decode_bf16"):
        fn = getattr(lib, name)
        fn.restype = None
        # q, k, v, tables, lens, out; B, KV, max_blocks; scale; alibi; threads
        fn.argtypes = (
            [ctypes.c_void_p] * 6
            + [ctypes.c_int] * 3
            + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
        )
    return lib


MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK_SIZE = 16, 256, 64


def _is_power_of_two(n: int) -> bool:  # the kernel holds a block of scores in one vector
    return n > 0 and n & (n - 1) == 0


_KERNELS = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}


def paged_decode_supported(cache: torch.Tensor, n_heads: int, n_kv: int, d_head: int) -> bool:
    return (
        cache.device.type == "cpu"
        and cache.dtype in _KERNELS
        and n_heads // n_kv <= MAX_GROUP
        and d_head <= MAX_HEAD_DIM
        and cache.shape[-1] <= MAX_BLOCK_SIZE  # k blocks are (KV, D, BS)
        and _is_power_of_two(cache.shape[-1])
        and _library(d_head, cache.shape[-1], n_heads // n_kv) is not None
    )


def paged_decode(
    q: torch.Tensor,  # (B, H, D) any float dtype
    k_cache: torch.Tensor,  # (num_blocks, KV, D, BS)
    v_cache: torch.Tensor,  # (num_blocks, KV, BS, D)
    block_tables: torch.Tensor,  # (B, max_blocks) int64
    seq_lens: torch.Tensor,  # (B,) int64, including the new token
    scale: float,
    alibi: torch.Tensor | None = None,  # (H,) float32
) -> torch.Tensor:
    """Attention of one new token per sequence over its cached context -> (B, H, D) fp32."""
    b, h, d = q.shape
    lib = _library(d, k_cache.shape[-1], h // k_cache.shape[1])
    assert lib is not None, "check paged_decode_supported() first"
    q = q.float().contiguous()
    tables = block_tables.contiguous()
    lens = seq_lens.contiguous()
    out = torch.empty((b, h, d), dtype=torch.float32)
    slopes = alibi.float().contiguous() if alibi is not None else None
    getattr(lib, _KERNELS[k_cache.dtype])(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        lens.data_ptr(),
        out.data_ptr(),
        b,
        k_cache.shape[1],
        tables.shape[1],
        scale,
        slopes.data_ptr() if slopes is not None else None,
        torch.get_num_threads(),
    )
    return out
