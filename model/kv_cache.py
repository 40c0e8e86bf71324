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
    """

    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        backend: Backend,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"num_blocks and block_size must be > 0, got {num_blocks}, {block_size}"
            )
        backend.check_cache(cfg, block_size, dtype)
        self.backend = backend
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.n_kv, self.d_head = cfg.kv_heads, cfg.head_dim
        # one more block than asked: the null block, always zero and never handed out,
        # pads block tables so padding never reads another request's K/V
        shape = (2, cfg.n_layers, num_blocks + 1, cfg.kv_heads * block_size * cfg.head_dim)
        self.data = backend.kv_pool(shape, dtype, device)
        # views made once: a decode step asks for each layer's
        self._layers = backend.kv_views(self.data, cfg, num_blocks + 1, block_size)
        self._block_nbytes = self.data[:, :, 0].numel() * self.data.element_size()

    @property
    def null_block(self) -> int:
        return self.num_blocks

    def layer(self, i: int) -> tuple[Tensor, Tensor]:
        """Layer i's K and V views of `data`, in the backend's layout."""
        return self._layers[i]

    @property
    def block_nbytes(self) -> int:
        """K and V of one block across all layers (the engine's snapshot reads it every
        step)."""
        return self._block_nbytes

    @property
    def nbytes(self) -> int:
        """The pool that requests can use (the null block not counted)."""
        return self.num_blocks * self.block_nbytes
