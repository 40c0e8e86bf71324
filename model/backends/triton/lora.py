"""LoRA's deltas in Triton (model/adapters.py), gathered by each row's bank slot as
Punica's BGMV does: `shrink` takes low = x A[slot]^T (one program a row and a block of
ranks), `expand` adds low B[slot]^T to the linear's output in place (one program a row
and a block of outputs, reading the bank's blocked B). Sums are in fp32; the delta is
rounded to the output's dtype and added as torch adds two tensors of it, as the torch
reference does (the same bits but for the order of the sums). A row of slot -1 loads
and writes nothing. Unlike the reference's gather, nothing a row's size of the stacks is
copied."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.adapters import BLOCK
from model.backends.triton.kernels import _rounded

SHRINK_TILE = (16, 128)  # (ranks, input features) a program's step
EXPAND_TILE = 128  # outputs a program (whole bank blocks)


@triton.jit
def _shrink(x_ptr, a_ptr, slots_ptr, low_ptr, K, W, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """low[t, r] = sum_k A[slot_t, r, k] x[t, k] for this program's row and ranks."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t)
    live = slot >= 0
    base = tl.maximum(slot, 0) * W
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = (r < W) & live
    acc = tl.zeros((BLOCK_R,), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = (k < K) & live
        x = tl.load(x_ptr + t * K + k, mask=k_ok, other=0.0).to(tl.float32)
        at = (base + r[:, None]).to(tl.int64) * K + k[None, :]
        a = tl.load(a_ptr + at, mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(low_ptr + t * W + r, acc, mask=r_ok)


@triton.jit
def _expand(
    low_ptr, bt_ptr, slots_ptr, y_ptr, N, NB, W,
    BLOCK_O: tl.constexpr, BLOCK_W: tl.constexpr, BANK_BLOCK: tl.constexpr,
):  # fmt: skip
    """y[t, o] += round(sum_r low[t, r] B[slot_t, o, r]) for this program's row and
    outputs; B in the bank's blocks (slots, N / BANK_BLOCK, W, BANK_BLOCK)."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t)
    live = slot >= 0
    w = tl.arange(0, BLOCK_W)
    w_ok = (w < W) & live
    low = tl.load(low_ptr + t * W + w, mask=w_ok, other=0.0)
    o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    o_ok = (o < N) & live
    block = (tl.maximum(slot, 0) * NB + o // BANK_BLOCK).to(tl.int64)
    at = (block[None, :] * W + w[:, None]) * BANK_BLOCK + (o % BANK_BLOCK)[None, :]
    b = tl.load(bt_ptr + at, mask=w_ok[:, None] & o_ok[None, :], other=0.0).to(tl.float32)
    dtype = y_ptr.dtype.element_ty
    delta = _rounded(tl.sum(b * low[:, None], axis=0), dtype).to(tl.float32)
    y = tl.load(y_ptr + t * N + o, mask=o_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * N + o, _rounded(y + delta, dtype), mask=o_ok)


def lora_add(x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, slots: torch.Tensor,
             y: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """y (T, N) += each row's delta for x (T, K), the bank's stacks a (S, W, K) and bt
    (S, N / BLOCK, W, BLOCK), slots (T,); y, updated in place."""
    t, k = x.shape
    n, w = y.shape[1], a.shape[1]
    if t == 0:
        return y
    x, y = x.contiguous(), y.contiguous()
    low = torch.empty((t, w), dtype=torch.float32, device=x.device)
    block_r, block_k = SHRINK_TILE
    _shrink[(t, triton.cdiv(w, block_r))](x, a, slots, low, k, w, block_r, block_k)
    grid = (t, triton.cdiv(n, EXPAND_TILE))
    _expand[grid](low, bt, slots, y, n, bt.shape[1], w, EXPAND_TILE,
                  triton.next_power_of_2(w), BLOCK)  # fmt: skip
    return y
