"""A mixture of experts on the CPU (model/backends/cpu/kernels/experts.c): the routing
every CPU path of a bf16 model takes, and the routed experts as one call over packed
expert weights (its argument struct)."""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import Tensor

from model.backends.cpu.kernels.build import BASE_FLAGS, bind, build
from model.backends.cpu.kernels.linear import linear_address, linear_kernel

_P, _I = ctypes.c_void_p, ctypes.c_int


class ExpertsArgs(ctypes.Structure):
    _fields_ = [
        ("linear_in", _P),
        ("linear_out", _P),
        ("w_in", _P),
        ("w_out", _P),
        *[(name, _I) for name in ("experts", "top_k", "d", "ff", "rows", "nthreads")],
        *[
            (name, _P)
            for name in (
                "x",
                "ids",
                "weights",
                "out",
                "xs",
                "act",
                "gate",
                "ys",
                "order",
                "starts",
                "cursor",
            )
        ],
    ]


@functools.cache
def _experts() -> ctypes.CDLL | None:
    lib = build("experts.c", tuple(BASE_FLAGS), "all")
    if lib is not None:
        bind(lib, "experts_forward", "experts_route")
    return lib


def experts_library() -> ctypes.CDLL | None:
    """experts.c built for this machine, or None (no compiler, KVSERVE_DISABLE_KERNELS)."""
    return _experts()


def route(logits: Tensor, top_k: int, normalize: bool) -> tuple[Tensor, Tensor]:
    """model.moe.route's contract for bf16 logits (T, E), in C: the softmax over every
    expert at the top k by logit (ties to the lower id), renormalized where `normalize`;
    weights (T, k) bf16, ids (T, k) int64. The decoder stack routes the same way."""
    logits = logits.contiguous()
    rows, n = logits.shape
    ids = torch.empty((rows, top_k), dtype=torch.int64)
    weights = torch.empty((rows, top_k), dtype=torch.bfloat16)
    _experts().experts_route(
        logits.data_ptr(), rows, n, n, top_k, int(normalize), ids.data_ptr(), weights.data_ptr()
    )
    return weights, ids


class ExpertKernels:
    """Every expert's packed weights (gate | up in swiglu_layout, down plain; every
    expert's (gate | up) of one kind and its down of one, each a linear_kernel kind),
    as the pointer tables experts.c reads. The tensors must outlive this (PackedExperts
    holds them)."""

    def __init__(
        self, w_in: list[Tensor], w_out: list[Tensor], d: int, ff: int, kinds: tuple[str, str]
    ) -> None:
        n = len(w_in)
        self.d, self.ff, self.n = d, ff, n
        self.linear_in, self.linear_out = (linear_address(kind) for kind in kinds)
        self._w_in = (ctypes.c_void_p * n)(*(w.data_ptr() for w in w_in))
        self._w_out = (ctypes.c_void_p * n)(*(w.data_ptr() for w in w_out))

    @staticmethod
    def available(kinds: tuple[str, str]) -> bool:
        return _experts() is not None and all(linear_kernel(k) is not None for k in kinds)

    def forward(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        """x (T, d) bf16, weights (T, k) bf16 and ids (T, k) int64 -> (T, d) bf16."""
        x = x.contiguous()
        rows, top_k = ids.shape
        pairs, d, ff = rows * top_k, self.d, self.ff
        out = torch.empty_like(x)
        xs, ys = x.new_empty(pairs, d), x.new_empty(pairs, d)
        act, gate = x.new_empty(pairs, ff), x.new_empty(pairs, ff)
        order = torch.empty(pairs, dtype=torch.int32)
        starts = torch.empty(self.n + 1, dtype=torch.int32)
        cursor = torch.empty(self.n, dtype=torch.int32)
        ids, weights = ids.contiguous(), weights.to(torch.bfloat16).contiguous()
        args = ExpertsArgs(
            self.linear_in,
            self.linear_out,
            ctypes.addressof(self._w_in),
            ctypes.addressof(self._w_out),
            self.n,
            top_k,
            d,
            ff,
            rows,
            torch.get_num_threads(),
            *(
                t.data_ptr()
                for t in (x, ids, weights, out, xs, act, gate, ys, order, starts, cursor)
            ),
        )
        _experts().experts_forward(ctypes.addressof(args))
        return out
