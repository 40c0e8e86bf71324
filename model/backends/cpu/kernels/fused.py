"""The fused elementwise kernels (model/backends/cpu/kernels/fused.c): add + RMSNorm, the norms
over q's and k's heads, RoPE with the KV-cache write, GeGLU, soft-capping and greedy argmax, in
float32 and bfloat16."""

from __future__ import annotations

import ctypes
import functools

import torch

from model.backends.cpu.isa import cpu_isa, isa_flags
from model.backends.cpu.kernels.build import BASE_FLAGS, bind, build, data_ptr

# The fused elementwise kernels keep IEEE semantics (a NaN stays a NaN) but may reorder sums.
FUSED_FLAGS = [
    *BASE_FLAGS,
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
]


_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_KERNELS = ("add_rms_norm", "qk_norm", "qk_norm_all", "rope_store", "geglu", "greedy", "softcap")


def fused_library() -> ctypes.CDLL | None:
    """fused.c built at this CPU's level; None where it cannot be built."""
    return _fused_at(cpu_isa())


@functools.cache
def _fused_at(isa: str) -> ctypes.CDLL | None:
    lib = build("fused.c", (*FUSED_FLAGS, *isa_flags(isa)), isa)
    if lib is None:
        return None
    bind(
        lib,
        *(f"{n}_{t}" for n in _KERNELS for t in _SUFFIX.values()),
    )
    return lib


def fused_supported(x: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype in _SUFFIX
        and x.is_contiguous()
        and fused_library() is not None
    )


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """x (rows, d) += delta in place (when given); returns weight * rmsnorm(x)."""
    rows, d = x.shape
    out = torch.empty_like(x)
    delta = delta.contiguous() if delta is not None else None
    fn = getattr(fused_library(), f"add_rms_norm_{_SUFFIX[x.dtype]}")
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
    getattr(fused_library(), f"rope_store_{_SUFFIX[qkv.dtype]}")(
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


def qk_norm(
    qkv: torch.Tensor,  # (T, (H + 2KV) * D), normed in place
    wq: torch.Tensor,
    wk: torch.Tensor,
    n_heads: int,
    n_kv: int,
    d_head: int,
    eps: float,
    whole: bool = False,
) -> None:
    """Each query and key head normed with wq and wk (D weights: Qwen3's), or, whole, all
    query heads as one vector and all key heads as one (H * D and KV * D: OLMo 2's)."""
    name = "qk_norm_all" if whole else "qk_norm"
    getattr(fused_library(), f"{name}_{_SUFFIX[qkv.dtype]}")(
        qkv.data_ptr(),
        wq.contiguous().data_ptr(),
        wk.contiguous().data_ptr(),
        qkv.shape[0],
        n_heads,
        n_kv,
        d_head,
        eps,
        torch.get_num_threads(),
    )


def softcap_(x: torch.Tensor, cap: float) -> torch.Tensor:
    """x (rows, n) (fused_supported) <- cap * tanh(x / cap), in place: Gemma 2's logits."""
    fn = getattr(fused_library(), f"softcap_{_SUFFIX[x.dtype]}")
    fn(x.data_ptr(), x.shape[0], x.shape[-1], cap, torch.get_num_threads())
    return x


def geglu(gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2 * ff) gate | up (fused_supported) -> (T, ff) gelu_tanh(gate) * up."""
    rows, ff = gate_up.shape[0], gate_up.shape[1] // 2
    gate_up = gate_up.contiguous()
    out = gate_up.new_empty((rows, ff))
    getattr(fused_library(), f"geglu_{_SUFFIX[gate_up.dtype]}")(
        gate_up.data_ptr(), out.data_ptr(), rows, ff, torch.get_num_threads()
    )
    return out


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """(B, V) logits (fused_supported) -> each row's first argmax, or -1 for a row whose
    maximum is not finite (a NaN or +inf in it, or nothing above -inf)."""
    rows, n = logits.shape
    # a ctypes array, not a tensor: a step's few ids, read back without a torch op (each
    # one costs tens of microseconds in a decode step, whose weights evict the caches)
    out = (ctypes.c_int64 * rows)()
    getattr(fused_library(), f"greedy_{_SUFFIX[logits.dtype]}")(
        logits.data_ptr(), rows, n, ctypes.addressof(out), torch.get_num_threads()
    )
    return list(out)
