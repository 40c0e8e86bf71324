"""The `triton` backend: kvserve's Triton kernels (model/backends/triton/kernels.py) for
the residual add + RMSNorm, RoPE + KV store and paged attention over a flattened batch of
decodes and prefill chunks, in one launch each per layer, with no mask and no gather. Its
KV layout is the reference's, (num_blocks, block_size, KV, head_dim) per layer.

Its step metadata is int32 and built from persistent host buffers (pinned on CUDA) with
non-blocking copies, so building it never waits for the device; nothing in the forward
reads a device value on the host. On a machine without a GPU the kernels run in Triton's
interpreter: slow, and how the tests prove them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from model.backends.fp8 import Fp8Linear
from model.backends.int4 import Int4Experts, Int4Linear
from model.backends.reference import (
    TorchBackend,
    beyond_window,
    fusable_rms_norm,
    split_heads,
)
from model.config import ModelConfig
from model.layers import SwiGLU
from model.metadata import AttentionMetadata
from model.moe import Experts, MoE


def unsupported(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> str | None:
    """Why the Triton kernels cannot run this shape, or None if they can."""
    if block_size < 16 or block_size & (block_size - 1):
        return f"the Triton kernels need a power-of-two block_size >= 16, got {block_size}"
    if cfg.head_dim % 2:
        return f"the Triton kernels need an even head_dim, got {cfg.head_dim}"
    return None


class StepBuffers:
    """Persistent host buffers (pinned on CUDA) and their device twins, one per name,
    grown when a step needs more: a step's int32 metadata is written on the host and
    copied without blocking. Two sets, a step each in turn: with async scheduling the
    engine writes a step's metadata while the step before may not have run its copies
    yet; a set is written again only once the copies of the step that last used it are
    done (an event recorded after them)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._sets: list[dict[str, tuple[Tensor, Tensor]]] = [{}, {}]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def begin(self) -> None:
        """A step's puts start: the other set, once its last copies have run."""
        if self.pinned:
            self._turn ^= 1
            if (done := self._copied[self._turn]) is not None:
                done.synchronize()

    def end(self) -> None:
        """A step's puts are queued: mark where its set's copies end."""
        if self.pinned:
            done = self._copied[self._turn] or torch.cuda.Event()
            done.record()
            self._copied[self._turn] = done

    def put(self, name: str, values: Sequence[int] | np.ndarray) -> Tensor:
        """values -> an int32 device tensor (valid until the set is written again, two
        steps later)."""
        if not self.pinned:  # host and device are one: a fresh tensor, nothing to race
            return torch.as_tensor(np.asarray(values, dtype=np.int32))
        n = len(values)
        bufs = self._sets[self._turn]
        host, dev = bufs.get(name, (None, None))
        if host is None or host.numel() < n:
            size = max(n, 2 * host.numel() if host is not None else 256)
            # plain tensors, whatever mode the first caller runs in: an inference tensor
            # could not be written outside inference mode
            with torch.inference_mode(False):
                host = torch.empty(size, dtype=torch.int32, pin_memory=True)
                dev = torch.empty(size, dtype=torch.int32, device=self.device)
            bufs[name] = (host, dev)
        host.numpy()[:n] = values
        dev[:n].copy_(host[:n], non_blocking=True)
        return dev[:n]


