"""A decoder stack as one call (model/backends/cpu/kernels/stack.c): the addresses of the kernels it
calls, and the call."""

from __future__ import annotations

import ctypes
import functools

from model.backends.cpu.kernels.attention import amx_attention, attention_library
from model.backends.cpu.kernels.build import BASE_FLAGS, bind, build
from model.backends.cpu.kernels.experts import experts_library
from model.backends.cpu.kernels.fused import fused_library
from model.backends.cpu.kernels.linear import linear_kernel


@functools.cache
def _stack() -> ctypes.CDLL | None:
    lib = build("stack.c", tuple(BASE_FLAGS), "all")
    if lib is not None:
        bind(lib, "stack_forward")
    return lib


def stack_kernels(
    d_head: int,
    block_size: int,
    group: int,
    kinds: frozenset[str] = frozenset({"bf16"}),
    whole_qk_norm: bool = False,
    geglu: bool = False,
    experts: bool = False,
) -> dict[str, int | None] | None:
    """Addresses of the kernels model/backends/cpu/kernels/stack.c calls for a bf16 model whose
    attention has this shape, at this CPU's level (whole_qk_norm: OLMo 2's q/k norms over
    every head at once; geglu: Gemma's GeGLU after the (gate | up) linear; experts: a
    mixture of experts' routing and experts, experts.c); None unless all of them, and the
    linear kernel of each of `kinds` ('bf16', 'int8', 'int8g', 'int4', 'int5': the layers' linears hold
    them), are built here. The linears' kernels go in each layer's arguments
    (linear.linear_address)."""
    attention, fused = attention_library(d_head, block_size, group), fused_library()
    mixture = experts_library() if experts else None
    built = all(linear_kernel(kind) is not None for kind in kinds)
    if attention is None or fused is None or not built or _stack() is None:
        return None
    if experts and mixture is None:
        return None
    amx = amx_attention(attention, d_head, block_size)

    def address(fn: object) -> int:
        return ctypes.cast(fn, ctypes.c_void_p).value

    return {
        "norm": address(fused.add_rms_norm_bf16),
        "qk_norm": address(fused.qk_norm_all_bf16 if whole_qk_norm else fused.qk_norm_bf16),
        "rope": address(fused.rope_store_bf16),
        "attend": address(attention.paged_attention_amx if amx else attention.paged_attention_bf16),
        "geglu": address(fused.geglu_bf16) if geglu else None,
        "route": address(mixture.experts_route) if mixture is not None else None,
        "run_experts": address(mixture.experts_forward) if mixture is not None else None,
    }


def stack_forward(args: ctypes.Structure) -> None:
    """Run model/backends/cpu/kernels/stack.c on a filled-in stack_args (model/backends/cpu/stack.py)."""
    _stack().stack_forward(ctypes.addressof(args))
