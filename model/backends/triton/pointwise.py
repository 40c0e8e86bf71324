"""Pointwise Triton kernels that fold a chain of torch's launches into one each (the
triton backend's prepare() hands them to the model, model/backends/triton/backend.py):

- silu_mul: SwiGLU's silu(gate) * up from the fused gate|up projection's output, one
  launch where torch takes a silu and a multiply (and the split's strided reads);
- quantize_rows_fp8: the per-token e4m3 activations and scales that an FP8 linear's
  torch._scaled_mm takes (model/backends/fp8.py), one launch where torch takes an abs,
  a max, a clamp, a division, another clamp and the cast.

Like kernels.py they run in Triton's interpreter where there is no GPU (TRITON_INTERPRET
set before import); the interpreter's casts to float8 are wrong, so quantize_rows_fp8 is
proved on CUDA alone (tests/engine/exec/test_gpu.py) and compiled for sm_90 on the CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.backends.triton.kernels import INTERPRET, _rounded
from model.fp8 import E4M3, E4M3_MAX

# rows per silu_mul program: one on a GPU; in the interpreter a program costs host time
# whatever its size (as NORM_ROWS)
GATE_ROWS = 64 if INTERPRET else 1
GATE_BLOCK = 1024  # columns per silu_mul program
QUANT_BLOCK = 2048  # columns per pass of a quantize_rows_fp8 program


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,  # (T, 2F): gate | up
    out_ptr,  # (T, F)
    n_rows,
    F: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # silu(gate) is rounded to the activations' dtype before the multiply, as torch's
    # F.silu(gate) * up rounds its intermediate
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = (r < n_rows)[:, None] & (c < F)[None, :]
    at = r[:, None] * (2 * F) + c[None, :]
    g = tl.load(gate_up_ptr + at, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gate_up_ptr + at + F, mask=ok, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    s = _rounded(g * tl.sigmoid(g), dtype).to(tl.float32)
    tl.store(out_ptr + r[:, None] * F + c[None, :], _rounded(s * u, dtype), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(..., 2F) gate | up -> silu(gate) * up, (..., F), in one launch."""
    two_f = gate_up.shape[-1]
    f = two_f // 2
    rows = gate_up.reshape(-1, two_f).contiguous()
    out = torch.empty(rows.shape[0], f, dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0]:
        grid = (triton.cdiv(rows.shape[0], GATE_ROWS), triton.cdiv(f, GATE_BLOCK))
        _silu_mul_kernel[grid](rows, out, rows.shape[0], F=f, ROWS=GATE_ROWS, BLOCK=GATE_BLOCK)
    return out.reshape(*gate_up.shape[:-1], f)


@triton.jit
def _quantize_rows_fp8_kernel(
    x_ptr,  # (T, K)
    q_ptr,  # (T, K) float8e4nv
    scale_ptr,  # (T,) float32
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    # one row a program, two passes over it (its largest magnitude, then the values):
    # scale = max(amax, 1e-12) / 448 and q = clamp(x / scale) to e4m3, rounded to
    # nearest even, with model/backends/fp8.py's torch reference's bits: torch divides a
    # tensor by a number as a multiply by its fp32 reciprocal, and one tensor by another
    # exactly (div_rn: Triton's own fp32 division is approximate)
    row = tl.program_id(0).to(tl.int64) * K
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, K, BLOCK):
        c = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row + c, mask=c < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    top = tl.maximum(tl.max(amax, axis=0), 1e-12)
    scale = top * (1.0 / FP8_MAX)
    tl.store(scale_ptr + tl.program_id(0), scale)
    for start in range(0, K, BLOCK):
        c = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row + c, mask=c < K, other=0.0).to(tl.float32)
        q = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + row + c, q.to(q_ptr.dtype.element_ty), mask=c < K)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, K) -> e4m3 values (T, K) and one float32 scale per row (T, 1), one launch:
    model/backends/fp8.py's quantize_rows."""
    x = x.contiguous()
    t, k = x.shape
    q = torch.empty(t, k, dtype=E4M3, device=x.device)
    scale = torch.empty(t, 1, dtype=torch.float32, device=x.device)
    if t:
        block = min(QUANT_BLOCK, triton.next_power_of_2(k))
        _quantize_rows_fp8_kernel[(t,)](
            x, q, scale, K=k, BLOCK=block, FP8_MAX=E4M3_MAX, num_warps=4 if block <= 1024 else 8
        )
    return q, scale
