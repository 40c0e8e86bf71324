"""Paged attention (model/backends/cpu/kernels/paged_attention.c): one build per head size, block size
and GQA group, at the level model.backends.cpu.isa.cpu_isa names; bf16 caches go to the AMX tile
unit where the CPU has it and the shape fits."""

from __future__ import annotations

import ctypes
import functools

import torch

from model.backends.cpu.isa import cpu_isa, isa_flags
from model.backends.cpu.kernels.build import BASE_FLAGS, bind, build, data_ptr, vector_level
from model.metadata import AttentionMetadata

# The attention kernels use no infinities or NaNs (the running max starts at -1e30), so
# -ffast-math may vectorize their reductions and call glibc's vector expf.
ATTENTION_FLAGS = [*BASE_FLAGS, "-ffast-math"]


def attention_library(head_dim: int, block_size: int, group: int) -> ctypes.CDLL | None:
    """paged_attention.c built for this shape at this CPU's level; None where it cannot
    be built (no compiler, KVSERVE_DISABLE_KERNELS)."""
    return _library_at(head_dim, block_size, group, cpu_isa())


@functools.cache
def _library_at(head_dim: int, block_size: int, group: int, isa: str) -> ctypes.CDLL | None:
    flags = (
        *ATTENTION_FLAGS,
        *isa_flags(isa),
        f"-DHEAD_DIM={head_dim}",
        f"-DBLOCK_SIZE={block_size}",
        f"-DGROUP={group}",
    )
    lib = build("paged_attention.c", flags, f"d{head_dim}-bs{block_size}-g{group}-{isa}")
    if lib is None:
        return None
    bind(
        lib,
        *_KERNELS.values(),
        "paged_attention_amx",
        "paged_attention_amx_init",
    )
    lib.amx = bool(lib.paged_attention_amx_init())  # built with AMX, and the OS allows it
    return lib


MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK_SIZE = 16, 256, 64
# the vector kernel for each cache dtype (bf16: bf16 queries and output, float32 inside)
_KERNELS = {torch.float32: "paged_attention_f32", torch.bfloat16: "paged_attention_bf16"}


def _is_power_of_two(n: int) -> bool:  # the kernel holds a block of scores in one vector
    return n > 0 and n & (n - 1) == 0


def paged_attention_supported(cache: torch.Tensor, n_heads: int, n_kv: int, d_head: int) -> bool:
    """`cache`: a layer's K pool, (num_blocks, KV, D / P, BS, P) as PagedKVCache lays it out."""
    return _attention_supported(
        cache.device.type, cache.dtype, cache.shape[-2], n_heads, n_kv, d_head, cpu_isa()
    )


