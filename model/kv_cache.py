"""The paged KV cache: a pool of fixed-size blocks per layer, in the layout of the backend
that reads it. A sequence owns an append-only list of block ids (its block table)."""

from __future__ import annotations

import torch
from torch import Tensor

from model.backends.base import Backend
from model.config import ModelConfig


class PagedKVCache:
    """K and V block pools for every layer, in the layout of the backend that reads them.

    The pool is one tensor (2, layers, num_blocks + 1, KV * block_size * head_dim); the
    backend (model/backends) views each layer's K and V in its own layout: the `torch` and
    `triton` backends as (num_blocks, block_size, KV, head_dim), the `cpu` backend as its
    C kernels read it. Every layout keeps a block's KV * block_size * head_dim elements
    together, so a block is the same bytes whatever reads it.

    With window_blocks, a model with windowed layers keeps their K and V in a pool of
    their own, `window_data`, of that many blocks and its own block ids: a sequence holds
    there only the blocks its windows still see (service/engine/kv/window_blocks.py), and
    the global layers' pool `data` holds the whole context. Where every layer is windowed
    (Mistral, Phi-3 with sliding_window), `data` has no layers: its block ids only name
    the blocks of each sequence's context, for the prefix cache.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        backend: Backend,
        window_blocks: int = 0,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0 or window_blocks < 0:
            raise ValueError(
                f"num_blocks and block_size must be > 0 (and window_blocks >= 0), got "
                f"{num_blocks}, {block_size}, {window_blocks}"
            )
        if window_blocks and not cfg.windowed_layers:
            raise ValueError("window_blocks: the model has no windowed layers")
        backend.check_cache(cfg, block_size, dtype)
        self.backend = backend
        self.num_blocks = num_blocks
        self.window_blocks = window_blocks
        self.block_size = block_size
        self.n_kv, self.d_head = cfg.kv_heads, cfg.head_dim
        elements = cfg.kv_heads * block_size * cfg.head_dim
        windowed = cfg.windowed_layers if window_blocks else ()
        # each layer's pool and its place there
        self._where = [
            (1, windowed.index(i)) if i in windowed else (0, i - sum(w < i for w in windowed))
            for i in range(cfg.n_layers)
        ]
        # one more block than asked in each pool: the null block, always zero and never
        # handed out, pads block tables so padding never reads another request's K/V
        shape = (2, cfg.n_layers - len(windowed), num_blocks + 1, elements)
        self.data = backend.kv_pool(shape, dtype, device)
        self.window_data: Tensor | None = None
        pools = [backend.kv_views(self.data, cfg, num_blocks + 1, block_size)]
        if windowed:
            shape = (2, len(windowed), window_blocks + 1, elements)
            self.window_data = backend.kv_pool(shape, dtype, device)
            pools.append(backend.kv_views(self.window_data, cfg, window_blocks + 1, block_size))
        # views made once: a decode step asks for each layer's
        self._layers = [pools[pool][j] for pool, j in self._where]
        self._block_nbytes = self.data[:, :, 0].numel() * self.data.element_size()
        self.host: Tensor | None = None  # the host tier's blocks (add_host_pool)
        self._host_written: torch.cuda.Event | None = None  # after the last copies out
        self._window_nbytes = 0
        if self.window_data is not None:
            self._window_nbytes = self.window_data[:, :, 0].numel() * self.data.element_size()

    @property
    def null_block(self) -> int:
        return self.num_blocks

    @property
    def window_only(self) -> bool:
        """Every layer's K/V in `window_data`: the block ids of `data` hold none."""
        return self.window_data is not None and self.data.shape[1] == 0

    @property
    def window_null_block(self) -> int:
        return self.window_blocks

    def clear(self, blocks: Tensor, window_blocks: Tensor | None = None) -> None:
        """Zero these blocks' K and V in every layer of their pool."""
        self.data.index_fill_(2, blocks, 0)
        if window_blocks is not None and self.window_data is not None:
            self.window_data.index_fill_(2, window_blocks, 0)

    def add_host_pool(self, slots: int) -> None:
        """Host memory for `slots` blocks of `data`, each slot's bytes contiguous: the
        prefix cache's host tier (service/engine/kv/host_tier.py). Pinned where the pool is
        on CUDA, so that its copies are DMA queued on the stream, the host going on."""
        pin = self.data.device.type == "cuda"
        shape = (slots, 2, self.data.shape[1], self.data.shape[3])
        self.host = torch.empty(shape, dtype=self.data.dtype, pin_memory=pin)

    def copy_blocks(self, pairs: list[tuple[int, int]], out: bool) -> None:
        """Copy blocks of `data` (every layer's K and V) to host slots, pairs (block,
        slot) (out), or host slots into blocks, pairs (slot, block): the same bytes. The
        blocks are gathered (or scattered) on the device, and each run of consecutive
        slots is one copy; on CUDA all of it is queued on the current stream."""
        if not pairs:
            return
        assert self.host is not None, "no host pool"
        first, second = (list(side) for side in zip(*pairs, strict=True))
        if out:
            moved = self.data.index_select(2, self._indices(first)).permute(2, 0, 1, 3)
            self._slots_copy(second, moved.contiguous(), out=True)
            if self.data.device.type == "cuda":
                self._host_written = torch.cuda.Event()
                self._host_written.record()
        else:
            staged = self.host.new_empty(
                (len(first), *self.host.shape[1:]), device=self.data.device
            )
            self._slots_copy(first, staged, out=False)
            self.data.index_copy_(2, self._indices(second), staged.permute(1, 2, 0, 3))

    def _slots_copy(self, slots: list[int], staged: Tensor, out: bool) -> None:
        """staged[i] (on the device) to host slot slots[i] (out), or back: one copy a run."""
        assert self.host is not None
        at = 0
        while at < len(slots):
            n = 1
            while at + n < len(slots) and slots[at + n] == slots[at] + n:
                n += 1
            host = self.host[slots[at] : slots[at] + n]
            if out:
                host.copy_(staged[at : at + n], non_blocking=True)
            else:
                staged[at : at + n].copy_(host, non_blocking=True)
            at += n

    def _indices(self, ids: list[int]) -> Tensor:
        """Block ids on the pool's device; from pinned memory on CUDA, so that the copy
        does not wait for the stream's work before it."""
        index = torch.tensor(ids, dtype=torch.long)
        if self.data.device.type != "cuda":
            return index
        return index.pin_memory().to(self.data.device, non_blocking=True)

    def host_block(self, slot: int) -> Tensor:
        """A copy of one host slot's bytes, (2, layers, 1, elements), once the copies out
        queued before have landed."""
        assert self.host is not None, "no host pool"
        if self._host_written is not None:
            self._host_written.synchronize()
        return self.host[slot].unsqueeze(2).clone()

    def device_block(self, block: int) -> Tensor:
        """A host copy of one block's bytes of `data`, as host_block gives a slot's."""
        return self.data[:, :, block : block + 1].cpu().clone()

    def load_blocks(self, pairs: list[tuple[Tensor, int]]) -> None:
        """Blocks' bytes (each as host_block gives them) into these blocks of `data`."""
        if pairs:
            moved = torch.cat([data for data, _ in pairs], dim=2).to(self.data.device)
            blocks = torch.tensor([b for _, b in pairs], dtype=torch.long, device=self.data.device)
            self.data.index_copy_(2, blocks, moved)

    def layer(self, i: int) -> tuple[Tensor, Tensor]:
        """Layer i's K and V views of its pool (`data`, or `window_data` for a windowed
        layer where there is one), in the backend's layout."""
        return self._layers[i]

    @property
    def block_nbytes(self) -> int:
        """K and V of one block across the layers of `data` (the engine's snapshot reads
        it every step)."""
        return self._block_nbytes

    @property
    def window_block_nbytes(self) -> int:
        """K and V of one block across the layers of `window_data` (0: none)."""
        return self._window_nbytes

    @property
    def nbytes(self) -> int:
        """The pools that requests can use (the null blocks not counted)."""
        return self.num_blocks * self.block_nbytes + self.window_blocks * self._window_nbytes
