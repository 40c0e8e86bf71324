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

from model.device import cpu_isa, isa_flags

log = logging.getLogger("kvserve.kernels")

HERE = Path(__file__).parent
HEADER = HERE / "kvserve.h"  # the prototypes and structs every kernel source includes
BASE_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fPIC"]
# Linked in a separate step without the math flags: linking with -ffast-math would add
# crtfastmath.o, whose constructor sets flush-to-zero for the whole process on load.
LINK_FLAGS = ["-shared", "-fopenmp"]
# The attention kernels use no infinities or NaNs (the running max starts at -1e30), so
# -ffast-math may vectorize their reductions and call glibc's vector expf.
ATTENTION_FLAGS = [*BASE_FLAGS, "-ffast-math"]
# The fused elementwise kernels keep IEEE semantics (a NaN stays a NaN) but may reorder sums.
FUSED_FLAGS = [
    *BASE_FLAGS,
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
]


_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
# q, k, v, tables, row_seq, lens, out; R, q_stride, KV, max_blocks; scale; alibi; nthreads
_ATTENTION = [_P] * 7 + [_I] * 4 + [_F, _P, _I]
# The ctypes mirror of kvserve.h's prototypes (result, arguments); a test checks it
# against the header.
PROTOTYPES: dict[str, tuple[type | None, list[type]]] = {
    **{f"add_rms_norm_{t}": (None, [_P, _P, _P, _P, _I, _I, _F, _I]) for t in ("f32", "bf16")},
    **{
        f"rope_store_{t}": (None, [_P, _P, _P, _I, _I, _I, _I, _P, _P, _P, _P, _I, _I])
        for t in ("f32", "bf16")
    },
    **{f"greedy_{t}": (None, [_P, _I, _I, _P, _I]) for t in ("f32", "bf16")},
    "paged_attention_f32": (None, _ATTENTION),
    "paged_attention_bf16": (None, _ATTENTION),
    "paged_attention_amx": (None, _ATTENTION),
    "paged_attention_amx_init": (_I, []),
    "linear_bf16_init": (_I, []),
    "linear_bf16": (None, [_P, _P, _P, _P, _P, _I, _I, _I, _I]),
    "linear_bf16_vec": (None, [_P, _P, _P, _P, _P, _I, _I, _I, _I]),
    "linear_int8": (None, [_P, _P, _P, _P, _P, _I, _I, _I, _I]),
    "linear_vec_init": (_I, []),
    "stack_forward": (None, [_P]),
}


def _bind(lib: ctypes.CDLL, *names: str) -> None:
    for name in names:
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = PROTOTYPES[name]


def _cache_dir() -> Path:
    default = Path.home() / ".cache" / "kvserve" / "kernels"
    return Path(os.environ.get("KVSERVE_KERNEL_CACHE", default))


