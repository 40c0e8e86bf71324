"""The linear layers' kernels: bf16 on the AMX tile unit (model/backends/cpu/kernels/linear_bf16.c),
bf16, int8, int8g, int4 and int5 in vector code (linear_vec.c, whose amx build also takes int8 to
the tile unit), and the weight layouts they read."""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable

import torch

from model.backends.cpu.isa import cpu_isa, isa_flags
from model.backends.cpu.kernels.build import BASE_FLAGS, bind, build, data_ptr, vector_level
from model.grouped import (
    GROUP,
    INT4_SEARCH,
    INT4_STEPS,
    INT8G_DIVISORS,
    int4_quantize_reference,
    int5_quantize_reference,
    int8g_quantize_reference,
)

log = logging.getLogger("kvserve.kernels")

TILE_N, TILE_K = 64, 32  # the weight layout's feature block; k per tile
# linear_vec.c's float epilogue is the same arithmetic at every vector width; without
# -fno-trapping-math GCC kept the SwiGLU epilogue's clamp as a branch at AVX2 and left
# the loop scalar
VECTOR_FLAGS = [*BASE_FLAGS, "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"]


@functools.cache
def _tiles() -> ctypes.CDLL | None:
    lib = build("linear_bf16.c", tuple(BASE_FLAGS), "all")
    if lib is None:
        return None
    bind(lib, "linear_bf16_init", "linear_bf16")
    if not lib.linear_bf16_init():  # built without AMX, or the OS refuses the tile state
        log.info("no AMX tiles here: bf16 linears run in vector code")
        return None
    return lib


@functools.cache
def _vector(isa: str) -> ctypes.CDLL | None:
    if isa == "baseline":  # below AVX2 + FMA: oneDNN's matmul instead
        return None
    lib = build("linear_vec.c", (*VECTOR_FLAGS, *isa_flags(isa)), isa)
    if lib is None:
        return None
    kernels = ("linear_bf16_vec", "linear_int8", "linear_int8g", "linear_int4", "linear_int5")
    bind(lib, *kernels, "int4_quantize", "int5_quantize", "int8g_quantize", "linear_vec_init")
    if not lib.linear_vec_init():  # the amx build, where the OS refuses the tile state
        log.info("no AMX tiles here: int8 linears run in vector code")
        return None
    return lib


def linear_kernel(kind: str) -> ctypes._CFuncPtr | None:
    """The C function for 'bf16' (tile_layout weights), 'int8' (int8_pack blobs), 'int8g'
    (int8g_pack's), 'int4' (int4_pack's) or 'int5' (int5_pack's) linears at this CPU's level (linear_isa): bf16
    at amx in linear_bf16.c (the tiles, and for one or two rows vector code with the
    tiles' sums), everything else in linear_vec.c's build for the level; None where it
    is not built."""
    isa = linear_isa(kind)
    if kind == "bf16" and isa == "amx":
        return _tiles().linear_bf16
    lib = _vector(isa)
    if lib is None:
        return None
    integer = {"int8": lib.linear_int8, "int8g": lib.linear_int8g, "int4": lib.linear_int4,
               "int5": lib.linear_int5}  # fmt: skip
    return integer.get(kind, lib.linear_bf16_vec)


def linear_address(kind: str) -> int:
    """The address of linear_kernel(kind), for the C code that calls it through a pointer
    (stack.c, experts.c); the kernel must be built here."""
    fn = linear_kernel(kind)
    assert fn is not None, f"no {kind} linear kernel on this machine"
    return ctypes.cast(fn, ctypes.c_void_p).value


def linear_isa(kind: str) -> str:
    """Which code linear_kernel(kind) runs: 'amx' where the level is amx and its build
    loads (bf16: linear_bf16.c's tiles; int8: linear_vec.c's amx build, on the tile unit
    from 8 rows, VNNI below; int8g and int4: that build's VNNI code), the vector level
    otherwise."""
    if cpu_isa() != "amx":
        return vector_level()
    tiles = _vector("amx") if kind in ("int8", "int8g", "int4", "int5") else _tiles()
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


def grouped_supported(weight: torch.Tensor, kind: str) -> bool:
    """Whether `weight` packs for the grouped kernel `kind` ('int4', 'int5', 'int8g') here."""
    n, k = weight.shape
    return (
        weight.device.type == "cpu"
        and n % TILE_N == 0
        and k % GROUP == 0
        and linear_kernel(kind) is not None
    )


def int4_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """model.grouped's int4_quantize_reference in C (linear_vec.c's int4_quantize, threads
    over the groups, the same bits) where it is built, else that reference."""
    return _stepped(weight, "int4", int4_quantize_reference, INT4_SEARCH, len(INT4_STEPS))


