"""FP8 weights times a few rows of activations (a decode batch) in one Triton kernel:
the e4m3 weight tiles are read once, widened in registers and multiplied (one row on the
CUDA cores, two to sixteen on the tensor cores), the row scales applied at the end.
torch._scaled_mm's FP8 GEMMs are built for many rows: at a decode's few they read the
half-size weights slower than cuBLAS reads bf16's (docs/decisions.md).

The activations stay in bf16 (weight-only), so a decode's linears are the dequantized
weight's F.linear up to the order of the sums. In the interpreter (no GPU) the operands
are widened to fp32 first: its bf16 dot is wrong (model/backends/triton/kernels.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.backends.triton.kernels import INTERPRET, _store_row, _store_rows

ROWS = 16  # the most activation rows the kernels take (one tensor-core tile of rows)
# tiles (outputs a program, reduction step, warps[, stages]): the sweep's choice over
# Llama-3.1-8B's and -3.2-1B's projections (benchmarks/fp8_gemv_sweep.py; the numbers
# in docs/decisions.md)
ROW_TILE = (8, 1024, 8)
DOT_TILE = (32, 512, 4, 4)


@triton.jit
def _fp8_gemv_row_kernel(
    x_ptr,  # (K,) one row of activations
    w_ptr,  # (N, K) e4m3
    s_ptr,  # (N,) float32 row scales
    b_ptr,  # (N,) bias, read when HAS_BIAS
    out_ptr,  # (N,)
    N,
    K,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    # one row: products summed on the CUDA cores (a tensor-core tile would be 1/16 used)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(x_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(
            w_ptr + n[:, None].to(tl.int64) * K + k[None, :],
            mask=n_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    acc = acc * tl.load(s_ptr + n, mask=n_ok, other=0.0)
    _store_row(acc, b_ptr, out_ptr, n, n_ok, HAS_BIAS)


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,  # (M, K) activations
    w_ptr,  # (N, K) e4m3
    s_ptr,  # (N,) float32 row scales
    b_ptr,  # (N,) bias, read when HAS_BIAS
    out_ptr,  # (M, N)
    M,
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    n_ok = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(
            x_ptr + m[:, None] * K + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0
        )
        w = tl.load(
            w_ptr + n[:, None].to(tl.int64) * K + k[None, :],
            mask=n_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    acc = acc * tl.load(s_ptr + n, mask=n_ok, other=0.0)[None, :]
    _store_rows(acc, b_ptr, out_ptr, m, m_ok, n, n_ok, N, HAS_BIAS)


def fp8_gemv(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x (M <= ROWS, K) @ (weight (N, K) e4m3 * scale (N, 1)).T + bias -> (M, N) in x's
    dtype, one launch."""
    m, k = x.shape
    n = weight.shape[0]
    assert m <= ROWS, f"fp8_gemv takes at most {ROWS} rows, got {m}"
    x = x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    b = bias if bias is not None else scale
    if m == 1:
        bn, bk, warps = ROW_TILE
        _fp8_gemv_row_kernel[(triton.cdiv(n, bn),)](
            x, weight, scale, b, out, n, k, BLOCK_N=bn, BLOCK_K=bk, HAS_BIAS=bias is not None,
            num_warps=warps,
        )  # fmt: skip
        return out
    bn, bk, warps, stages = DOT_TILE
    _fp8_gemv_kernel[(triton.cdiv(n, bn),)](
        x, weight, scale, b, out, m, n, k, BLOCK_M=ROWS, BLOCK_N=bn, BLOCK_K=bk,
        HAS_BIAS=bias is not None, UPCAST=INTERPRET or x.dtype == torch.float32,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out