def cpu_identity() -> str:
    """What -march=native compiles for: the CPU's model and feature flags. Part of every
    cached library's name, so a cache shared between machines (a mounted home or volume)
    never hands one CPU a library built for another (which would die with SIGILL)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    keys = ("vendor_id", "cpu family", "model", "model name", "flags")
    lines = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in keys and key.strip() not in lines:
            lines[key.strip()] = value.strip()
    return "|".join(f"{k}={lines.get(k, '')}" for k in keys)


@functools.cache
def _build(source: str, flags: tuple[str, ...], tag: str) -> ctypes.CDLL | None:
    """Compile HERE/source with flags once per machine and CPU (cached by hash) and load
    it; a cached library that does not load is built again once."""
    if os.environ.get("KVSERVE_DISABLE_KERNELS"):
        return None
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: %s runs as torch ops", source)
        return None
    path = HERE / source
    recipe = " ".join([*flags, "|", *LINK_FLAGS, "|", cpu_identity()]).encode()
    # the headers the sources include are part of what is built
    headers = b"".join(h.read_bytes() for h in sorted(HERE.glob("*.h")))
    digest = hashlib.sha256(path.read_bytes() + headers + recipe).hexdigest()[:16]
    target = _cache_dir() / f"{path.stem}-{tag}-{digest}.so"
    for attempt in (1, 2):
        if not target.exists() and not _compile(compiler, path, flags, target):
            return None
        try:
            return ctypes.CDLL(str(target))
        except OSError as exc:  # truncated or foreign: build it again, once
            log.warning("cached kernel %s does not load (%s): rebuilding", target, exc)
            if attempt == 1:
                target.unlink(missing_ok=True)
    log.warning("%s does not load after a rebuild, using torch ops", source)
    return None


def _compile(compiler: str, path: Path, flags: tuple[str, ...], target: Path) -> bool:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, out = Path(tmp) / f"{path.stem}.o", Path(tmp) / target.name
        for cmd in (
            [compiler, *flags, "-c", str(path), "-o", str(obj)],
            [compiler, *LINK_FLAGS, str(obj), "-o", str(out), "-lm"],
        ):
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                log.warning("building %s failed, using torch ops:\n%s", path.name, proc.stderr)
                return False
        os.replace(out, target)
    return True


def _library(head_dim: int, block_size: int, group: int) -> ctypes.CDLL | None:
    return _library_at(head_dim, block_size, group, cpu_isa())


@functools.cache
def _library_at(head_dim: int, block_size: int, group: int, isa: str) -> ctypes.CDLL | None:
    flags = (
        *ATTENTION_FLAGS,
        *isa_flags(isa),
        f"-DHEAD_DIM={head_dim}",
        f"-DBLOCK_SIZE={block_size}",
        f"-DGROUP={group}",
    )
    lib = _build("paged_attention.c", flags, f"d{head_dim}-bs{block_size}-g{group}-{isa}")
    if lib is None:
        return None
    _bind(
        lib,
        *_KERNELS.values(),
        "paged_attention_amx",
        "paged_attention_amx_init",
    )
    lib.amx = bool(lib.paged_attention_amx_init())  # built with AMX, and the OS allows it
    return lib


MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK_SIZE = 16, 256, 64
# the vector kernel for each cache dtype (bf16: bf16 queries and output, float32 inside)
_KERNELS = {torch.float32: "paged_attention_f32", torch.bfloat16: "paged_attention_bf16"}


def _is_power_of_two(n: int) -> bool:  # the kernel holds a block of scores in one vector
    return n > 0 and n & (n - 1) == 0


def paged_attention_supported(cache: torch.Tensor, n_heads: int, n_kv: int, d_head: int) -> bool:
    """`cache`: a layer's K pool, (num_blocks, KV, D / P, BS, P) as PagedKVCache lays it out."""
    return _attention_supported(
        cache.device.type, cache.dtype, cache.shape[-2], n_heads, n_kv, d_head, cpu_isa()
    )


