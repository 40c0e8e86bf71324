"""kvserve's Triton kernels for the GPU backend (model/backends/triton/backend.py): the
residual add + RMSNorm, RoPE + KV store, and paged attention (one pass, or split over
programs and merged for small decode batches).

They read the paged KV cache in the layout every GPU paged kernel reads: per layer
K and V of (num_blocks, block_size, KV, D). On a machine without a GPU they run in
Triton's interpreter (TRITON_INTERPRET=1, set before this module is imported), which is
how the tests prove them against the torch reference. Two interpreter catches shape the
code: `tl.dot` on bf16 operands is wrong there (UPCAST makes it fp32), and loads are not
bounds-checked (every load is masked).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _rope_store_kernel(
    qkv_ptr,  # (T, (H + 2KV) * D), rotated in place
    cos_ptr,  # (T, D) at each token's position (HF rotate-half layout)
    sin_ptr,
    k_cache_ptr,  # (NB, BS, KV, D)
    v_cache_ptr,
    slot_ptr,  # (T,) flat slot (block * BS + offset), -1: do not store
    n_tokens,
    stride_t,
    H: tl.constexpr,
    KV: tl.constexpr,
    D: tl.constexpr,
    HALF_PAD: tl.constexpr,
    ROWS: tl.constexpr,  # (token, head) rows per program
    HAS_ROPE: tl.constexpr,
    HAS_CACHE: tl.constexpr,
):
    # program p: rows p * ROWS ... of the (token, head) pairs over the query and key heads,
    # token-major, every lane a real row (a program may start or end inside a token); a
    # key head's row also stores its value head
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    t = r // (H + KV)
    head = (r % (H + KV)).to(tl.int32)
    row_ok = t < n_tokens
    half = D // 2
    i = tl.arange(0, HALF_PAD)
    m = row_ok[:, None] & (i < half)[None, :]
    row = (qkv_ptr + t.to(tl.int64) * stride_t + head * D)[:, None] + i[None, :]
    x1 = tl.load(row, mask=m, other=0.0)
    x2 = tl.load(row + half, mask=m, other=0.0)
    if HAS_ROPE:
        pos = (t * D)[:, None] + i[None, :]  # each row reads its token's angles
        c1 = tl.load(cos_ptr + pos, mask=m, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + pos + half, mask=m, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + pos, mask=m, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + pos + half, mask=m, other=0.0).to(tl.float32)
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        x1 = (f1 * c1 - f2 * s1).to(x1.dtype)
        x2 = (f2 * c2 + f1 * s2).to(x2.dtype)
        tl.store(row, x1, mask=m)
        tl.store(row + half, x2, mask=m)
    if HAS_CACHE:
        slot = tl.load(slot_ptr + t, mask=row_ok, other=-1).to(tl.int64)
        store = m & ((head >= H) & (slot >= 0))[:, None]  # key heads of stored tokens
        dst = (slot * (KV * D) + (head - H) * D)[:, None] + i[None, :]
        tl.store(k_cache_ptr + dst, x1, mask=store)
        tl.store(k_cache_ptr + dst + half, x2, mask=store)
        v_row = row + KV * D  # value head kv sits KV heads after key head kv
        tl.store(v_cache_ptr + dst, tl.load(v_row, mask=store, other=0.0), mask=store)
        tl.store(v_cache_ptr + dst + half, tl.load(v_row + half, mask=store, other=0.0), mask=store)


# rows ((token, head) pairs) per rope_store program
ROPE_ROWS = 64


def rope_store(
    qkv: torch.Tensor,  # (T, (H + 2KV) * D) contiguous, rotated in place
    rope: tuple[torch.Tensor, torch.Tensor] | None,  # cos, sin (T, D)
    n_heads: int,
    n_kv: int,
    d_head: int,
    cache: tuple[torch.Tensor, torch.Tensor] | None,  # K, V (NB, BS, KV, D)
    slot_mapping: torch.Tensor | None,  # (T,) int, -1 skips a row
) -> None:
    t = qkv.shape[0]
    if t == 0 or (rope is None and cache is None):
        return
    cos, sin = (rope[0].contiguous(), rope[1].contiguous()) if rope is not None else (qkv, qkv)
    k_cache, v_cache = cache if cache is not None else (qkv, qkv)
    _rope_store_kernel[(triton.cdiv(t * (n_heads + n_kv), ROPE_ROWS),)](
        qkv,
        cos,
        sin,
        k_cache,
        v_cache,
        slot_mapping if slot_mapping is not None else qkv,
        t,
        qkv.stride(0),
        H=n_heads,
        KV=n_kv,
        D=d_head,
        HALF_PAD=triton.next_power_of_2(d_head // 2),
        ROWS=ROPE_ROWS,
        HAS_ROPE=rope is not None,
        HAS_CACHE=cache is not None,
    )


@triton.jit
def _rounded(f, dtype: tl.constexpr):
    """fp32 -> dtype, to nearest even. bf16 is rounded by hand first (exact after): the
    interpreter's cast truncates, so the kernel gives the GPU's bits there too."""
    if dtype == tl.bfloat16:
        u = f.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        f = u.to(tl.float32, bitcast=True)
    return f.to(dtype)


@triton.jit
def _operand(f, dtype: tl.constexpr):
    """A tensor-core operand as the interpreter's fp32 dot takes it: f rounded to `dtype`
    (to nearest even, as the GPU's dot reads it in that dtype), widened back to fp32."""
    return _rounded(f.to(tl.float32), dtype).to(tl.float32)


@triton.jit
def _store_row(acc, b_ptr, out_ptr, n, n_ok, HAS_BIAS: tl.constexpr):
    """A linear's outputs n of one row: acc (fp32) plus the bias where HAS_BIAS, rounded
    to the output's dtype."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + n, _rounded(acc, out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _store_rows(acc, b_ptr, out_ptr, m, m_ok, n, n_ok, N, HAS_BIAS: tl.constexpr):
    """A linear's outputs (rows m, outputs n) of an (M, N) output: acc (fp32) plus the
    bias where HAS_BIAS, rounded to the output's dtype."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = _rounded(acc, out_ptr.dtype.element_ty)
    at = out_ptr + m[:, None].to(tl.int64) * N + n[None, :]
    tl.store(at, out, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,  # (T, D), x + delta written back in place
    delta_ptr,  # (T, D), read when HAS_DELTA
    w_ptr,  # (D,)
    out_ptr,  # (T, D)
    n_rows,
    eps,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    ROWS: tl.constexpr,  # rows per program (NORM_ROWS)
    HAS_DELTA: tl.constexpr,
):
    # program p: rows p * ROWS ... The sum is rounded to x's dtype before the norm reads
    # it, and the normalised row before the weight multiplies it (HF's RMSNorm; the cpu
    # backend's add_rms_norm): one pass instead of torch's add, upcast, norm, downcast
    # and scale
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    i = tl.arange(0, D_PAD)
    ok = (r < n_rows)[:, None] & (i < D)[None, :]
    at = r[:, None] * D + i[None, :]
    x = tl.load(x_ptr + at, mask=ok, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + at, mask=ok, other=0.0)
        x = _rounded(x.to(tl.float32) + d.to(tl.float32), x_ptr.dtype.element_ty)
        tl.store(x_ptr + at, x, mask=ok)
    f = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(f * f, 1) / D + eps)
    normed = _rounded(f * inv[:, None], x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + i, mask=i < D, other=0.0).to(tl.float32)
    tl.store(out_ptr + at, _rounded(w[None, :] * normed, out_ptr.dtype.element_ty), mask=ok)