def _stepped(
    weight: torch.Tensor,
    kind: str,
    reference: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    *params: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """linear_vec.c's `{kind}_quantize` (int4's or int5's) of `weight` (N, K): codes (N, K)
    uint8 and float16 steps and minimums (N, K/32), its `params` before the group count;
    `reference` where the C is not built."""
    lib = _vector(linear_isa(kind))
    if lib is None:
        return reference(weight)
    w = weight.detach().float().contiguous()
    n, k = w.shape
    q = torch.empty((n, k), dtype=torch.uint8)
    d = torch.empty((n, k // GROUP), dtype=torch.float16)
    m = torch.empty_like(d)
    getattr(lib, f"{kind}_quantize")(w.data_ptr(), q.data_ptr(), d.data_ptr(), m.data_ptr(),
                                     *params, n * k // GROUP, torch.get_num_threads())  # fmt: skip
    return q, d, m


def int4_pack(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) -> the uint8 blob linear_int4 reads, block after block of 64 features:
    (K/8, 64, 4) bytes (byte i of a feature's octet o: k = 8o + i in the low nibble,
    8o + 4 + i in the high one), then (K/32, 2, 64) float16, each group's d then m."""
    q, d, m = int4_quantize(weight)
    octets, nb = _octets(q)
    nibbles = (octets[..., 0] | (octets[..., 1] << 4)).contiguous()  # (nb, o, 64, 4)
    return torch.cat([nibbles.reshape(nb, -1), _block_scales(d, m, nb)], dim=1).flatten()


def int5_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """model.grouped's int5_quantize_reference in C (linear_vec.c's int5_quantize, threads
    over the groups, the same bits) where it is built, else that reference."""
    return _stepped(weight, "int5", int5_quantize_reference)


def int5_pack(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) -> the uint8 blob linear_int5 reads, block after block of 64 features: per
    octet of k, int4_pack's (64, 4) bytes of the codes' low nibbles, then two planes of
    32 bytes: bit p of the first is the fifth bit of the code in byte p's low nibble, of
    the second of its high nibble; then (K/32, 2, 64) float16, each group's d then m."""
    q, d, m = int5_quantize(weight)
    octets, nb = _octets(q)
    o = octets.shape[1]
    nibbles = ((octets[..., 0] & 15) | ((octets[..., 1] & 15) << 4)).reshape(nb, o, -1)
    fifth = (octets >> 4).reshape(nb, o, 4 * TILE_N, 2)  # (nb, o, byte, half)
    powers = 1 << torch.arange(8, dtype=torch.uint8)
    planes = [(fifth[..., h].reshape(nb, o, -1, 8) * powers).sum(-1).to(torch.uint8)
              for h in (0, 1)]  # fmt: skip
    octet_bytes = torch.cat([nibbles, *planes], dim=2).reshape(nb, -1)
    return torch.cat([octet_bytes, _block_scales(d, m, nb)], dim=1).flatten()


def _octets(q: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Codes (N, K) as int4_pack and int5_pack lay them out, (N/64, K/8, 64, 4, 2): per
    block and octet of k, each feature's byte i holding k = 8o + i and 8o + 4 + i; and
    the number of blocks."""
    n, k = q.shape
    nb = n // TILE_N
    return q.reshape(nb, TILE_N, k // 8, 2, 4).permute(0, 2, 1, 4, 3), nb


def _block_scales(d: torch.Tensor, m: torch.Tensor, nb: int) -> torch.Tensor:
    """Steps and minimums (N, K/32) as the blocks' bytes: (nb, K/32 * 2 * 64 * 2), each
    group's 64 steps then its 64 minimums."""
    scales = torch.stack([d, m], dim=2).reshape(nb, TILE_N, d.shape[1], 2)
    return scales.permute(0, 2, 3, 1).contiguous().view(torch.uint8).reshape(nb, -1)


def int8g_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """model.grouped's int8g_quantize_reference in C (linear_vec.c's int8g_quantize, the
    same bits) where it is built, else that reference."""
    lib = _vector(linear_isa("int8g"))
    if lib is None:
        return int8g_quantize_reference(weight)
    w = weight.detach().float().contiguous()
    n, k = w.shape
    q = torch.empty((n, k), dtype=torch.int8)
    d = torch.empty((n, k // GROUP), dtype=torch.float16)
    lib.int8g_quantize(w.data_ptr(), q.data_ptr(), d.data_ptr(), INT8G_DIVISORS,
                       n * k // GROUP, torch.get_num_threads())  # fmt: skip
    return q, d


def int8g_pack(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) -> the uint8 blob linear_int8g reads, block after block of 64 features: q in
    (K/4, 64, 4), then (K/32, 64) float16 d."""
    q, d = int8g_quantize(weight)
    n, k = q.shape
    nb = n // TILE_N
    quads = q.reshape(nb, TILE_N, k // 4, 4).permute(0, 2, 1, 3).contiguous()
    scales = d.reshape(nb, TILE_N, k // GROUP).permute(0, 2, 1).contiguous()
    per_block = [quads.view(torch.uint8).reshape(nb, -1), scales.view(torch.uint8).reshape(nb, -1)]
    return torch.cat(per_block, dim=1).flatten()


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
    kind: str = "int8",
) -> torch.Tensor:
    """x (..., K) bf16 @ W^T + bias -> (..., N) bf16; bias fp32 or None. W: in tile_layout
    (bf16), or with the (N, K) `shape` a blob of `kind` (int8_pack's or int4_pack's).
    swiglu: W and bias are a SwiGLU's (gate | up) in swiglu_layout, and the result is
    silu(x @ Wg^T + bg) * (x @ Wu^T + bu), (..., N/2), in the same pass."""
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
        linear_kernel("bf16" if shape is None else kind)(
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