@functools.cache  # asked once per layer and step: the answer depends on these alone
def _attention_supported(
    device: str,
    dtype: torch.dtype,
    block_size: int,
    n_heads: int,
    n_kv: int,
    d_head: int,
    isa: str,
) -> bool:
    return (
        device == "cpu"
        and dtype in _KERNELS
        and n_heads // n_kv <= MAX_GROUP
        and d_head <= MAX_HEAD_DIM
        and d_head % 2 == 0
        and 2 <= block_size <= MAX_BLOCK_SIZE
        and _is_power_of_two(block_size)
        and _library_at(d_head, block_size, n_heads // n_kv, isa) is not None
    )


def paged_attention(
    q: torch.Tensor,  # (R, H, D) any float dtype, one row per query token; rows may be
    # strided (a view of the fused qkv projection)
    k_cache: torch.Tensor,  # (num_blocks, KV, D / P, BS, P)
    v_cache: torch.Tensor,  # (num_blocks, KV, BS / P, D, P)
    block_tables: torch.Tensor,  # (B, max_blocks) int64, one per sequence
    lens: torch.Tensor,  # (R,) int64: keys each row sees (its position + 1)
    scale: float,
    alibi: torch.Tensor | None = None,  # (H,) float32
    row_seq: torch.Tensor | None = None,  # (R,) int64 sequence of each row; None: row r -> r
    window: WindowView | None = None,  # a sliding window's view of the step (window_view)
    softcap: float | None = None,  # Gemma 2's: scores become softcap * tanh(score / softcap)
) -> torch.Tensor:
    """Attention of each query row over the first lens[row] cached tokens of its sequence
    (its own K/V must already be in the cache), or over the last of them a sliding window
    sees (`window`, in place of block_tables, lens and row_seq) -> (R, H, D) in the cache's
    dtype. bf16 caches go to the tile unit at the amx level (model.backends.cpu.isa.cpu_isa),
    else vector code."""
    r, h, d = q.shape
    kv, block_size = k_cache.shape[1], k_cache.shape[-2]
    skip = None
    if window is not None:
        block_tables, lens, row_seq, skip = window
    lib = attention_library(d, block_size, h // kv)
    assert lib is not None, "check paged_attention_supported() first"
    amx = k_cache.dtype == torch.bfloat16 and amx_attention(lib, d, block_size)
    q = q.to(k_cache.dtype)  # bf16 caches take bf16 queries (and give bf16), fp32 fp32
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    out = torch.empty((r, h, d), dtype=q.dtype)
    rows = row_seq.contiguous() if row_seq is not None else None
    slopes = alibi.float().contiguous() if alibi is not None else None
    name = "paged_attention_amx" if amx else _KERNELS[k_cache.dtype]
    getattr(lib, name)(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.contiguous().data_ptr(),
        data_ptr(rows),
        lens.contiguous().data_ptr(),
        data_ptr(skip),
        out.data_ptr(),
        r,
        q.stride(0),
        kv,
        block_tables.shape[1],
        scale,
        softcap or 0.0,
        data_ptr(slopes),
        torch.get_num_threads(),
    )
    return out.to(k_cache.dtype)


# A sliding window's view of a step for the kernels: each row's block table starts at its
# window's first block, so blocks before it (freed, or never read) are not walked; the
# keys of that first block before the window are the row's `skip`.
# (tables, lens, row_seq, skip): tables one per run of rows, row_seq each row's run.
WindowView = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]

# Rows of one sequence that share a shifted table (the kernels' ROWS_PER_TASK): a run's
# rows keep sharing each block read, and a row's skip stays below a part of its keys.
WINDOW_RUN = 8


def window_view(
    block_tables: torch.Tensor,  # (B, max_blocks)
    lens: torch.Tensor,  # (R,) keys each row sees
    row_seq: torch.Tensor | None,  # (R,) sequence of each row; None: row r -> r
    window: int,
    block_size: int,
) -> WindowView:
    """The step as the kernels see it under a sliding window of `window` keys: row r sees
    keys lens[r] - window .. lens[r] - 1 (those that exist)."""
    rows = torch.arange(lens.numel())
    seq = row_seq if row_seq is not None else rows
    lo = (lens - window).clamp_min(0)  # each row's first key
    starts = torch.ones_like(seq, dtype=torch.bool)
    starts[1:] = seq[1:] != seq[:-1]
    # a run: up to WINDOW_RUN consecutive rows of one sequence (its rows are consecutive)
    first = torch.cummax(torch.where(starts, rows, 0), 0).values
    starts |= (rows - first) % WINDOW_RUN == 0
    run = torch.cumsum(starts, 0) - 1
    lead = rows[starts]  # each run's first row: the earliest window of the run
    shift = lo[lead] // block_size  # (runs,) blocks wholly before every row's window
    seen = lens - shift[run] * block_size
    width = -(-int(seen.max()) // block_size)
    last = block_tables.shape[1] - 1
    cols = (shift[:, None] + torch.arange(width)[None, :]).clamp_max(last)
    tables = block_tables[seq[lead][:, None], cols]
    return tables, seen, run, lo - shift[run] * block_size


def step_window(meta: AttentionMetadata, window: int | None, block_size: int) -> WindowView | None:
    """The step's window_view, built once per forward and window; None where no row has
    keys outside its window."""
    if window is None or meta.max_seq_len <= window:
        return None
    assert meta.block_tables is not None and meta.row_lens is not None, "paged metadata"
    key = ("cpu-window", window)
    if key not in meta.memo:
        meta.memo[key] = window_view(
            meta.block_tables, meta.row_lens, meta.row_seq, window, block_size
        )
    return meta.memo[key]  # type: ignore[return-value]


AMX_BLOCK_SIZE = 16  # the AMX attention kernel's block: one 16 x 16 tile of scores


def attention_isa(d_head: int, block_size: int, group: int, dtype: torch.dtype) -> str:
    """Which code paged_attention runs for this shape and dtype here: 'amx' (tiles) or
    the vector code at the level the kernels are built for (model.backends.cpu.isa.cpu_isa)."""
    lib = attention_library(d_head, block_size, group)
    if lib is not None and dtype == torch.bfloat16 and amx_attention(lib, d_head, block_size):
        return "amx"
    return vector_level()


def amx_attention(lib: ctypes.CDLL, d_head: int, block_size: int) -> bool:
    """Whether paged_attention_amx in `lib` runs bf16 attention of this shape."""
    return lib.amx and block_size == AMX_BLOCK_SIZE and d_head % 32 == 0
