"""Block and Transformer: forward(tokens, meta, kv_cache) -> logits."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from model import int4_mix
from model.adapters import Adapters
from model.attention import Attention
from model.backends.base import Backend, FusedLayers
from model.backends.reference import REFERENCE
from model.config import LongRope, ModelConfig
from model.kv_cache import PagedKVCache
from model.layers import (
    alibi_slopes,
    local_rope_tables,
    make_ffn,
    make_norm,
    rope_tables,
    sinusoidal_table,
)
from model.metadata import AttentionMetadata
from model.moe import MoE
from model.parallel import TensorParallel


def _unsplit(x: Tensor) -> Tensor:
    return x


class Block(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        tp: TensorParallel | None = None,
        window: int | None = None,
        qk_widths: tuple[int, int, int] | None = None,
        sparse: bool = False,
    ) -> None:
        """cfg: this rank's shapes (TensorParallel.local_config) under tensor parallelism,
        where the attention and FFN outputs are partial sums until all-reduced; window:
        the layer's sliding window (None: full attention); qk_widths: the whole model's
        (TensorParallel.qk_widths), for q/k norms over every head together; sparse: a
        mixture of experts in place of the FFN (model/moe.py)."""
        super().__init__()
        split = tp is not None and tp.world > 1
        self.reduce = tp.all_reduce if split else _unsplit
        self.placement = cfg.norm_placement
        self.attn_norm = make_norm(cfg)
        norms = (tp, qk_widths) if split and qk_widths is not None else None
        self.attn = Attention(cfg, window, norms)
        self.ffn_norm = make_norm(cfg)
        self.ffn = MoE(cfg) if sparse else make_ffn(cfg)
        if cfg.norm_placement == "sandwich":  # Gemma: a norm on each sublayer's output too
            self.post_attn_norm = make_norm(cfg)
            self.post_ffn_norm = make_norm(cfg)
        self.residual = cfg.residual_multiplier  # Granite scales each sublayer's output

    def forward(
        self,
        x: Tensor,
        delta: Tensor | None,
        meta: AttentionMetadata,
        rope: tuple[Tensor, Tensor] | None,
        cache: tuple[Tensor, Tensor] | None,
        alibi_slopes: Tensor | None,
        backend: Backend,
    ) -> tuple[Tensor, Tensor | None]:
        """Pre-norm blocks pass their FFN output on as `delta`, so the next residual add
        is fused with the next norm; the others return a finished x."""
        if self.placement in ("pre", "sandwich"):
            x, h = backend.add_norm(self.attn_norm, x, delta)
            attn = self.reduce(self.attn(h, meta, rope, cache, alibi_slopes, backend))
            if self.residual != 1.0:
                attn = attn * self.residual
            if self.placement == "sandwich":
                _, attn = backend.add_norm(self.post_attn_norm, attn, None)
            x, h = backend.add_norm(self.ffn_norm, x, attn)
            out = self.reduce(self.ffn(h))
            if self.placement == "sandwich":
                _, out = backend.add_norm(self.post_ffn_norm, out, None)
            return x, out * self.residual if self.residual != 1.0 else out
        if self.placement == "output":  # the norms are on what the sublayers add
            attn = self.reduce(self.attn(x, meta, rope, cache, alibi_slopes, backend))
            x = x + backend.add_norm(self.attn_norm, attn, None)[1]
            out = self.reduce(self.ffn(x))
            return x + backend.add_norm(self.ffn_norm, out, None)[1], None
        x = self.attn_norm(x + self.reduce(self.attn(x, meta, rope, cache, alibi_slopes, backend)))
        return self.ffn_norm(x + self.reduce(self.ffn(x))), None


class Transformer(nn.Module):
    """Token embedding -> N blocks -> final norm (pre-norm only) -> LM head.

    With `tp` (model/parallel.py) this is one rank's share of the model: its heads, FFN
    features and vocab rows; `cfg` stays the whole model's, `local_cfg` is the shapes this
    rank holds (what its KV cache is laid out by). A backend's prepare may swap modules
    for its own (the CPU's packed linears) and install `fused_layers`."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.cfg, self.tp = cfg, tp
        # this rank's share of every weight, decided once (None: the whole model)
        self.shares = tp.shares(cfg) if tp is not None else None
        self.local_cfg = self.shares.local if self.shares is not None else cfg
        vocab = self.shares.vocab_rows if self.shares is not None else cfg.vocab_size
        self.embed = nn.Embedding(vocab, cfg.d_model)
        if cfg.position == "learned":
            self.pos_embed = nn.Embedding(cfg.max_position, cfg.d_model)
        widths = self.shares.qk_widths if self.shares is not None else None
        self.layers = nn.ModuleList(
            Block(self.local_cfg, tp, cfg.window(i), widths, cfg.sparse(i))
            for i in range(cfg.n_layers)
        )
        self.nope = frozenset(cfg.nope_layers)  # layers that take no rotation (SmolLM3)
        self.fused_layers: FusedLayers | None = None
        # LoRA adapters (model/adapters.py's attach): the layers add each row's delta
        self.adapters: Adapters | None = None
        if cfg.norm_placement != "post":  # a final norm before the head
            self.norm = make_norm(cfg)
        # None: the head is the embedding table (until a backend packs a copy of it)
        self.lm_head: nn.Module | None = None
        if not cfg.tie_embeddings:
            self.lm_head = nn.Linear(cfg.d_model, vocab, bias=False)
        self._mark_int4_mix()
        self.rebuild_tables(self.embed.weight.device)

    def _mark_int4_mix(self) -> None:
        """The weights --quantization int4 holds in a kind other than int4
        (model/int4_mix.py): the head in int8g (a tied one: the table it is copied from)
        and each layer's parts that take int5 or int8g."""
        int4_mix.mark(self.lm_head if self.lm_head is not None else self.embed)
        for i, block in enumerate(self.layers):
            int4_mix.mark_layer(block, i, self.cfg)

    def rebuild_tables(self, device: torch.device) -> None:
        """(Re)compute the fixed position tables on `device` (they are not weights)."""
        cfg = self.cfg
        self._rope: tuple[Tensor, Tensor] | None = None
        self._rope_local: tuple[Tensor, Tensor] | None = None  # the windowed layers' (Gemma 3)
        self._sinusoidal: Tensor | None = None
        self._alibi: Tensor | None = None
        if device.type == "meta":
            return
        if cfg.position == "rope":  # computed in fp32, kept in the model's dtype (as HF)
            dtype = self.embed.weight.dtype
            cos, sin = rope_tables(cfg, device)
            self._rope = (cos.to(dtype), sin.to(dtype))
            local = local_rope_tables(cfg, device)
            if local is not None:
                self._rope_local = (local[0].to(dtype), local[1].to(dtype))
        elif cfg.position == "sinusoidal":
            self._sinusoidal = sinusoidal_table(cfg.max_position, cfg.d_model, device)
        elif cfg.position == "alibi":
            heads = self.shares.heads if self.shares is not None else range(cfg.n_heads)
            self._alibi = alibi_slopes(cfg.n_heads)[heads.start : heads.stop].to(device)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # .to() / .cuda() move the weights; the position tables follow them.
        out = super()._apply(fn, recurse)
        self.rebuild_tables(self.embed.weight.device)
        return out

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def forward(
        self,
        tokens: Tensor,
        meta: AttentionMetadata | None = None,
        kv_cache: PagedKVCache | None = None,
        logits_indices: Tensor | None = None,
    ) -> Tensor:
        """tokens: (T,) new tokens of a flattened batch. Without `meta` the tokens are one
        sequence with no cache. Returns logits (T, V), or (len(logits_indices), V) (an
        empty index: no head at all), in the model's dtype (the head computes in it;
        callers that need fp32 convert). The KV cache's backend runs attention (the torch
        reference without a cache)."""
        x = self.hidden(tokens, meta, kv_cache)
        if logits_indices is not None:
            if not logits_indices.numel():  # the K/V were the point: no head (on any rank)
                return x.new_empty((0, self.cfg.vocab_size))
            x = x.index_select(0, logits_indices)
        return self.head(x, kv_cache.backend if kv_cache is not None else REFERENCE)

    def rope_rows(self, meta: AttentionMetadata) -> Tensor:
        """Each token's row of the RoPE tables: its position, but for a LongRoPE model
        every token of a sequence whose prompt is longer than the pretraining length
        turns by the long factors, as transformers turns such a sequence (the tables'
        second half, model/layers.py)."""
        scaling, positions = self.cfg.rope_scaling, meta.positions
        if not isinstance(scaling, LongRope) or meta.prompt_lens is None:
            return positions
        long = [n > scaling.original_max_position for n in meta.prompt_lens]
        if not any(long):
            return positions
        offset = torch.tensor([self.cfg.max_position * x for x in long], device=positions.device)
        counts = torch.tensor(meta.query_lens, device=positions.device)
        return positions + torch.repeat_interleave(offset, counts)

    def hidden(
        self,
        tokens: Tensor,
        meta: AttentionMetadata | None = None,
        kv_cache: PagedKVCache | None = None,
    ) -> Tensor:
        """tokens: (T,) as forward -> the final hidden states (T, d): after the final norm
        (what the head reads, and what embeddings pool)."""
        if meta is None:  # one sequence, all of it here: its prompt
            meta = AttentionMetadata.dense(tokens.shape[0], tokens.device)
            meta.prompt_lens = [tokens.shape[0]]
        if kv_cache is not None and meta.slot_mapping is None:
            raise ValueError("a KV cache needs paged metadata (slot mapping and block tables)")
        positions = meta.positions
        if int(meta.seq_lens and max(meta.seq_lens)) > self.cfg.max_position:
            raise ValueError(
                f"sequence of {max(meta.seq_lens)} tokens exceeds the context length "
                f"{self.cfg.max_position}"
            )
        tp = self.tp
        x = tp.embed(self.embed.weight, tokens) if tp is not None else self.embed(tokens)  # (T, d)
        if self.cfg.embedding_multiplier != 1.0:
            x = x * self.cfg.embedding_multiplier
        if self.cfg.position == "learned":
            x = x + self.pos_embed(positions)
        elif self._sinusoidal is not None:
            x = x + self._sinusoidal[positions].to(x.dtype)
        rope = local = None
        if self._rope is not None:
            rows = self.rope_rows(meta)
            rope = (self._rope[0][rows], self._rope[1][rows])  # (T, dh) each
        if self._rope_local is not None:
            local = (self._rope_local[0][positions], self._rope_local[1][positions])
        backend = kv_cache.backend if kv_cache is not None else REFERENCE
        if self.fused_layers is not None and self.fused_layers.takes(kv_cache, meta):
            x = self.fused_layers.forward(x, meta, rope, local)  # the layers, the final norm
        else:
            delta = None
            for i, layer in enumerate(self.layers):
                cache = kv_cache.layer(i) if kv_cache is not None else None
                turn = None if i in self.nope else rope
                if local is not None and self.cfg.window(i) is not None:
                    turn = local
                x, delta = layer(x, delta, meta, turn, cache, self._alibi, backend)
            if self.cfg.norm_placement != "post":
                _, x = backend.add_norm(self.norm, x, delta)
        return x

    def head(self, x: Tensor, backend: Backend = REFERENCE) -> Tensor:
        """(R, d) final hidden states -> their logits (R, V) (on every rank: a collective);
        backend: the one that soft-caps them (Gemma 2)."""
        # no head module: the embedding table, (R, V) or (R, vocab rows) on a rank
        logits = self.lm_head(x) if self.lm_head is not None else x @ self.embed.weight.t()
        if self.cfg.logits_scaling != 1.0:
            logits = logits / self.cfg.logits_scaling
        if (cap := self.cfg.final_logit_softcap) is not None:
            logits = backend.softcap(logits, cap)
        if self.tp is not None:
            return self.tp.gather_vocab(logits, self.cfg.vocab_size)
        return logits
