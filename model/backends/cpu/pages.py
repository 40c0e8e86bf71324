"""Huge pages for the memory a CPU decode step streams: the packed linear weights, read
whole every step, and the KV pool, whose blocks a long context reads all over. In 4 KB
pages a 360 MB pass walks the page tables ~90,000 times; where Linux backs the memory with
2 MB transparent huge pages (THP) it walks them ~180 times. Most distributions leave THP to
memory that asks for it (madvise mode); torch's allocator never asks. What that is worth:
docs/decisions.md.

`HugeArena` is one allocation, 2 MB aligned and advised MADV_HUGEPAGE before anything
touches it, that tensors are copied into one at a time. KVSERVE_HUGE_PAGES=0 turns the
advice off (to measure without it); where Linux has THP off or is not Linux, the arena is
plain memory.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE, MADV_NOHUGEPAGE = 14, 15  # linux/mman.h
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
HUGE_PAGES_ENV = "KVSERVE_HUGE_PAGES"
ALIGN = 64  # each tensor's start in the arena: the kernels' vector loads


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:
    if not sys.platform.startswith("linux"):
        return None
    fn = ctypes.CDLL(None, use_errno=True).madvise
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def madvise(address: int, nbytes: int, advice: int) -> bool:
    """Linux's madvise on [address, address + nbytes) (address page-aligned); False where
    there is no madvise or Linux refuses the advice."""
    fn = _madvise()
    return fn is not None and fn(address, nbytes, advice) == 0


def huge_pages() -> bool:
    """Whether memory advised MADV_HUGEPAGE can get huge pages here: Linux with THP in
    'always' or 'madvise' mode, and not switched off by KVSERVE_HUGE_PAGES=0."""
    if os.environ.get(HUGE_PAGES_ENV, "1") == "0" or _madvise() is None:
        return False
    try:
        return "[never]" not in THP_MODE.read_text()
    except OSError:
        return False


class HugeArena:
    """`nbytes` of CPU memory, untouched until take() copies into it or empty()'s caller
    writes it. Where huge_pages(), its 2 MB-aligned span is advised MADV_HUGEPAGE first,
    so the pages those writes fault in are huge ones (as many as Linux can find free)."""

    def __init__(self, nbytes: int) -> None:
        self.advised = huge_pages()
        # advised: whole huge pages from a 2 MB boundary, inside the allocation
        span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE if self.advised else nbytes
        pad = HUGE_PAGE if self.advised else ALIGN
        self._raw = torch.empty(span + pad, dtype=torch.uint8)  # no page touched yet
        start = -self._raw.data_ptr() % pad
        self._bytes = self._raw[start : start + nbytes]
        if self.advised and not madvise(self._bytes.data_ptr(), span, MADV_HUGEPAGE):
            self.advised = False  # e.g. a kernel built without THP: plain pages
        self._used = 0

    @staticmethod
    def size_of(tensors: list[torch.Tensor]) -> int:
        """The bytes an arena needs for these tensors, each at an ALIGN boundary."""
        return sum(-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in tensors)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The arena's next bytes as an uninitialised contiguous tensor."""
        n = torch.Size(shape).numel() * dtype.itemsize
        end = self._used + n
        if end > self._bytes.numel():
            raise ValueError(f"arena of {self._bytes.numel()} bytes has no room for {n} more")
        out = self._bytes[self._used : end].view(dtype).view(shape)
        self._used = -(-end // ALIGN) * ALIGN
        return out

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of CPU tensor t in the arena (same dtype and shape); once the caller
        drops t, its memory is free again."""
        return self.empty(tuple(t.shape), t.dtype).copy_(t)


@functools.cache
def _malloc_trim() -> ctypes._CFuncPtr | None:
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's; musl has none
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_heap() -> None:
    """Hand the heap's free pages back to the OS. Packing frees the load's weights as it
    goes, thousands of small blocks between long-lived ones, which the C heap keeps
    resident until asked."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