@functools.cache  # asked once per layer and step: the answer depends on these alone
def _attention_supported(
    device: str,
    dtype: torch.dtype,
    block_size: int,
    n_heads: int,
    n_kv: int,
    d_head: int,
    isa: str,
) -> bool:
    return (
        device == "cpu"
        and dtype in _KERNELS
        and n_heads // n_kv <= MAX_GROUP
        and d_head <= MAX_HEAD_DIM
        and d_head % 2 == 0
        and 2 <= block_size <= MAX_BLOCK_SIZE
        and _is_power_of_two(block_size)
        and _library_at(d_head, block_size, n_heads // n_kv, isa) is not None
    )


def paged_attention(
    q: torch.Tensor,  # (R, H, D) any float dtype, one row per query token; rows may be
    # strided (a view of the fused qkv projection)
    k_cache: torch.Tensor,  # (num_blocks, KV, D / P, BS, P)
    v_cache: torch.Tensor,  # (num_blocks, KV, BS / P, D, P)
    block_tables: torch.Tensor,  # (B, max_blocks) int64, one per sequence
    lens: torch.Tensor,  # (R,) int64: keys each row sees (its position + 1)
    scale: float,
    alibi: torch.Tensor | None = None,  # (H,) float32
    row_seq: torch.Tensor | None = None,  # (R,) int64 sequence of each row; None: row r -> r
) -> torch.Tensor:
    """Attention of each query row over the first lens[row] cached tokens of its sequence
    (its own K/V must already be in the cache) -> (R, H, D) in the cache's dtype. bf16
    caches go to the tile unit at the amx level (model.device.cpu_isa), else vector code."""
    r, h, d = q.shape
    kv, block_size = k_cache.shape[1], k_cache.shape[-2]
    lib = _library(d, block_size, h // kv)
    assert lib is not None, "check paged_attention_supported() first"
    amx = k_cache.dtype == torch.bfloat16 and _amx_attention(lib, d, block_size)
    q = q.to(k_cache.dtype)  # bf16 caches take bf16 queries (and give bf16), fp32 fp32
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    out = torch.empty((r, h, d), dtype=q.dtype)
    rows = row_seq.contiguous() if row_seq is not None else None
    slopes = alibi.float().contiguous() if alibi is not None else None
    name = "paged_attention_amx" if amx else _KERNELS[k_cache.dtype]
    getattr(lib, name)(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.contiguous().data_ptr(),
        data_ptr(rows),
        lens.contiguous().data_ptr(),
        out.data_ptr(),
        r,
        q.stride(0),
        kv,
        block_tables.shape[1],
        scale,
        data_ptr(slopes),
        torch.get_num_threads(),
    )
    return out.to(k_cache.dtype)


AMX_BLOCK_SIZE = 16  # the AMX attention kernel's block: one 16 x 16 tile of scores


def attention_isa(d_head: int, block_size: int, group: int, dtype: torch.dtype) -> str:
    """Which code paged_attention runs for this shape and dtype here: 'amx' (tiles) or
    the vector code at the level the kernels are built for (model.device.cpu_isa)."""
    lib = _library(d_head, block_size, group)
    if lib is not None and dtype == torch.bfloat16 and _amx_attention(lib, d_head, block_size):
        return "amx"
    return vector_level()


def vector_level() -> str:
    """The vector code's level here: the CPU's (or KVSERVE_CPU_ISA's), AVX-512-BF16 on
    AMX CPUs (their vector kernels are the avx512-bf16 build)."""
    isa = cpu_isa()
    return "avx512-bf16" if isa == "amx" else isa


def _amx_attention(lib: ctypes.CDLL, d_head: int, block_size: int) -> bool:
    """Whether paged_attention_amx in `lib` runs bf16 attention of this shape."""
    return lib.amx and block_size == AMX_BLOCK_SIZE and d_head % 32 == 0


# ---- fused elementwise kernels (model/kernels/fused.c) ---------------------------------

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _fused() -> ctypes.CDLL | None:
    return _fused_at(cpu_isa())


@functools.cache
def _fused_at(isa: str) -> ctypes.CDLL | None:
    lib = _build("fused.c", (*FUSED_FLAGS, *isa_flags(isa)), isa)
    if lib is None:
        return None
    _bind(
        lib,
        *(f"{n}_{t}" for n in ("add_rms_norm", "rope_store", "greedy") for t in _SUFFIX.values()),
    )
    return lib


def fused_supported(x: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu" and x.dtype in _SUFFIX and x.is_contiguous() and _fused() is not None
    )


def data_ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's address for a kernel argument; None (NULL) for no tensor."""
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
        data_ptr(delta),
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
    cache: tuple[torch.Tensor, torch.Tensor] | None,  # K, V as PagedKVCache.layer() gives
    slot_blocks: torch.Tensor | None,
    slot_offsets: torch.Tensor | None,
) -> None:
    cos, sin = (rope[0].contiguous(), rope[1].contiguous()) if rope is not None else (None, None)
    k_cache, v_cache = cache if cache is not None else (None, None)
    block_size = k_cache.shape[-2] if k_cache is not None else 0
    getattr(_fused(), f"rope_store_{_SUFFIX[qkv.dtype]}")(
        qkv.data_ptr(),
        data_ptr(cos),
        data_ptr(sin),
        qkv.shape[0],
        n_heads,
        n_kv,
        d_head,
        data_ptr(k_cache),
        data_ptr(v_cache),
        data_ptr(slot_blocks),
        data_ptr(slot_offsets),
        block_size,
        torch.get_num_threads(),
    )


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """(B, V) logits (fused_supported) -> each row's first argmax, or -1 for a row whose
    maximum is not finite (a NaN or +inf in it, or nothing above -inf)."""
    rows, n = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    getattr(_fused(), f"greedy_{_SUFFIX[logits.dtype]}")(
        logits.data_ptr(), rows, n, out.data_ptr(), torch.get_num_threads()
    )
    return out.tolist()


# ---- linear layers: AMX tiles (linear_bf16.c), vector code (linear_vec.c) -------------

TILE_N, TILE_K = 64, 32  # the weight layout's feature block; k per tile
# linear_vec.c's float epilogue is the same arithmetic at every vector width; without
# -fno-trapping-math GCC kept the SwiGLU epilogue's clamp as a branch at AVX2 and left
# the loop scalar (benchmarks/RESULTS.md, round ten)
VECTOR_FLAGS = [*BASE_FLAGS, "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"]


@functools.cache
def _tiles() -> ctypes.CDLL | None:
    lib = _build("linear_bf16.c", tuple(BASE_FLAGS), "all")
    if lib is None:
        return None
    _bind(lib, "linear_bf16_init", "linear_bf16")
    if not lib.linear_bf16_init():  # built without AMX, or the OS refuses the tile state
        log.info("no AMX tiles here: bf16 linears run in vector code")
        return None
    return lib


@functools.cache
def _vector(isa: str) -> ctypes.CDLL | None:
    if isa == "baseline":  # below AVX2 + FMA: oneDNN's matmul instead
        return None
    lib = _build("linear_vec.c", (*VECTOR_FLAGS, *isa_flags(isa)), isa)
    if lib is None:
        return None
    _bind(lib, "linear_bf16_vec", "linear_int8", "linear_vec_init")
    if not lib.linear_vec_init():  # the amx build, where the OS refuses the tile state
        log.info("no AMX tiles here: int8 linears run in vector code")
        return None
    return lib


def linear_kernel(kind: str) -> ctypes._CFuncPtr | None:
    """The C function for 'bf16' (tile_layout weights) or 'int8' (int8_pack blobs)
    linears at this CPU's level (linear_isa): bf16 at amx in linear_bf16.c's tiles,
    everything else in linear_vec.c's build for the level; None where it is not built."""
    isa = linear_isa(kind)
    if kind == "bf16" and isa == "amx":
        return _tiles().linear_bf16
    lib = _vector(isa)
    if lib is None:
        return None
    return lib.linear_int8 if kind == "int8" else lib.linear_bf16_vec


def linear_isa(kind: str) -> str:
    """Which code linear_kernel(kind) runs: 'amx' where the level is amx and its build
    loads (bf16: linear_bf16.c's tiles; int8: linear_vec.c's amx build, on the tile unit
    from 8 rows, VNNI below), the vector level otherwise."""
    if cpu_isa() != "amx":
        return vector_level()
    tiles = _vector("amx") if kind == "int8" else _tiles()
    return "amx" if tiles is not None else vector_level()


def tile_linear_supported(weight: torch.Tensor) -> bool:
    n, k = weight.shape
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and n % TILE_N == 0
        and k % TILE_K == 0
        and linear_kernel("bf16") is not None
    )


