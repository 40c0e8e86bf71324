"""Multi-head attention over a paged KV cache (model/kv_cache.py): the projections here,
the rotation, the store into the cache and the attention itself in the backend
(model/backends), which reads the step's AttentionMetadata (model/metadata.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from model.backends.base import Backend
from model.config import ModelConfig
from model.layers import RMSNorm
from model.metadata import AttentionMetadata

if TYPE_CHECKING:
    from model.adapters import LayerAdapters
    from model.parallel import TensorParallel

    # a rank's TensorParallel and TensorParallel.qk_widths
    SplitNorms = tuple[TensorParallel, tuple[int, int, int]]


class Attention(nn.Module):
    """Multi-head attention with grouped K/V heads (MHA, GQA, MQA), fused QKV projection.
    The backend (model/backends) rotates, stores and attends."""

    lora: LayerAdapters | None = None  # its layer's LoRA deltas (model/adapters.py's attach)

    def __init__(
        self, cfg: ModelConfig, window: int | None = None, split_norms: SplitNorms | None = None
    ) -> None:
        """split_norms: under tensor parallelism, q/k norms over every head together
        (OLMo 2) join the ranks' sums of squares (model/parallel.py)."""
        super().__init__()
        self.n_heads, self.n_kv, self.d_head = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.window = window  # sliding-window attention's, or None
        self.softcap = cfg.attn_logit_softcap  # Gemma 2: scores -> cap * tanh(score / cap)
        self.scale = cfg.attention_multiplier or self.d_head**-0.5  # Granite sets its own
        qkv_out = (self.n_heads + 2 * self.n_kv) * self.d_head
        self.wqkv = nn.Linear(cfg.d_model, qkv_out, bias=cfg.qkv_bias)
        self.wo = nn.Linear(self.n_heads * self.d_head, cfg.d_model, bias=cfg.attn_out_bias)
        # Qwen3 ("head"): each head of q and of k normed, one weight of d_head for all
        # heads; OLMo 2 ("all"): q's heads normed together, and k's
        self.qk_norm = cfg.qk_norm
        q_dim, k_dim = self.d_head, self.d_head
        if cfg.qk_norm == "all":
            q_dim, k_dim = self.n_heads * self.d_head, self.n_kv * self.d_head
        self.q_norm = RMSNorm(q_dim, cfg.norm_eps) if cfg.qk_norm != "none" else None
        self.k_norm = RMSNorm(k_dim, cfg.norm_eps) if cfg.qk_norm != "none" else None
        self.split_norms = split_norms if cfg.qk_norm == "all" else None
        # gpt-oss: a learned logit per head beside the scores in its softmax, whose
        # share attends to nothing
        self.sinks = nn.Parameter(torch.empty(self.n_heads)) if cfg.attn_sinks else None

    def forward(
        self,
        x: Tensor,
        meta: AttentionMetadata,
        rope: tuple[Tensor, Tensor] | None,
        cache: tuple[Tensor, Tensor] | None,
        alibi_slopes: Tensor | None,
        backend: Backend,
    ) -> Tensor:
        """x: (T, d) -> (T, d). RoPE is applied to q and k; new K/V are written to the cache."""
        if self.window is not None and meta.window is not None:  # the windowed layers' pool
            meta = meta.window
        qkv = self.wqkv(x)  # (T, (H + 2KV) * dh)
        if self.lora is not None:
            qkv = self.lora.add("attn.wqkv", x, qkv)
        if self.split_norms is not None:
            qkv = self._norm_split(qkv)
        elif self.qk_norm != "none":  # each head's (Qwen3) or all heads at once (OLMo 2)
            whole = self.qk_norm == "all"
            qkv = backend.norm_heads(qkv, self.q_norm, self.k_norm, self.n_heads, self.n_kv, whole)
        q, k, v = backend.rope_store(qkv, rope, self.n_heads, self.n_kv, self.d_head, cache, meta)
        out = backend.attend(
            q, k, v, cache, meta, self.scale, alibi_slopes, self.window, self.softcap, self.sinks
        )
        if self.lora is not None:
            return self.lora.add("attn.wo", out, self.wo(out))
        return self.wo(out)  # out: (T, H * dh)

    def _norm_split(self, qkv: Tensor) -> Tensor:
        tp, widths = self.split_norms  # type: ignore[misc]
        q_dim, k_dim = self.n_heads * self.d_head, self.n_kv * self.d_head
        q, k, v = qkv.split([q_dim, k_dim, k_dim], dim=1)
        q, k = tp.norm_qk(q, k, self.q_norm, self.k_norm, widths)
        return torch.cat([q, k, v], dim=1)
