"""A mixture's routed experts on the GPU in two Triton launches (the triton backend's
prepare() puts TritonExperts in place of model/moe.py's Experts).

The step's (token, choice) pairs are sorted by expert and each expert's run padded to
a multiple of BLOCK_M rows, so that every tile of rows belongs to one expert (vLLM's
"aligned" layout): `sorted_pairs` lists pair ids tile by tile (padding is the id P, one
past the last pair) and `tile_experts` the expert of each tile (-1 for the tiles the
step does not fill). Then
- _experts_in_kernel: each tile gathers its tokens' rows and multiplies them by its
  expert's (gate | up) rows, biases and the activation (SwiGLU or gpt-oss's clamped
  one) in the epilogue, into one intermediate row per pair;
- _experts_out_kernel: each tile's intermediate rows by its expert's down projection,
  bias added and the pair's router weight applied in the epilogue, one output row per
  pair; the k choices of a token are summed after (in a fixed order, no atomics).

Either stack may be int4 (model/backends/int4.py's Int4Experts: `--quantization int4`, or
a checkpoint's 4-bit experts under `auto`): its tiles are widened from the codes in
registers as int4_linear.py's are, nothing dequantized in memory. Nothing is read on the
host: the layout is built by torch on the device with sizes
that depend on the step's token count alone (the most tiles any routing can need), so
a decode step is captured in a CUDA graph like a dense one. In the interpreter (no GPU)
the operands are widened to fp32, the weights rounded to the activations' dtype first as
the tensor cores take them (model/backends/triton/kernels.py says why).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor, nn

from model.backends.int4 import Int4Experts, Int4Stack
from model.backends.triton.int4_linear import _dequantized
from model.backends.triton.kernels import INTERPRET, _operand, _rounded
from model.moe import Experts, GroupedExperts

# columns and reduction step of a tile
BLOCK_N, BLOCK_K = 64, 64


def warps(bm: int) -> int:
    """Warps a program: twice as many for the larger tiles, whose two accumulators would
    spill from 4 warps' registers."""
    return 8 if bm > 16 else 4


def block_m(pairs: int, n_experts: int) -> int:
    """Rows a tile: 16 (the smallest tensor-core tile) while an expert meets a few rows
    a step, as in decode; 64 once the step's pairs fill tiles that size on average."""
    return 64 if pairs >= 64 * n_experts else 16