# rows per add_rms_norm program: one on a GPU (a row is a program's worth there); in the
# interpreter a program costs host time whatever its size, so 64 (the suite's Triton
# tests near their time with torch's norm)
NORM_ROWS = 64 if INTERPRET else 1


def norm_warps(d: int) -> int:
    """Warps of an add_rms_norm program over rows of d."""
    return 4 if d <= 2048 else 8


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """x (T, D) contiguous += delta in place (when given); returns weight * rmsnorm(x) in
    x's dtype, one launch for the batch."""
    t, d = x.shape
    out = torch.empty_like(x)
    if t == 0:
        return out
    _add_rms_norm_kernel[(triton.cdiv(t, NORM_ROWS),)](
        x,
        delta.contiguous() if delta is not None else x,
        weight,
        out,
        t,
        eps,
        D=d,
        D_PAD=triton.next_power_of_2(d),
        ROWS=NORM_ROWS,
        HAS_DELTA=delta is not None,
        num_warps=norm_warps(d),
    )
    return out


@triton.jit
def _attend_tile(
    acc,  # (rows, D_PAD) fp32: the running sum of p.v
    m_i,  # (rows,) running max of the scores
    l_i,  # (rows,) running sum of exp(score - max)
    q,  # (rows, D_PAD)
    q_pos,  # (rows,) position of each query row: it sees keys at positions <= it
    slope,  # (rows,) ALiBi slope of each row's head (read when HAS_ALIBI)
    j,  # which tile of the sequence's keys
    table_ptr,  # the sequence's block table
    k_cache_ptr,
    v_cache_ptr,
    seq_len,
    kv,
    scale,
    window,  # keys each query sees at most, read when WINDOWED
    k_lo,  # the first key any row sees: those before it are not read (WINDOWED)
    softcap,  # scores become softcap * tanh(score / softcap), read when SOFTCAP
    d,
    d_ok,
    KV: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    TILE: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One tile of TILE keys (TILE / BS blocks of the table, each key finding its own)
    into an online softmax (fp32): returns acc, m_i, l_i updated. Under a sliding window a
    row may see no key of a tile: its max stays -inf and the tile adds nothing."""
    k_pos = j * TILE + tl.arange(0, TILE)
    k_ok = k_pos < seq_len
    if WINDOWED:  # their blocks may be freed: 0 * NaN would reach the output
        k_ok = k_ok & (k_pos >= k_lo)
    block = tl.load(table_ptr + k_pos // BS, mask=k_ok, other=0).to(tl.int64)
    kv_rows = (block * BS + k_pos % BS) * (KV * D) + kv * D
    kv_mask = k_ok[:, None] & d_ok[None, :]
    k = tl.load(k_cache_ptr + kv_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + kv_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (rows, TILE) fp32
    if SOFTCAP:  # Gemma 2: cap * tanh(s / cap), tanh(y) = 2 / (1 + exp(-2y)) - 1
        s = softcap * (2.0 / (1.0 + tl.exp(-2.0 * s / softcap)) - 1.0)
    if HAS_ALIBI:
        s += slope[:, None] * (k_pos[None, :] - q_pos[:, None]).to(tl.float32)
    visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
    if WINDOWED:
        visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if WINDOWED:  # a row with no key yet: exp(-inf - 0) = 0, not exp(-inf + inf)
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if UPCAST:
        acc += tl.dot(p, v, input_precision=PRECISION)
    else:
        acc += tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # (T, H, D), rows may be strided
    k_cache_ptr,  # (NB, BS, KV, D)
    v_cache_ptr,
    out_ptr,  # (T, H, D) contiguous
    block_tables_ptr,  # (B, W) int32
    seq_lens_ptr,  # (B,) int32: keys of each sequence after this step (cached + new)
    query_start_ptr,  # (B + 1,) int32: first row of each sequence
    alibi_ptr,  # (H,) fp32
    sinks_ptr,  # (H,) fp32: gpt-oss's logit per head beside the scores, read when SINKS
    scale,
    window,  # a sliding window's keys, read when WINDOWED
    softcap,  # Gemma 2's score cap, read when SOFTCAP
    stride_qt,
    stride_qh,
    stride_bt,
    G: tl.constexpr,  # query heads per K/V head
    KV: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BS: tl.constexpr,
    TILE: tl.constexpr,  # keys per step of the online softmax
    BLOCK_G: tl.constexpr,  # G padded to a power of two
    BLOCK_Q: tl.constexpr,  # query tokens per program; BLOCK_Q * BLOCK_G rows
    HAS_ALIBI: tl.constexpr,
    WINDOWED: tl.constexpr,  # each query sees the last `window` keys up to its own
    SOFTCAP: tl.constexpr,  # soft-capped scores (Gemma 2)
    SINKS: tl.constexpr,  # a sink logit per head in each softmax (gpt-oss)
    UPCAST: tl.constexpr,  # dot products in fp32 (the interpreter's bf16 dot is wrong)
    PRECISION: tl.constexpr,  # "ieee" for fp32 operands (no TF32), else the default
):
    # program (b, qb, kv): query tokens qb * BLOCK_Q ... of sequence b, with the G query
    # heads that share K/V head kv packed into the rows; causality from positions
    b = tl.program_id(0)
    qb = tl.program_id(1)
    kv = tl.program_id(2)
    q_start = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    if qb * BLOCK_Q < q_len:
        cached = seq_len - q_len
        rows = tl.arange(0, BLOCK_Q * BLOCK_G)
        tok = qb * BLOCK_Q + rows // BLOCK_G  # query token within the sequence
        g = rows % BLOCK_G
        row_ok = (tok < q_len) & (g < G)
        head = kv * G + g
        q_pos = cached + tl.minimum(tok, q_len - 1)  # padded rows see what the last does
        d = tl.arange(0, D_PAD)
        d_ok = d < D
        q_rows = (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh
        q = tl.load(
            q_ptr + q_rows[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0
        )
        if UPCAST:
            q = q.to(tl.float32)
        slope = tl.zeros([BLOCK_Q * BLOCK_G], tl.float32)
        if HAS_ALIBI:
            slope = tl.load(alibi_ptr + head, mask=row_ok, other=0.0)
        m_i = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_Q * BLOCK_G, D_PAD], tl.float32)
        last = tl.minimum(seq_len, cached + tl.minimum((qb + 1) * BLOCK_Q, q_len))
        table = block_tables_ptr + b.to(tl.int64) * stride_bt
        k_lo = 0
        if WINDOWED:  # keys before the window of the program's first row: not read
            k_lo = tl.maximum(cached + qb * BLOCK_Q - window + 1, 0)
        for j in range(k_lo // TILE, tl.cdiv(last, TILE)):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, q_pos, slope, j, table, k_cache_ptr, v_cache_ptr, seq_len,
                kv, scale, window, k_lo, softcap, d, d_ok, KV, D, BS, TILE, HAS_ALIBI, WINDOWED,
                SOFTCAP, UPCAST, PRECISION,
            )  # fmt: skip
        if SINKS:  # the sink joins the softmax's sum, attending nothing
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0)
            m_sink = tl.maximum(m_i, sink)
            kept = tl.exp(m_i - m_sink)
            acc = acc * kept[:, None]
            l_i = l_i * kept + tl.exp(sink - m_sink)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_rows = (q_start + tok).to(tl.int64) * (KV * G * D) + head * D
        tl.store(
            out_ptr + o_rows[:, None] + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


@triton.jit
def _decode_split_kernel(
    q_ptr,  # (B, H, D): one decode row per sequence
    k_cache_ptr,  # (NB, BS, KV, D)
    v_cache_ptr,
    part_ptr,  # (B, SPLITS, H, D) fp32: each split's normalized output
    lse_ptr,  # (B, SPLITS, H) fp32: each split's log-sum-exp (-inf: no keys)
    block_tables_ptr,
    seq_lens_ptr,
    alibi_ptr,
    scale,
    window,
    softcap,
    stride_qt,
    stride_qh,
    stride_bt,
    G: tl.constexpr,
    KV: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BS: tl.constexpr,
    TILE: tl.constexpr,
    BLOCK_G: tl.constexpr,  # rows per program: G padded (at least 16 for tl.dot)
    SPLITS: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # flash-decoding: program (b, split, kv) attends sequence b's decode row over one
    # contiguous share of its key tiles; _combine_splits_kernel merges the shares
    b = tl.program_id(0)
    split = tl.program_id(1)
    kv = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    k_lo = 0
    if WINDOWED:  # the keys before the window: not read, their tiles not shared out
        k_lo = tl.maximum(seq_len - window, 0)
    start = k_lo // TILE
    n_tiles = tl.cdiv(seq_len, TILE) - start
    per = tl.cdiv(n_tiles, SPLITS)
    first = start + split * per
    last = tl.minimum(first + per, start + n_tiles)
    g = tl.arange(0, BLOCK_G)
    row_ok = g < G
    head = kv * G + g
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    q_rows = b.to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(
        q_ptr + q_rows[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0
    )
    if UPCAST:
        q = q.to(tl.float32)
    slope = tl.zeros([BLOCK_G], tl.float32)
    if HAS_ALIBI:
        slope = tl.load(alibi_ptr + head, mask=row_ok, other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D_PAD], tl.float32)
    q_pos = tl.zeros([BLOCK_G], tl.int32) + (seq_len - 1)  # the decode row sees every key
    table = block_tables_ptr + b.to(tl.int64) * stride_bt
    for j in range(first, last):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, q_pos, slope, j, table, k_cache_ptr, v_cache_ptr, seq_len,
            kv, scale, window, k_lo, softcap, d, d_ok, KV, D, BS, TILE, HAS_ALIBI, WINDOWED,
            SOFTCAP, UPCAST, PRECISION,
        )  # fmt: skip
    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    base = (b.to(tl.int64) * SPLITS + split) * (KV * G) + head
    tl.store(part_ptr + base[:, None] * D + d[None, :], out, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + base, lse, mask=row_ok)


@triton.jit
def _combine_splits_kernel(
    part_ptr,  # (B, SPLITS, H, D) fp32
    lse_ptr,  # (B, SPLITS, H) fp32
    out_ptr,  # (B, H, D)
    sinks_ptr,  # (H,) fp32, read when SINKS: a share of the softmax with no values
    H: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS_PAD)
    sp_ok = sp < SPLITS
    rows = (b.to(tl.int64) * SPLITS + sp) * H + h
    lse = tl.load(lse_ptr + rows, mask=sp_ok, other=float("-inf"))
    sink = tl.full([], float("-inf"), tl.float32)  # none: its share is exp(-inf) = 0
    if SINKS:
        sink = tl.load(sinks_ptr + h)
    top = tl.maximum(tl.max(lse, 0), sink)
    top = tl.where(top > float("-inf"), top, 0.0)  # no share had keys: every weight is 0
    w = tl.exp(lse - top)
    total = tl.sum(w, 0) + tl.exp(sink - top)
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    part = tl.load(
        part_ptr + rows[:, None] * D + d[None, :], mask=sp_ok[:, None] & d_ok[None, :], other=0.0
    )
    out = tl.sum(part * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    o = b.to(tl.int64) * H * D + h * D + d
    tl.store(out_ptr + o, out.to(out_ptr.dtype.element_ty), mask=d_ok)


# Programs a GPU runs at once, about (an H100 has 132 SMs): a decode batch with fewer
# sequence x K/V-head programs than this splits each sequence's keys over more programs
SPLIT_TARGET, MAX_SPLITS = 128, 16
# Keys per step of the online softmax (FlashAttention's BLOCK_N): several blocks of the
# paged cache at once, a block size's worth at the least
KEY_TILE = 64


def decode_splits(num_seqs: int, n_kv: int) -> int:
    """How many shares of its keys each decode row's attention is split into: from the
    batch shape alone (never the lengths), so a CUDA graph of a bucket keeps it. In the
    interpreter a program costs host time instead of filling idle SMs: one pass there
    (the tests ask for splits explicitly)."""
    if INTERPRET:
        return 1
    return max(1, min(MAX_SPLITS, SPLIT_TARGET // max(1, num_seqs * n_kv)))


def _split_decode(
    q, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap, alibi, splits, consts,
    sinks,
):  # fmt: skip
    b, h, d = q.shape
    kv = k_cache.shape[2]
    part = torch.empty((b, splits, h, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((b, splits, h), dtype=torch.float32, device=q.device)
    out = torch.empty((b, h, d), dtype=q.dtype, device=q.device)
    _decode_split_kernel[(b, splits, kv)](
        q,
        k_cache,
        v_cache,
        part,
        lse,
        block_tables,
        seq_lens,
        alibi if alibi is not None else q,
        scale,
        window,
        softcap,
        q.stride(0),
        q.stride(1),
        block_tables.stride(0),
        BLOCK_G=max(16, consts["BLOCK_G"]),
        SPLITS=splits,
        **{k: v for k, v in consts.items() if k not in ("BLOCK_G", "SINKS")},
    )
    _combine_splits_kernel[(b, h)](
        part, lse, out, sinks if sinks is not None else lse, H=h, D=d, D_PAD=consts["D_PAD"],
        SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits), SINKS=sinks is not None,
    )  # fmt: skip
    return out


def _constants(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    alibi: torch.Tensor | None,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> dict[str, object]:
    """The attention kernels' compile-time constants for these shapes and options."""
    h, d = q.shape[1], q.shape[2]
    bs, kv = k_cache.shape[1], k_cache.shape[2]
    upcast = INTERPRET or q.dtype == torch.float32
    return dict(
        G=h // kv,
        KV=kv,
        D=d,
        D_PAD=max(16, triton.next_power_of_2(d)),
        BS=bs,
        TILE=max(bs, KEY_TILE),
        BLOCK_G=triton.next_power_of_2(h // kv),
        HAS_ALIBI=alibi is not None,
        WINDOWED=window is not None,
        SOFTCAP=softcap is not None,
        SINKS=sinks is not None,
        UPCAST=upcast,
        PRECISION="ieee" if upcast else "tf32",
    )


def paged_attention(
    q: torch.Tensor,  # (T, H, D), rows may be strided (a view of the fused qkv)
    k_cache: torch.Tensor,  # (NB, BS, KV, D)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (B, W) int32
    seq_lens: torch.Tensor,  # (B,) int32
    query_start: torch.Tensor,  # (B + 1,) int32
    max_query_len: int,
    scale: float,
    alibi: torch.Tensor | None = None,  # (H,) fp32
    splits: int | None = None,  # decode-only batches: None = decode_splits()
    window: int | None = None,  # a sliding window: each query sees that many keys at most
    softcap: float | None = None,  # Gemma 2: scores become softcap * tanh(score / softcap)
    sinks: torch.Tensor | None = None,  # (H,) fp32: gpt-oss's logit per head by the scores
) -> torch.Tensor:
    """Attention of a flattened batch of decodes and prefill chunks over the paged cache
    (the new tokens' K/V already stored) -> (T, H, D) in q's dtype. Under a sliding window
    the blocks before every window of a program are not read (they may be freed). One launch for the
    whole batch, or, for a batch of decodes too small to fill the GPU, each row's keys
    split over several programs and merged (flash-decoding). A sequence of seq_len 0 (a
    padding row) gives zeros."""
    t, h, d = q.shape
    kv = k_cache.shape[2]
    consts = _constants(q, k_cache, alibi, window, softcap, sinks)
    block_g = consts["BLOCK_G"]
    if max_query_len == 1 and t > 0:
        splits = decode_splits(t, kv) if splits is None else splits
        if splits > 1:
            return _split_decode(
                q, k_cache, v_cache, block_tables, seq_lens, scale, window or 0, softcap or 1.0,
                alibi, splits, consts, sinks,
            )  # fmt: skip
    # rows per program: at least 16 (tl.dot's smallest tile), up to 64 for a prompt chunk
    block_q = max(1, (16 if max_query_len == 1 else 64) // block_g)
    block_q = min(block_q, triton.next_power_of_2(max_query_len))
    block_q = max(block_q, max(1, 16 // block_g))
    out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    grid = (seq_lens.shape[0], triton.cdiv(max_query_len, block_q), kv)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        seq_lens,
        query_start,
        alibi if alibi is not None else q,
        sinks if sinks is not None else q,
        scale,
        window or 0,
        softcap or 1.0,
        q.stride(0),
        q.stride(1),
        block_tables.stride(0),
        BLOCK_Q=block_q,
        **consts,
    )
    return out
