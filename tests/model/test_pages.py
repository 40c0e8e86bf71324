"""Huge pages for what a CPU step streams (model/backends/cpu/pages.py): the arena, the packed weights
and the KV pool in it, and the same results whether Linux gives huge pages or not."""

from pathlib import Path

import pytest
import torch

from model.backends.cpu import prepare_model
from model.backends.cpu.kernels.linear import tile_linear_supported
from model.backends.cpu.packed import PackedLinear
from model.backends.cpu.pages import ALIGN, HUGE_PAGE, HUGE_PAGES_ENV, HugeArena, huge_pages
from model.kv_cache import PagedKVCache
from tests.factories import tiny_model
from tests.model.backends import auto_backend

SHAPE = dict(vocab_size=256, d_model=192, n_heads=6, n_kv_heads=2, d_ff=128, max_position=256)


def vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_copies_land_aligned_and_whole() -> None:
    parts = [torch.randn(5, 7), torch.arange(13, dtype=torch.uint8), torch.randn(64, 3).bfloat16()]
    arena = HugeArena(HugeArena.size_of(parts))
    copies = [arena.take(t) for t in parts]
    for t, c in zip(parts, copies, strict=True):
        assert torch.equal(t, c) and c.dtype == t.dtype and c.shape == t.shape
        assert c.data_ptr() % ALIGN == 0
    # one storage: the views keep the arena alive, nothing else does
    assert len({c.untyped_storage().data_ptr() for c in copies}) == 1
    with pytest.raises(ValueError, match="no room"):
        arena.take(torch.zeros(1))


@pytest.mark.parametrize("env", ["1", "0"])
def test_the_arena_asks_for_huge_pages_where_linux_has_them(monkeypatch, env) -> None:
    monkeypatch.setenv(HUGE_PAGES_ENV, env)
    arena = HugeArena(3 * HUGE_PAGE)
    start = arena.empty((3 * HUGE_PAGE,), torch.uint8).fill_(1)
    # advised where THP runs in 'always' or 'madvise' mode (this machine: /sys/kernel/mm/
    # transparent_hugepage/enabled) unless switched off; 'hg' marks MADV_HUGEPAGE
    # (not advised, the memory may still carry the flag: freed by an advised arena and
    # handed out again by malloc)
    assert arena.advised == huge_pages() == (env == "1" and huge_pages())
    if arena.advised:
        assert "hg" in vm_flags(start.data_ptr()) and start.data_ptr() % HUGE_PAGE == 0


@pytest.mark.skipif(
    not tile_linear_supported(torch.empty(64, 32, dtype=torch.bfloat16)),
    reason="kvserve's linear kernels are not built here (no C compiler, or below AVX2 + FMA)",
)
@pytest.mark.parametrize("quantization", ["none", "int8"])
@torch.no_grad()
def test_packed_weights_share_one_arena_and_give_the_same_logits(
    monkeypatch, quantization: str
) -> None:
    logits = {}
    for env in ("0", "1"):
        monkeypatch.setenv(HUGE_PAGES_ENV, env)
        model = tiny_model(seed=3, n_layers=2, **SHAPE).to(torch.bfloat16)
        prepare_model(model, quantization)
        tiles = [
            m._tiles
            for m in model.modules()
            if isinstance(m, PackedLinear) and m._tiles is not None
        ]
        assert len(tiles) == 2 * 4 + 1  # four a layer and the tied head's packed copy
        assert len({t.untyped_storage().data_ptr() for t in tiles}) == 1
        if env == "1" and huge_pages():
            assert "hg" in vm_flags(tiles[0].data_ptr())
        logits[env] = model(torch.arange(40) % 256)
    assert torch.equal(logits["0"], logits["1"])


def test_the_cpu_kv_pool_is_zeroed_in_an_arena() -> None:
    cfg = tiny_model(**SHAPE).cfg
    cache = PagedKVCache(cfg, 300, 16, torch.bfloat16, "cpu", auto_backend(cfg, torch.bfloat16))
    assert not cache.data.any() and cache.data.is_contiguous()
    if huge_pages():
        assert "hg" in vm_flags(cache.data.data_ptr())