class TritonBackend(TorchBackend):
    name = "triton"

    def __init__(self, device: torch.device, reason: str = "") -> None:
        super().__init__(device, reason)
        # imported here: TRITON_INTERPRET must be set (select_backend does) beforehand
        from model.backends.triton import fp8_gemv, int4_linear, lora, moe, pointwise
        from model.backends.triton import kernels as triton_kernels

        self.kernels = triton_kernels
        self.pointwise = pointwise
        self.fp8_gemv = fp8_gemv
        self.int4_linear = int4_linear
        self.moe = moe
        self.lora = lora
        self.buffers = StepBuffers(self.device)

    def describe(self) -> dict[str, Any]:
        return super().describe() | {"interpreter": self.kernels.INTERPRET}

    def prepare(self, model: nn.Module, quantization: str = "none") -> bool:
        """The reference's weights (FP8 or int4 where asked), and this backend's kernels
        given to the modules that take one: SwiGLU's silu(gate) * up, a mixture's routed
        experts (model/backends/triton/moe.py; int4 stacks too), the int4 linears' W4A16 kernel
        (int4_linear.py), and on CUDA the FP8 linears' activation quantizer (pointwise.py)
        and their kernel for decode batches (fp8_gemv.py)."""
        repacked = super().prepare(model, quantization)
        for module in model.modules():
            if isinstance(module, MoE) and isinstance(module.experts, (Experts, Int4Experts)):
                module.experts = self.moe.TritonExperts(module.experts)
            elif isinstance(module, SwiGLU):
                module.gate_mul = self.pointwise.silu_mul
            elif isinstance(module, Int4Linear):
                module.kernel = self.int4_linear.int4_linear
            elif isinstance(module, Fp8Linear) and self.device.type == "cuda":
                module.quantize_act = self.pointwise.quantize_rows_fp8
                module.gemv, module.gemv_rows = self.fp8_gemv.fp8_gemv, self.fp8_gemv.ROWS
        return repacked

    def lora_add(self, x: Tensor, a: Tensor, bt: Tensor, slots: Tensor, y: Tensor) -> Tensor:
        return self.lora.lora_add(x, a, bt, slots, y)

    def check_cache(self, cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> None:
        why = unsupported(cfg, block_size, dtype)
        if why is not None:
            raise ValueError(why)

    def metadata(
        self,
        block_tables: Sequence[Sequence[int]],
        cached_lens: Sequence[int],
        query_lens: Sequence[int],
        block_size: int,
        device: torch.device | str,
        pad_block: int,
        window_tables: Sequence[Sequence[int]] | None = None,
        window_pad: int = 0,
    ) -> AttentionMetadata:
        """positions (int64, they index the RoPE tables), slots, block tables, lengths and
        query starts; no mask, no per-row tables."""
        if len(block_tables) != len(query_lens) or len(cached_lens) != len(query_lens):
            raise ValueError("need one block table, cached length and query length per sequence")
        if not query_lens or min(query_lens) <= 0:
            raise ValueError("every sequence needs at least one new token")
        q = np.asarray(query_lens, dtype=np.int64)
        cached = np.asarray(cached_lens, dtype=np.int64)
        starts = _query_starts(q)
        row_seq = np.repeat(np.arange(len(q)), q)
        positions = np.arange(starts[-1]) - starts[row_seq] + cached[row_seq]
        put = self.buffers.put
        self.buffers.begin()
        slots, tables = self._pool(block_tables, cached + q, row_seq, positions, block_size,
                                   pad_block, "")  # fmt: skip
        meta = AttentionMetadata(
            positions=put("positions", positions).long(),
            query_lens=list(query_lens),
            seq_lens=(cached + q).tolist(),
            slot_mapping=slots,
            block_tables=tables,
            query_start=put("starts", starts),
            seq_lens_t=put("seq_lens", cached + q),
        )
        if window_tables is not None:
            slots, tables = self._pool(window_tables, cached + q, row_seq, positions,
                                       block_size, window_pad, "window ")  # fmt: skip
            meta.window = replace(meta, slot_mapping=slots, block_tables=tables, memo={})
        self.buffers.end()
        return meta

    def _pool(
        self,
        block_tables: Sequence[Sequence[int]],
        totals: np.ndarray,
        row_seq: np.ndarray,
        positions: np.ndarray,
        block_size: int,
        pad_block: int,
        pool: str,
    ) -> tuple[Tensor, Tensor]:
        """The new tokens' slots and the padded block tables over one pool's tables, in
        buffers of their own (`pool` prefixes their names)."""
        width = max(len(t) for t in block_tables)
        tables = np.full((len(block_tables), width), pad_block, dtype=np.int64)
        for i, (table, total) in enumerate(zip(block_tables, totals, strict=True)):
            if -(-int(total) // block_size) > len(table):
                raise ValueError(f"block table of {len(table)} blocks cannot hold {total} tokens")
            tables[i, : len(table)] = table
        slots = tables[row_seq, positions // block_size] * block_size + positions % block_size
        put = self.buffers.put
        return put(pool + "slots", slots), put(pool + "tables", tables.reshape(-1)).view(
            len(block_tables), width
        )

    def add_norm(self, norm: nn.Module, x: Tensor, delta: Tensor | None) -> tuple[Tensor, Tensor]:
        """RMSNorm in one kernel with the residual add before it (x updated in place, as
        the cpu backend does); LayerNorm as the reference computes it."""
        if fusable_rms_norm(norm, x, delta):
            return x, self.kernels.add_rms_norm(x, delta, norm.weight, norm.eps)
        return super().add_norm(norm, x, delta)

    def rope_store(
        self,
        qkv: Tensor,
        rope: tuple[Tensor, Tensor] | None,
        n_heads: int,
        n_kv: int,
        d_head: int,
        cache: tuple[Tensor, Tensor] | None,
        meta: AttentionMetadata,
    ) -> tuple[Tensor, Tensor, Tensor]:
        qkv = qkv.contiguous()
        self.kernels.rope_store(qkv, rope, n_heads, n_kv, d_head, cache, meta.slot_mapping)
        return split_heads(qkv, n_heads, n_kv, d_head)

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        cache: tuple[Tensor, Tensor] | None,
        meta: AttentionMetadata,
        scale: float,
        alibi: Tensor | None,
        window: int | None = None,
        softcap: float | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor:
        if cache is None:
            return super().attend(q, k, v, cache, meta, scale, alibi, window, softcap, sinks)
        if meta.query_start is None:  # metadata built by AttentionMetadata.paged()
            self._fill(meta)
        out = self.kernels.paged_attention(
            q,
            *cache,
            meta.block_tables,
            meta.seq_lens_t,
            meta.query_start,
            meta.max_query_len,
            scale,
            alibi,
            window=window if beyond_window(meta, window) else None,
            softcap=softcap,
            sinks=sinks.float() if sinks is not None else None,
        )  # (T, H, dh)
        return out.view(q.shape[0], q.shape[1] * q.shape[2])

    def _fill(self, meta: AttentionMetadata) -> None:
        self.buffers.begin()
        meta.query_start = self.buffers.put("starts", _query_starts(meta.query_lens))
        meta.seq_lens_t = self.buffers.put("seq_lens", meta.seq_lens)
        self.buffers.end()
        meta.block_tables = meta.block_tables.to(torch.int32)


def _query_starts(query_lens: Sequence[int] | np.ndarray) -> np.ndarray:
    """(B + 1,) first row of each sequence in the flattened batch, and the total."""
    starts = np.zeros(len(query_lens) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=starts[1:])
    return starts