def int8_supported(weight: torch.Tensor) -> bool:
    n, k = weight.shape
    return (
        weight.device.type == "cpu"
        and n % TILE_N == 0
        and k % 4 == 0
        and linear_kernel("int8") is not None
    )


def tile_layout(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) -> (N/64, K/2, 64, 2): the layout linear_bf16.c and linear_vec.c read."""
    n, k = weight.shape
    return weight.reshape(n // TILE_N, TILE_N, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def int8_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) -> int8 q (N, K) and float32 scales (N,): symmetric per output feature,
    q = round(w / s) with s = max|w| / 127 over the feature's K weights."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127
    q = torch.round(w / torch.where(scale > 0, scale, 1)[:, None]).clamp(-127, 127)
    return q.to(torch.int8), scale


def int8_pack(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) -> the uint8 blob linear_int8 reads: q in (N/64, K/4, 64, 4), then the N
    float32 scales, then N int32 values 128 * sum(q) (the VNNI path's offset)."""
    q, scale = int8_quantize(weight)
    n, k = q.shape
    blocks = q.reshape(n // TILE_N, TILE_N, k // 4, 4).permute(0, 2, 1, 3).contiguous()
    comp = (q.to(torch.int32).sum(dim=1) * 128).to(torch.int32)
    parts = [blocks.view(torch.uint8).flatten(), scale.view(torch.uint8), comp.view(torch.uint8)]
    return torch.cat(parts)


def swiglu_layout(weight: torch.Tensor) -> torch.Tensor:
    """Rows of a fused (gate | up) weight (2F, ...) or bias (2F,) reordered so that its
    64-row blocks alternate gate, up: the order tile_linear(swiglu=True) reads (F a
    multiple of 64)."""
    f = weight.shape[0] // 2
    blocks = weight.reshape(2, f // TILE_N, TILE_N, *weight.shape[1:]).transpose(0, 1)
    return blocks.reshape(weight.shape)


def tile_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    swiglu: bool = False,
    shape: tuple[int, int] | None = None,
) -> torch.Tensor:
    """x (..., K) bf16 @ W^T + bias -> (..., N) bf16; bias fp32 or None. W: in tile_layout
    (bf16), or an int8_pack blob of the given (N, K) `shape`. swiglu: W and bias are a
    SwiGLU's (gate | up) in swiglu_layout, and the result is silu(x @ Wg^T + bg) *
    (x @ Wu^T + bu), (..., N/2), in the same pass."""
    if shape is None:
        blocks, half_k, _, _ = weight.shape
        n, k = blocks * TILE_N, half_k * 2
    else:
        n, k = shape
    width = n // 2 if swiglu else n
    flat = x.reshape(-1, k).to(torch.bfloat16).contiguous()
    out = torch.empty((flat.shape[0], width), dtype=torch.bfloat16)
    if flat.shape[0]:
        scratch = torch.empty_like(out) if swiglu else None  # the rounded gate
        linear_kernel("bf16" if shape is None else "int8")(
            flat.data_ptr(),
            weight.data_ptr(),
            data_ptr(bias),
            out.data_ptr(),
            data_ptr(scratch),
            flat.shape[0],
            n,
            k,
            torch.get_num_threads(),
        )
    return out.view(*x.shape[:-1], width)


# ---- a decoder stack as one call (model/kernels/stack.c) -------------------------------


@functools.cache
def _stack() -> ctypes.CDLL | None:
    lib = _build("stack.c", tuple(BASE_FLAGS), "all")
    if lib is not None:
        _bind(lib, "stack_forward")
    return lib


def stack_kernels(d_head: int, block_size: int, group: int, kind: str) -> dict[str, int] | None:
    """Addresses of the kernels model/kernels/stack.c calls for a bf16 model whose
    attention has this shape and whose linears are all of `kind` ('bf16' or 'int8'), at
    this CPU's level; None unless all of them are built here."""
    attention, fused, linear = _library(d_head, block_size, group), _fused(), linear_kernel(kind)
    if attention is None or fused is None or linear is None or _stack() is None:
        return None
    amx = _amx_attention(attention, d_head, block_size)

    def address(fn: object) -> int:
        return ctypes.cast(fn, ctypes.c_void_p).value

    return {
        "norm": address(fused.add_rms_norm_bf16),
        "linear": address(linear),
        "rope": address(fused.rope_store_bf16),
        "attend": address(attention.paged_attention_amx if amx else attention.paged_attention_bf16),
    }


def stack_forward(args: ctypes.Structure) -> None:
    """Run model/kernels/stack.c on a filled-in stack_args (model/stack.py)."""
    _stack().stack_forward(ctypes.addressof(args))