def aligned(ids: Tensor, n_experts: int, bm: int) -> tuple[Tensor, Tensor]:
    """ids (T, k) -> (sorted_pairs (tiles * bm,) int32, tile_experts (tiles,) int32), for
    as many tiles as any routing of T * k pairs can fill, on ids' device without a sync."""
    pairs = ids.numel()
    tiles = -(-(pairs + min(n_experts, pairs) * (bm - 1)) // bm)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + bm - 1) // bm * bm
    padded_end = torch.cumsum(padded, 0)
    run_start = torch.cumsum(counts, 0) - counts  # each expert's first place in `order`
    expert = flat[order]
    rank = torch.arange(pairs, device=ids.device) - run_start[expert]
    place = padded_end[expert] - padded[expert] + rank
    sorted_pairs = torch.full((tiles * bm,), pairs, dtype=torch.int32, device=ids.device)
    sorted_pairs.scatter_(0, place, order.to(torch.int32))
    tile_start = torch.arange(tiles, device=ids.device) * bm
    tile_experts = torch.searchsorted(padded_end, tile_start, right=True)
    tile_experts = torch.where(tile_experts < n_experts, tile_experts, -1).to(torch.int32)
    return sorted_pairs, tile_experts


@triton.jit
def _tile_pairs(pairs_ptr, tile, P, BLOCK_M: tl.constexpr):
    """A tile's pair ids and which of them are real (padding is P)."""
    pair = tl.load(pairs_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    return pair, pair < P


@triton.jit
def _activation(acc_g, acc_u, dtype: tl.constexpr, CLAMPED: tl.constexpr, ALPHA, LIMIT):
    """The gate and up projections' fp32 sums -> model/moe.py's gated(), rounded where
    torch rounds: silu(gate) * up, or gpt-oss's clamped (up + 1) * gate * sigmoid(alpha
    * gate)."""
    gate = _rounded(acc_g, dtype).to(tl.float32)  # the projections' outputs, as F.linear's
    up = _rounded(acc_u, dtype).to(tl.float32)
    if CLAMPED:
        gate = tl.minimum(gate, LIMIT)
        up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
        return (up + 1.0) * _rounded(gate * tl.sigmoid(gate * ALPHA), dtype).to(tl.float32)
    return _rounded(gate * tl.sigmoid(gate), dtype).to(tl.float32) * up


@triton.jit
def _expert_weights(w_rows, w_ptr, ws_ptr, wm_ptr, e, rows, n, n_ok, start, K,
                    BLOCK_K: tl.constexpr, INT4: tl.constexpr):  # fmt: skip
    """Expert e's weights (BLOCK_N, BLOCK_K) at rows n (of its `rows`), k from start, of
    a stack (E, rows, K): in its own dtype from w_rows (each row's first weight, the
    loop's invariant), or with INT4 in fp32 from the codes (E, rows, K / 2) at w_ptr and
    the steps and minimums (E, rows, K / 32) at ws_ptr, wm_ptr; zeros where masked."""
    if INT4:  # one branch a variant: Triton types an early return's fall-through too
        KG = K // 32
        at = e * rows * KG
        w = _dequantized(w_ptr + at * 16, ws_ptr + at, wm_ptr + at, n, n_ok, start // 32,
                         KG, BLOCK_K // 32)  # fmt: skip
    else:
        k = start + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
    return w


@triton.jit
def _experts_in_kernel(
    x_ptr,  # (T, d) the normed rows
    w_ptr,  # (E, 2F, d): gate rows, then up rows (with INT4: their codes)
    ws_ptr,  # with INT4: (E, 2F, d / 32) steps
    wm_ptr,  # with INT4: (E, 2F, d / 32) minimums
    b_ptr,  # (E, 2F), read when HAS_BIAS
    pairs_ptr,  # (tiles * BLOCK_M,) int32 pair ids, P: padding
    tile_experts_ptr,  # (tiles,) int32, -1: an empty tile
    h_ptr,  # (P, F) out: the activation, one row per pair
    P,
    d,
    F,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CLAMPED: tl.constexpr,
    ALPHA: tl.constexpr,
    LIMIT: tl.constexpr,
    UPCAST: tl.constexpr,
    INT4: tl.constexpr,
):
    tile = tl.program_id(0)
    e = tl.load(tile_experts_ptr + tile).to(tl.int64)
    if e < 0:
        return
    pair, row_ok = _tile_pairs(pairs_ptr, tile, P, BLOCK_M)
    token = (pair // TOP_K).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < F
    w_gate = w_ptr + e * (2 * F) * d + n[:, None].to(tl.int64) * d  # unread with INT4
    w_up = w_gate + F * d
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, d, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + token[:, None] * d + k[None, :],
                    mask=row_ok[:, None] & (k < d)[None, :], other=0.0)  # fmt: skip
        g = _expert_weights(w_gate, w_ptr, ws_ptr, wm_ptr, e, 2 * F, n, n_ok, start, d,
                            BLOCK_K, INT4)  # fmt: skip
        u = _expert_weights(w_up, w_ptr, ws_ptr, wm_ptr, e, 2 * F, n + F, n_ok, start, d,
                            BLOCK_K, INT4)  # fmt: skip
        if UPCAST:  # the tensor cores' operands, in fp32: the weights in a's dtype
            g, u = _operand(g, a.dtype), _operand(u, a.dtype)
            a = a.to(tl.float32)
            acc_g += tl.dot(a, tl.trans(g), input_precision="ieee")
            acc_u += tl.dot(a, tl.trans(u), input_precision="ieee")
        else:
            acc_g += tl.dot(a, tl.trans(g.to(a.dtype)))
            acc_u += tl.dot(a, tl.trans(u.to(a.dtype)))
    dtype = h_ptr.dtype.element_ty
    if HAS_BIAS:
        acc_g += tl.load(b_ptr + e * (2 * F) + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_ptr + e * (2 * F) + F + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    act = _activation(acc_g, acc_u, dtype, CLAMPED, ALPHA, LIMIT)
    out = h_ptr + pair[:, None].to(tl.int64) * F + n[None, :]
    tl.store(out, _rounded(act, dtype), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _experts_out_kernel(
    h_ptr,  # (P, F)
    w_ptr,  # (E, d, F) (with INT4: its codes)
    ws_ptr,  # with INT4: (E, d, F / 32) steps
    wm_ptr,  # with INT4: (E, d, F / 32) minimums
    b_ptr,  # (E, d), read when HAS_BIAS
    scale_ptr,  # (P,) each pair's router weight
    pairs_ptr,
    tile_experts_ptr,
    out_ptr,  # (P, d) out: weight * (h @ w.T + b), one row per pair
    P,
    d,
    F,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    INT4: tl.constexpr,
):
    tile = tl.program_id(0)
    e = tl.load(tile_experts_ptr + tile).to(tl.int64)
    if e < 0:
        return
    pair, row_ok = _tile_pairs(pairs_ptr, tile, P, BLOCK_M)
    rows = pair.to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < d
    w_rows = w_ptr + e * d * F + n[:, None].to(tl.int64) * F  # unread with INT4
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, F, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        a = tl.load(h_ptr + rows[:, None] * F + k[None, :],
                    mask=row_ok[:, None] & (k < F)[None, :], other=0.0)  # fmt: skip
        w = _expert_weights(w_rows, w_ptr, ws_ptr, wm_ptr, e, d, n, n_ok, start, F, BLOCK_K,
                            INT4)  # fmt: skip
        if UPCAST:  # the tensor cores' operands, in fp32: the weights in a's dtype
            w = _operand(w, a.dtype)
            acc += tl.dot(a.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(w.to(a.dtype)))
    if HAS_BIAS:
        acc += tl.load(b_ptr + e * d + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    y = _rounded(acc, dtype).to(tl.float32)  # the projection's output, as F.linear's
    weight = tl.load(scale_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    out = out_ptr + rows[:, None] * d + n[None, :]
    tl.store(out, _rounded(y * weight[:, None], dtype), mask=row_ok[:, None] & n_ok[None, :])


def _stack(w: Tensor | nn.Module) -> tuple[Tensor, Tensor, Tensor, bool]:
    """A stack's kernel operands: (weights or codes, steps, minimums, INT4); a stack in
    its own dtype passes its weights for the unread steps and minimums."""
    if isinstance(w, Int4Stack):
        return w.codes, w.steps, w.minimums, True
    return w, w, w, False


class TritonExperts(GroupedExperts):
    """model/moe.py's Experts, or model/backends/int4.py's Int4Experts (the same
    parameters and codes, shared), run by the two kernels."""

    def __init__(self, experts: Experts | Int4Experts) -> None:
        super().__init__()
        self.n_experts, self.d_ff, self.clamped = experts.n_experts, experts.d_ff, experts.clamped
        self.w_in, self.w_out = experts.w_in, experts.w_out
        self.b_in, self.b_out = experts.b_in, experts.b_out

    def forward(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        """x (T, d), weights and ids (T, k) -> sum over k of weight * expert(x), (T, d)."""
        t, top_k = ids.shape
        d, f, pairs = x.shape[1], self.d_ff, ids.numel()
        if pairs == 0:
            return torch.zeros_like(x)
        bm = block_m(pairs, self.n_experts)
        sorted_pairs, tile_experts = aligned(ids, self.n_experts, bm)
        x = x.contiguous()
        h = torch.empty(pairs, f, dtype=x.dtype, device=x.device)
        out = torch.empty(pairs, d, dtype=x.dtype, device=x.device)
        upcast = INTERPRET or x.dtype == torch.float32
        alpha, limit = self.clamped or (0.0, 0.0)
        tiles = tile_experts.numel()
        (w_in, s_in, m_in, int4_in), (w_out, s_out, m_out, int4_out) = map(
            _stack, (self.w_in, self.w_out)
        )
        b_in = self.b_in if self.b_in is not None else x
        b_out = self.b_out if self.b_out is not None else x
        _experts_in_kernel[(tiles, triton.cdiv(f, BLOCK_N))](
            x, w_in, s_in, m_in, b_in, sorted_pairs, tile_experts, h, pairs, d, f,
            TOP_K=top_k, BLOCK_M=bm, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            HAS_BIAS=self.b_in is not None, CLAMPED=self.clamped is not None, ALPHA=alpha,
            LIMIT=limit, UPCAST=upcast, INT4=int4_in, num_warps=warps(bm),
        )  # fmt: skip
        _experts_out_kernel[(tiles, triton.cdiv(d, BLOCK_N))](
            h, w_out, s_out, m_out, b_out, weights.contiguous(), sorted_pairs, tile_experts,
            out, pairs, d, f, BLOCK_M=bm, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            HAS_BIAS=self.b_out is not None, UPCAST=upcast, INT4=int4_out, num_warps=warps(bm),
        )  # fmt: skip
        return out.view(t, top_k, d).sum(dim=1)
