"""int4 weights times bf16 activations (W4A16) in Triton: the weight's 4-bit codes and
its groups' steps and minimums (model/grouped.py, held by model/backends/int4.py) are
read once and widened in registers; nothing is dequantized in memory.

- one row (a single decode): per group, the sums of code * x and of x on the CUDA cores,
  then step * sum(code * x) + minimum * sum(x), so a weight costs an unpack and an fma;
- more rows (a decode batch, a prefill chunk): each program widens a tile of weights to
  the activations' dtype and multiplies it on the tensor cores, in one tile of ROWS rows
  up to ROWS rows and in GEMM_TILE's beyond. A weight is then rounded once to that dtype
  (bf16: within 2^-9 of step * code + minimum), as a bf16 checkpoint's weights are; the
  products are exact and summed in fp32.

Codes are stored two to a byte, k = 2j in byte j's low nibble and 2j + 1 in its high one,
so a group's 32 codes are 16 contiguous bytes (one 128-bit load). In the interpreter (no
GPU) the operands of a dot are widened to fp32 first, the weights rounded to the
activations' dtype on the way, as on the GPU: its bf16 dot is wrong there
(model/backends/triton/kernels.py). The tiles are first choices, not a GPU sweep's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.backends.triton.kernels import INTERPRET, _operand, _store_row, _store_rows
from model.grouped import GROUP

ROWS = 16  # up to this many activation rows: one tile of rows (DOT_TILE)
# (outputs a program, groups a reduction step, warps): one row; more rows up to ROWS
ROW_TILE = (16, 8, 4)
DOT_TILE = (32, 8, 4)
# beyond ROWS (a prefill): (rows, outputs, groups a step, warps, stages)
GEMM_TILE = (64, 128, 2, 8, 3)


@triton.jit
def _codes(q_ptr, d_ptr, m_ptr, n, n_ok, g, g_ok, KG):
    """The bytes (BLOCK_N, GB, 16) of groups g of rows n as int32, and their steps and
    minimums (BLOCK_N, GB) in fp32; zeros where masked."""
    ok = n_ok[:, None] & g_ok[None, :]
    at = n[:, None].to(tl.int64) * KG + g[None, :]  # each group's index
    i = tl.arange(0, 16)
    byte = tl.load(q_ptr + at[:, :, None] * 16 + i[None, None, :], mask=ok[:, :, None], other=0)
    d = tl.load(d_ptr + at, mask=ok, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + at, mask=ok, other=0.0).to(tl.float32)
    return byte.to(tl.int32), d, m


@triton.jit
def _dequantized(q_ptr, d_ptr, m_ptr, n, n_ok, g0, KG, GB: tl.constexpr):
    """The weights (BLOCK_N, GB * 32) in fp32 of rows n, groups g0 .. g0 + GB - 1, k in
    order; zeros where masked (a row past n_ok, a group past KG)."""
    g = g0 + tl.arange(0, GB)
    byte, d, m = _codes(q_ptr, d_ptr, m_ptr, n, n_ok, g, g < KG, KG)
    lo = (byte & 0xF).to(tl.float32) * d[:, :, None] + m[:, :, None]
    hi = (byte >> 4).to(tl.float32) * d[:, :, None] + m[:, :, None]
    return tl.reshape(tl.interleave(lo, hi), (n.shape[0], GB * 32))


@triton.jit
def _int4_row_kernel(
    x_ptr,  # (K,) one row of activations
    q_ptr,  # (N, K / 2) uint8 codes
    d_ptr,  # (N, K / 32) float16 steps
    m_ptr,  # (N, K / 32) float16 minimums
    b_ptr,  # (N,) bias, read when HAS_BIAS
    out_ptr,  # (N,)
    N,
    KG,  # groups a row: K / 32
    BLOCK_N: tl.constexpr,
    GB: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    i = tl.arange(0, 16)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, KG, GB):
        g = start + tl.arange(0, GB)
        g_ok = g < KG
        at = x_ptr + g[:, None] * 32 + 2 * i[None, :]
        xe = tl.load(at, mask=g_ok[:, None], other=0.0).to(tl.float32)  # k = 2j
        xo = tl.load(at + 1, mask=g_ok[:, None], other=0.0).to(tl.float32)  # k = 2j + 1
        byte, d, m = _codes(q_ptr, d_ptr, m_ptr, n, n_ok, g, g_ok, KG)
        lo = (byte & 0xF).to(tl.float32)
        hi = (byte >> 4).to(tl.float32)
        sums = tl.sum(lo * xe[None, :, :] + hi * xo[None, :, :], axis=2)  # (BLOCK_N, GB)
        acc += tl.sum(d * sums + m * tl.sum(xe + xo, axis=1)[None, :], axis=1)
    _store_row(acc, b_ptr, out_ptr, n, n_ok, HAS_BIAS)


@triton.jit
def _int4_dot_kernel(
    x_ptr,  # (M, K) activations
    q_ptr,  # (N, K / 2) uint8 codes
    d_ptr,  # (N, K / 32) float16 steps
    m_ptr,  # (N, K / 32) float16 minimums
    b_ptr,  # (N,) bias, read when HAS_BIAS
    out_ptr,  # (M, N)
    M,
    N,
    KG,  # groups a row: K / 32
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GB: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    m_row = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m_row < M
    n_ok = n < N
    K = KG * 32
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, KG, GB):
        k = start * 32 + tl.arange(0, GB * 32)
        x = tl.load(
            x_ptr + m_row[:, None].to(tl.int64) * K + k[None, :],
            mask=m_ok[:, None] & (k < K)[None, :],
            other=0.0,
        )
        w = _dequantized(q_ptr, d_ptr, m_ptr, n, n_ok, start, KG, GB)
        if UPCAST:  # the tensor cores' operands, in fp32: the weights in x's dtype
            w = _operand(w, x.dtype)
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    _store_rows(acc, b_ptr, out_ptr, m_row, m_ok, n, n_ok, N, HAS_BIAS)


def int4_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    steps: torch.Tensor,
    minimums: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x (M, K) @ W.T + bias -> (M, N) in x's dtype, one launch; W (N, K) is held as
    codes (N, K / 2) uint8 and steps and minimums (N, K / 32), w = step * code + minimum
    each group of 32 k."""
    rows, k = x.shape
    n = codes.shape[0]
    assert k % GROUP == 0 and codes.shape[1] * 2 == k, (x.shape, codes.shape)
    x = x.contiguous()
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    b = bias if bias is not None else steps
    has_bias = bias is not None
    groups = k // GROUP
    if rows == 1:
        bn, gb, warps = ROW_TILE
        _int4_row_kernel[(triton.cdiv(n, bn),)](
            x, codes, steps, minimums, b, out, n, groups, BLOCK_N=bn, GB=gb, HAS_BIAS=has_bias,
            num_warps=warps,
        )  # fmt: skip
        return out
    if rows <= ROWS:
        (bn, gb, warps), bm, stages = DOT_TILE, ROWS, 2
    else:
        bm, bn, gb, warps, stages = GEMM_TILE
    _int4_dot_kernel[(triton.cdiv(rows, bm), triton.cdiv(n, bn))](
        x, codes, steps, minimums, b, out, rows, n, groups, BLOCK_M=bm, BLOCK_N=bn, GB=gb,
        HAS_BIAS=has_bias, UPCAST=INTERPRET or x.dtype == torch.float32, num_warps=warps,
        num_stages=stages,
    )  # fmt: skip
    return out
