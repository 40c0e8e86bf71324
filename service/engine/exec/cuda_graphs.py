"""CUDA graphs of the decode-only forward, at bucketed batch sizes.

A decode step's launches (embedding, every layer's linears and Triton kernels, the head)
are captured once per bucket and replayed: one launch from the host instead of hundreds.
Everything the graph reads lives in static buffers sized for the largest bucket; a step
of n decodes is copied into the first n rows and padded to its bucket with rows that
have no context (seq_len 0), store nothing (slot -1) and read only the null block; their
logits are dropped. Mixed and prefill steps run eagerly.

A model whose windowed layers keep their K/V in a pool of their own has that pool's slots
and tables in static buffers too. The host copies of the lengths say every row is as
long as the context may be, so that a sliding window is always applied in the kernels
(they start each row at its own window from the device lengths): a graph captured for
short rows would otherwise replay them as global ones. Soft-capped scores and logits are
constants of the kernels and of the head.

A model serving LoRA adapters (model/adapters.py) is captured with its deltas, each row's
bank slot read from a static buffer too (-1 for the base model's rows and the padding):
its steps of adapters and of the base model replay the same graphs.

Built only for a backend whose forward never reads a device value on the host (triton).
With capture=False (the CPU tests) a bucket's "graph" is the same function called
eagerly on the same static buffers, so the padding and bucketing logic is tested without
a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor

from model.kv_cache import PagedKVCache
from model.metadata import AttentionMetadata
from model.transformer import Transformer


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_num_seqs (vLLM's spacing), max_num_seqs last."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return [*sizes, max_num_seqs]


class DecodeGraphs:
    def __init__(
        self,
        model: Transformer,
        kv_cache: PagedKVCache,
        max_num_seqs: int,
        max_model_len: int,
        capture: bool = True,
    ) -> None:
        self.model, self.kv_cache = model, kv_cache
        self.buckets = bucket_sizes(max_num_seqs)
        n, dev = self.buckets[-1], model.device
        width = -(-max_model_len // kv_cache.block_size)
        self.tokens = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slots = torch.full((n,), -1, dtype=torch.int32, device=dev)
        self.tables = torch.full((n, width), kv_cache.null_block, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.query_start = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.max_model_len = max_model_len
        self.window_slots = self.window_tables = None
        if kv_cache.window_data is not None:
            null = kv_cache.window_null_block
            self.window_slots = torch.full((n,), -1, dtype=torch.int32, device=dev)
            self.window_tables = torch.full((n, width), null, dtype=torch.int32, device=dev)
        # each row's LoRA slot, where the model serves adapters
        self.lora_rows = None
        if model.adapters is not None:
            self.lora_rows = torch.full((n,), -1, dtype=torch.long, device=dev)
        self._runs: dict[int, Callable[[], Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        for size in reversed(self.buckets):  # largest first: the others reuse its pool
            self._runs[size] = self._capture(size) if capture else self._eager(size)

    def _meta(self, size: int) -> AttentionMetadata:
        meta = AttentionMetadata(
            positions=self.positions[:size],
            query_lens=[1] * size,
            # host copies: one new token each, and a context that may reach the longest
            seq_lens=[self.max_model_len] * size,
            slot_mapping=self.slots[:size],
            block_tables=self.tables[:size],
            query_start=self.query_start[: size + 1],
            seq_lens_t=self.seq_lens[:size],
        )
        if self.window_tables is not None:
            meta.window = replace(
                meta, slot_mapping=self.window_slots[:size],
                block_tables=self.window_tables[:size], memo={},
            )  # fmt: skip
        return meta

    def _forward(self, size: int) -> Tensor:
        adapters = self.model.adapters
        if adapters is not None:  # the deltas read each row's slot from the buffer
            adapters.rows = self.lora_rows[:size]
        try:
            return self.model(self.tokens[:size], self._meta(size), self.kv_cache)  # (size, V)
        finally:
            if adapters is not None:
                adapters.rows = None

    def _eager(self, size: int) -> Callable[[], Tensor]:
        return lambda: self._forward(size)

    def _capture(self, size: int) -> Callable[[], Tensor]:
        with torch.inference_mode():
            self._forward(size)  # warm-up: Triton compiles, allocators settle
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self._forward(size)

        def replay() -> Tensor:
            graph.replay()
            return out

        return replay

    def bucket(self, n: int) -> int | None:
        """The smallest bucket that holds n decodes, or None (run eagerly)."""
        return next((b for b in self.buckets if b >= n), None)

    def run(self, tokens: Tensor, meta: AttentionMetadata, lora: Tensor | None = None) -> Tensor:
        """n decodes (tokens (n,), the backend's metadata for them, each row's LoRA slot
        where any has one) -> logits (n, V)."""
        n = tokens.shape[0]
        size = self.bucket(n)
        if size is None or meta.max_query_len != 1:
            raise ValueError(f"a CUDA graph runs up to {self.buckets[-1]} decodes, got {n}")
        width = meta.block_tables.shape[1]
        self.tokens[:n].copy_(tokens, non_blocking=True)
        self.positions[:n].copy_(meta.positions, non_blocking=True)
        self.slots[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens_t, non_blocking=True)
        if self.window_tables is not None:
            window = meta.window
            self.window_slots[:n].copy_(window.slot_mapping, non_blocking=True)
            self.window_tables[:n, :width].copy_(window.block_tables, non_blocking=True)
        if self.lora_rows is not None:
            if lora is not None:
                self.lora_rows[:n].copy_(lora, non_blocking=True)
            else:
                self.lora_rows[:n].fill_(-1)
        if size > n:  # padding rows: no context, no store, no adapter
            self.slots[n:size].fill_(-1)
            if self.lora_rows is not None:
                self.lora_rows[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(0)
            if self.window_slots is not None:
                self.window_slots[n:size].fill_(-1)
        return self._runs[size]()[:n]


def decode_graphs(
    model: Transformer, kv_cache: PagedKVCache, max_num_seqs: int, max_model_len: int
) -> Callable[[], DecodeGraphs]:
    """The runner calls this after it prepared the weights: capture then."""
    return lambda: DecodeGraphs(model, kv_cache, max_num_seqs, max_model_len)
