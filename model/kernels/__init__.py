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

HERE = Path(__file__).parent
BASE_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fPIC"]
# Linked in a separate step without the math flags: linking with -ffast-math would add
# crtfastmath.o, whose constructor sets flush-to-zero for the whole process on load.
LINK_FLAGS = ["-shared", "-fopenmp"]
# The decode kernel uses no infinities or NaNs (its running max starts at -1e30), so
# -ffast-math may vectorize its reductions and call glibc's vector expf.
DECODE_FLAGS = [*BASE_FLAGS, "-ffast-math"]
# The fused elementwise kernels keep IEEE semantics (a NaN stays a NaN) but may reorder sums.
FUSED_FLAGS = [
    *BASE_FLAGS,
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
]


def _cache_dir() -> Path:
    default = Path.home() / ".cache" / "kvserve" / "kernels"
    return Path(os.environ.get("KVSERVE_KERNEL_CACHE", default))


@functools.cache
def _build(source: str, flags: tuple[str, ...], tag: str) -> ctypes.CDLL | None:
    """Compile HERE/source with flags once per machine (cached by hash) and load it."""
    if os.environ.get("KVSERVE_DISABLE_KERNELS"):
        return None
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: %s runs as torch ops", source)
        return None
    path = HERE / source
    recipe = " ".join([*flags, "|", *LINK_FLAGS]).encode()
    digest = hashlib.sha256(path.read_bytes() + recipe).hexdigest()[:16]
    target = _cache_dir() / f"{path.stem}-{tag}-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            obj, out = Path(tmp) / f"{path.stem}.o", Path(tmp) / target.name
            for cmd in (
                [compiler, *flags, "-c", str(path), "-o", str(obj)],
                [compiler, *LINK_FLAGS, str(obj), "-o", str(out), "-lm"],
            ):
                proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
                if proc.returncode != 0:
                    log.warning("building %s failed, using torch ops:\n%s", source, proc.stderr)
                    return None
            os.replace(out, target)
    return ctypes.CDLL(str(target))


@functools.cache
def _library(head_dim: int, block_size: int, group: int) -> ctypes.CDLL | None:
    flags = (
        *DECODE_FLAGS,
        f"-DHEAD_DIM={head_dim}",
        f"-DBLOCK_SIZE={block_size}",
        f"-DGROUP={group}",
    )
    lib = _build("paged_decode.c", flags, f"d{head_dim}-bs{block_size}-g{group}")
    if lib is None:
        return None
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


# ---- fused elementwise kernels (model/kernels/fused.c) ---------------------------------

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


@functools.cache
def _fused() -> ctypes.CDLL | None:
    lib = _build("fused.c", tuple(FUSED_FLAGS), "all")
    if lib is None:
        return None
    for sfx in _SUFFIX.values():
        for name, args in (
            ("add_rms_norm", [_P, _P, _P, _P, _I, _I, _F, _I]),
            ("rope_store", [_P, _P, _P, _I, _I, _I, _I, _P, _P, _P, _P, _I, _I]),
        ):
            fn = getattr(lib, f"{name}_{sfx}")
            fn.restype, fn.argtypes = None, args
    return lib


def fused_supported(x: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu" and x.dtype in _SUFFIX and x.is_contiguous() and _fused() is not None
    )


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """x (rows, d) += delta in place (when given); returns weight * rmsnorm(x)."""
    rows, d = x.shape
    out = torch.empty_like(x)
    delta = delta.contiguous() if delta is not None else None
    fn = getattr(_fused(), f"add_rms_norm_{_SUFFIX[x.dtype]}")
    fn(
        x.data_ptr(),
        _ptr(delta),
        weight.contiguous().data_ptr(),
        out.data_ptr(),
        rows,
        d,
        eps,
        torch.get_num_threads(),
    )
    return out


def rope_store(
    qkv: torch.Tensor,  # (T, (H + 2KV) * D), rotated in place
    rope: tuple[torch.Tensor, torch.Tensor] | None,  # cos, sin (T, D) in qkv's dtype
    n_heads: int,
    n_kv: int,
    d_head: int,
    cache: tuple[torch.Tensor, torch.Tensor] | None,  # K (nb, KV, D, BS), V (nb, KV, BS, D)
    slot_blocks: torch.Tensor | None,
    slot_offsets: torch.Tensor | None,
) -> None:
    cos, sin = (rope[0].contiguous(), rope[1].contiguous()) if rope is not None else (None, None)
    k_cache, v_cache = cache if cache is not None else (None, None)
    block_size = k_cache.shape[-1] if k_cache is not None else 0
    getattr(_fused(), f"rope_store_{_SUFFIX[qkv.dtype]}")(
        qkv.data_ptr(),
        _ptr(cos),
        _ptr(sin),
        qkv.shape[0],
        n_heads,
        n_kv,
        d_head,
        _ptr(k_cache),
        _ptr(v_cache),
        _ptr(slot_blocks),
        _ptr(slot_offsets),
        block_size,
        torch.get_num_threads(),
    )


# ---- bf16 linear layers on AMX (model/kernels/linear_bf16.c) ---------------------------

TILE_N, TILE_K = 64, 32  # the weight layout's feature block; k per tile


@functools.cache
def _tiles() -> ctypes.CDLL | None:
    lib = _build("linear_bf16.c", tuple(BASE_FLAGS), "all")
    if lib is None:
        return None
    lib.linear_bf16_init.restype, lib.linear_bf16_init.argtypes = ctypes.c_int, []
    lib.linear_bf16.restype = None
    lib.linear_bf16.argtypes = [_P, _P, _P, _P, _I, _I, _I, _I]
    if not lib.linear_bf16_init():  # built without AMX, or the OS refuses the tile state
        log.info("no AMX tiles on this CPU: bf16 linears use oneDNN")
        return None
    return lib


def tile_linear_supported(weight: torch.Tensor) -> bool:
    n, k = weight.shape
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and n % TILE_N == 0
        and k % TILE_K == 0
        and _tiles() is not None
    )


def tile_layout(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) -> (N/64, K/2, 64, 2): the layout linear_bf16.c reads."""
    n, k = weight.shape
    return weight.reshape(n // TILE_N, TILE_N, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def tile_linear(x: torch.Tensor, tiles: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., K) bf16 @ W^T + bias -> (..., N) bf16, W in tile_layout; bias fp32 or None."""
    blocks, half_k, _, _ = tiles.shape
    n, k = blocks * TILE_N, half_k * 2
    flat = x.reshape(-1, k).contiguous()
    out = torch.empty((flat.shape[0], n), dtype=torch.bfloat16)
    if flat.shape[0]:
        _tiles().linear_bf16(
            flat.data_ptr(),
            tiles.data_ptr(),
            _ptr(bias),
            out.data_ptr(),
            flat.shape[0],
            n,
            k,
            torch.get_num_threads(),
        )
    return out.view(*x.shape[:-1], n)
