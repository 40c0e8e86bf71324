"""What a backend is (model/backends/__init__.py chooses one): the interface the model,
the KV cache and the engine's runner call, and the one convention every backend's
sampling helpers share, how a row with non-finite logits is marked. The model core
imports this module alone of model/backends."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from model.adapters import Adapters
from model.config import ModelConfig
from model.metadata import AttentionMetadata

NON_FINITE = -1  # the token of a row whose logits were not all finite


def mark_non_finite(tokens: Tensor, row_max: Tensor) -> Tensor:
    """Each row's token, or NON_FINITE where its max is not finite (a NaN or +inf anywhere
    shows in the max), so the engine fails just that request; left on the device."""
    return torch.where(torch.isfinite(row_max), tokens, NON_FINITE)


def flag_non_finite(tokens: Tensor, row_max: Tensor) -> list[int]:
    """mark_non_finite's ids on the host: one device -> host copy."""
    return mark_non_finite(tokens, row_max).tolist()


class FusedLayers(Protocol):
    """The decoder layers and the final norm as one call, which a backend's prepare may
    install on a model (Transformer.fused_layers) for the steps it takes."""

    def takes(self, kv_cache: Any, meta: AttentionMetadata) -> bool:
        """Whether forward() runs this step (its cache and metadata)."""
        ...

    def adapt(self, adapters: Adapters) -> None:
        """From now on add the LoRA deltas of the rows `adapters.rows` names, as the
        layers' modules do (model/adapters.py)."""
        ...

    def forward(
        self,
        x: Tensor,
        meta: AttentionMetadata,
        rope: tuple[Tensor, Tensor],
        local: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """Embeddings (T, d) -> the final norm's output (T, d); local: the windowed
        layers' own RoPE tables (Gemma 3), else they use rope."""
        ...


class Backend(Protocol):
    """How this machine runs the model's hardware-bound parts: the KV layout, the step's
    metadata, RoPE + KV store, attention, the residual add + norm, the linears' weight
    layout and the greedy pick. `torch` (model/backends/reference.py) is the reference."""

    name: str
    device: torch.device
    reason: str  # why it was chosen, for the start-up log

    def describe(self) -> dict[str, Any]:
        """What /v1/models/{id} and the start-up log line report."""
        ...

    def check_cache(self, cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> None:
        """Raise ValueError if this backend's cache cannot take this shape."""
        ...

    def kv_pool(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
    ) -> Tensor:
        """The zeroed KV pool (2, layers, blocks, elements) the cache views."""
        ...

    def kv_views(
        self, data: Tensor, cfg: ModelConfig, num_blocks: int, block_size: int
    ) -> list[tuple[Tensor, Tensor]]:
        """Per layer K and V views of the pool `data` (2, layers, num_blocks, elements)."""
        ...

    def prepare(self, model: nn.Module, quantization: str = "none") -> bool:
        """Put the weights in the layouts this backend's linears read; whether it did."""
        ...

    def prepare_layer(self, block: nn.Module, quantization: str = "none") -> None:
        """The part of prepare() one decoder layer takes, done as the load fills that
        layer (the load then holds one layer in the serving dtype beside the prepared
        ones, not the whole model); prepare() does the rest."""
        ...

    def held_bytes(self, model: nn.Module) -> int:
        """The bytes the prepared model's weights take, in the layouts prepare() chose."""
        ...

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
        """The step's metadata; with window_tables (the windowed layers' own pool,
        PagedKVCache.window_data), its `window` the same rows over those tables."""
        ...

    def lora_add(self, x: Tensor, a: Tensor, bt: Tensor, slots: Tensor, y: Tensor) -> Tensor:
        """y (T, out) with each row's LoRA delta added (model/adapters.py's AddDelta: x
        (T, in), the bank's stacks a and bt, each row's slot, -1 for none)."""
        ...

    def greedy(self, logits: Tensor) -> list[int]:
        """(B, V) logits -> each row's first argmax, or NON_FINITE."""
        ...

    def softcap(self, logits: Tensor, cap: float) -> Tensor:
        """cap * tanh(logits / cap) (Gemma 2's final logits; may be in place)."""
        ...

    def add_norm(
        self, norm: nn.Module, x: Tensor, delta: Tensor | None
    ) -> tuple[Tensor, Tensor]: ...

    def norm_heads(
        self,
        qkv: Tensor,
        q_norm: nn.Module,
        k_norm: nn.Module,
        n_heads: int,
        n_kv: int,
        whole: bool = False,
    ) -> Tensor:
        """q/k norms before RoPE: each head (Qwen3), or all heads at once (whole: OLMo 2)."""
        ...

    def rope_store(
        self,
        qkv: Tensor,
        rope: tuple[Tensor, Tensor] | None,
        n_heads: int,
        n_kv: int,
        d_head: int,
        cache: tuple[Tensor, Tensor] | None,
        meta: AttentionMetadata,
    ) -> tuple[Tensor, Tensor, Tensor]: ...

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
    ) -> Tensor: ...
