"""Attention over a paged KV cache.

The cache is a pool of fixed-size blocks per layer. A sequence owns an append-only list of
block ids (its block table); token t of the sequence lives in slot
`block_table[t // block_size] * block_size + t % block_size`. One forward runs a flattened
batch of T new tokens from B sequences, each contributing `query_len` tokens (a prefill
chunk, or 1 for a decode) on top of what it already has cached. AttentionMetadata carries
everything attention needs about that batch; the model itself never sees the scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.config import ModelConfig
from model.kernels import (
    fused_supported,
    paged_attention,
    paged_attention_supported,
    rope_store,
)
from model.layers import Linear, apply_rope


class PagedKVCache:
    """K and V block pools for every layer.

    Layouts per layer, with P = 1 for float32 and 2 for bfloat16 (elements per 32-bit
    lane): K (num_blocks, KV, D / P, BS, P) and V (num_blocks, KV, BS / P, D, P). Keys are
    stored channel-major inside a block so that the attention kernel scores a whole block
    of tokens with one vector instruction per channel; values token-major so that it
    accumulates them along the channel. In bfloat16, pairs of channels (K) and of tokens
    (V) share a lane: that is the AMX tile unit's B operand for q.k and p.v. Both hold
    KV * BS * D elements per block.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"num_blocks and block_size must be > 0, got {num_blocks}, {block_size}"
            )
        self.pair = 2 if dtype.itemsize == 2 else 1
        if block_size % self.pair or cfg.head_dim % self.pair:
            raise ValueError(
                f"a {dtype} KV cache needs an even block size and head size, "
                f"got {block_size} and {cfg.head_dim}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.n_kv, self.d_head = cfg.kv_heads, cfg.head_dim
        # one more block than asked: the null block, always zero and never handed out,
        # pads block tables so padding never reads another request's K/V
        shape = (2, cfg.n_layers, num_blocks + 1, cfg.kv_heads, block_size * cfg.head_dim)
        self.data = torch.zeros(shape, dtype=dtype, device=device)
        nb, kv, bs, d, p = num_blocks + 1, cfg.kv_heads, block_size, cfg.head_dim, self.pair
        self._layers = [  # views made once: a decode step asks for each layer's
            (
                self.data[0, i].view(nb, kv, d // p, bs, p),
                self.data[1, i].view(nb, kv, bs // p, d, p),
            )
            for i in range(cfg.n_layers)
        ]

    @property
    def null_block(self) -> int:
        return self.num_blocks

    def layer(self, i: int) -> tuple[Tensor, Tensor]:
        """Layer i's K (nb, KV, D / P, BS, P) and V (nb, KV, BS / P, D, P) views of `data`."""
        return self._layers[i]

    @property
    def block_nbytes(self) -> int:
        """K and V of one block across all layers."""
        return self.data[:, :, 0].numel() * self.data.element_size()

    @property
    def nbytes(self) -> int:
        """The pool that requests can use (the null block not counted)."""
        return self.num_blocks * self.block_nbytes


@dataclass(slots=True)
class AttentionMetadata:
    positions: Tensor  # (T,) absolute position of every new token
    query_lens: list[int]  # new tokens per sequence, sums to T
    seq_lens: list[int]  # context per sequence after this step (cached + new)
    mask: Tensor  # (B, max_q, max_seq) bool: query i of seq b may see key j
    q_pos: Tensor  # (B, max_q) absolute position of each (padded) query row
    slot_mapping: Tensor | None = None  # (T,) flat cache slot of each new token
    slot_blocks: Tensor | None = None  # (T,) slot_mapping // block_size
    slot_offsets: Tensor | None = None  # (T,) slot_mapping % block_size
    block_tables: Tensor | None = None  # (B, max_blocks) block ids, padded with 0
    row_lens: Tensor | None = None  # (T,) keys each new token sees: its position + 1
    row_seq: Tensor | None = None  # (T,) sequence of each new token; None: one per sequence
    q_index: Tensor | None = None  # (T,) row in the padded (B * max_q) layout; None: no padding
    _alibi: Tensor | None = None  # the ALiBi bias, built once per forward
    _groups: list[tuple[Tensor, AttentionMetadata]] | None = None  # see groups()

    def alibi(self, slopes: Tensor) -> Tensor:
        if self._alibi is None:
            self._alibi = alibi_bias(self, slopes)
        return self._alibi

    def groups(self, block_size: int) -> list[tuple[Tensor, AttentionMetadata]]:
        """The batch split so that padding stays small: the decodes together, each longer
        query alone. (token rows, metadata of those sequences) per group, built once per
        forward. For the attention path that pads queries (no C kernel: CUDA, no compiler)."""
        if self._groups is None:
            starts = [0, *accumulate(self.query_lens)]
            decodes = [i for i, n in enumerate(self.query_lens) if n == 1]
            longer = [[i] for i, n in enumerate(self.query_lens) if n > 1]
            self._groups = []
            for seqs in ([decodes] if decodes else []) + longer:
                rows = [r for i in seqs for r in range(starts[i], starts[i + 1])]
                self._groups.append(
                    (torch.tensor(rows, device=self.mask.device), self.select(seqs, block_size))
                )
        return self._groups

    def select(self, seqs: list[int], block_size: int) -> AttentionMetadata:
        """Attention metadata of some of the batch's sequences (their block tables cut to
        the blocks they use)."""
        query = [self.query_lens[i] for i in seqs]
        cached = [self.seq_lens[i] - n for i, n in zip(seqs, query, strict=True)]
        sub = AttentionMetadata._build(cached, query, self.mask.device)
        assert self.block_tables is not None, "select() needs paged metadata"
        width = -(-sub.max_seq_len // block_size)
        index = torch.tensor(seqs, device=self.block_tables.device)
        sub.block_tables = self.block_tables.index_select(0, index)[:, :width].contiguous()
        return sub

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def max_query_len(self) -> int:
        return self.mask.shape[1]

    @property
    def max_seq_len(self) -> int:
        return self.mask.shape[2]

    @classmethod
    def dense(cls, num_tokens: int, device: torch.device | str = "cpu") -> AttentionMetadata:
        """One sequence of `num_tokens` new tokens, no cache: plain causal attention."""
        return cls._build([0], [num_tokens], device)

    @classmethod
    def paged(
        cls,
        block_tables: Sequence[Sequence[int]],
        cached_lens: Sequence[int],
        query_lens: Sequence[int],
        block_size: int,
        device: torch.device | str = "cpu",
        pad_block: int = 0,
    ) -> AttentionMetadata:
        """A batch over the paged cache: sequence b already has cached_lens[b] tokens and
        adds query_lens[b] new ones; its block table must cover the new total. Shorter
        tables are padded with `pad_block` (PagedKVCache.null_block when serving)."""
        meta = cls._build(cached_lens, query_lens, device)
        slots: list[int] = []
        for table, start, n in zip(block_tables, cached_lens, query_lens, strict=True):
            if (start + n + block_size - 1) // block_size > len(table):
                raise ValueError(
                    f"block table of {len(table)} blocks cannot hold {start + n} tokens"
                )
            slots.extend(
                table[p // block_size] * block_size + p % block_size
                for p in range(start, start + n)
            )
        width = max(len(t) for t in block_tables)
        padded = [list(t) + [pad_block] * (width - len(t)) for t in block_tables]
        meta.slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
        meta.slot_blocks = meta.slot_mapping // block_size
        meta.slot_offsets = meta.slot_mapping % block_size
        meta.block_tables = torch.tensor(padded, dtype=torch.long, device=device)
        meta.row_lens = meta.positions + 1
        return meta

    @classmethod
    def _build(
        cls, cached_lens: Sequence[int], query_lens: Sequence[int], device: torch.device | str
    ) -> AttentionMetadata:
        if len(cached_lens) != len(query_lens) or not query_lens:
            raise ValueError("need one cached length and one query length per sequence")
        if min(query_lens) <= 0:
            raise ValueError("every sequence needs at least one new token")
        seq_lens = [c + q for c, q in zip(cached_lens, query_lens, strict=True)]
        max_q, max_s = max(query_lens), max(seq_lens)
        # a handful of whole-batch ops, not one arange per sequence: building a 64-sequence
        # decode step's metadata took 259 us with those, 162 us without
        cached_t = torch.tensor(list(cached_lens), dtype=torch.long)
        seq_t = torch.tensor(seq_lens, dtype=torch.long)
        row_seq = None
        if max_q == 1:
            positions = cached_t.clone()
        else:
            q_t = torch.tensor(list(query_lens), dtype=torch.long)
            row_seq = torch.repeat_interleave(torch.arange(len(query_lens)), q_t)
            # token i of sequence b sits at cached_b + (i - first_b)
            positions = torch.arange(len(row_seq)) + (cached_t - (q_t.cumsum(0) - q_t))[row_seq]
        q_pos = cached_t[:, None] + torch.arange(max_q)[None, :]  # (B, max_q)
        k_pos = torch.arange(max_s)
        # Padded query rows (i >= query_len) still see every valid key, so no row is empty.
        mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (
            k_pos[None, None, :] < seq_t[:, None, None]
        )
        q_index = None
        if min(query_lens) != max_q:
            q_index = torch.tensor(
                [b * max_q + i for b, q in enumerate(query_lens) for i in range(q)],
                dtype=torch.long,
            ).to(device)
        return cls(
            positions=positions.to(device),
            query_lens=list(query_lens),
            seq_lens=seq_lens,
            mask=mask.to(device),
            q_pos=q_pos.to(device),
            q_index=q_index,
            row_seq=row_seq.to(device) if row_seq is not None else None,
        )


def alibi_bias(meta: AttentionMetadata, slopes: Tensor) -> Tensor:
    """(B, H, max_q, max_seq) additive bias: -slope * distance, -inf where masked."""
    k_pos = torch.arange(meta.max_seq_len, device=meta.q_pos.device)
    dist = (meta.q_pos[:, :, None] - k_pos[None, None, :]).float()  # (B, max_q, S)
    bias = -slopes.to(dist.device)[None, :, None, None] * dist[:, None]
    return bias.masked_fill(~meta.mask[:, None], float("-inf"))


class Attention(nn.Module):
    """Multi-head attention with grouped K/V heads (MHA, GQA, MQA), fused QKV projection."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.d_head = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        qkv_out = (self.n_heads + 2 * self.n_kv) * self.d_head
        self.wqkv = Linear(cfg.d_model, qkv_out, bias=cfg.qkv_bias)
        self.wo = Linear(self.n_heads * self.d_head, cfg.d_model, bias=cfg.attn_out_bias)

    def forward(
        self,
        x: Tensor,
        meta: AttentionMetadata,
        rope: tuple[Tensor, Tensor] | None,
        cache: tuple[Tensor, Tensor] | None,
        alibi_slopes: Tensor | None,
    ) -> Tensor:
        """x: (T, d) -> (T, d). RoPE is applied to q and k; new K/V are written to the cache."""
        t, h, kv, dh = x.shape[0], self.n_heads, self.n_kv, self.d_head
        qkv = self.wqkv(x)  # (T, (H + 2KV) * dh)
        stored = fused_supported(qkv) and (cache is None or meta.slot_blocks is not None)
        if stored:  # one pass: rotate q and k in place, write k and v into their slots
            rope_store(qkv, rope, h, kv, dh, cache, meta.slot_blocks, meta.slot_offsets)
            qkv = qkv.view(t, h + 2 * kv, dh)
            q, k, v = qkv[:, :h], qkv[:, h : h + kv], qkv[:, h + kv :]
        else:
            qkv = qkv.view(t, h + 2 * kv, dh)
            qk, v = qkv[:, : h + kv], qkv[:, h + kv :]
            if rope is not None:  # one rotation for the query and key heads together
                qk = apply_rope(qk, *rope)
            q, k = qk[:, :h], qk[:, h:]
        return self.wo(self.attend(q, k, v, meta, cache, alibi_slopes, stored))

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        meta: AttentionMetadata,
        cache: tuple[Tensor, Tensor] | None,
        alibi_slopes: Tensor | None,
        stored: bool = False,
    ) -> Tensor:
        """q: (T, H, dh), k/v: (T, KV, dh) for the new tokens -> (T, H * dh).
        Writes k and v into the cache unless `stored` says that is done."""
        if cache is None:
            keys, values = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        else:
            k_cache, v_cache = cache  # (nb, KV, dh / P, BS, P), (nb, KV, BS / P, dh, P)
            if not stored:
                pair, blocks, offsets = k_cache.shape[-1], meta.slot_blocks, meta.slot_offsets
                k_cache[blocks, :, :, offsets, :] = k.reshape(
                    -1, self.n_kv, self.d_head // pair, pair
                )
                v_cache[blocks, :, offsets // pair, :, offsets % pair] = v
            if paged_attention_supported(k_cache, self.n_heads, self.n_kv, self.d_head):
                out = paged_attention(
                    q,
                    k_cache,
                    v_cache,
                    meta.block_tables,
                    meta.row_lens,
                    self.d_head**-0.5,
                    alibi_slopes,
                    meta.row_seq,
                )  # (T, H, dh) in the cache's dtype
                return out.to(q.dtype).view(q.shape[0], self.n_heads * self.d_head)
            if meta.q_index is not None:  # mixed query lengths: pad within groups only
                out = q.new_empty(q.shape[0], self.n_heads * self.d_head)
                for rows, sub in meta.groups(k_cache.shape[-2]):
                    keys, values = _gather(k_cache, v_cache, sub)
                    out[rows] = self._sdpa(q.index_select(0, rows), keys, values, sub, alibi_slopes)
                return out
            keys, values = _gather(k_cache, v_cache, meta)
        return self._sdpa(q, keys, values, meta, alibi_slopes)

    def _sdpa(
        self,
        q: Tensor,
        keys: Tensor,
        values: Tensor,
        meta: AttentionMetadata,
        alibi_slopes: Tensor | None,
    ) -> Tensor:
        """q (T, H, dh) of meta's sequences, padded to its longest query, against keys and
        values (B, KV, max_seq_len, dh) -> (T, H * dh)."""
        b, max_q, group = meta.num_seqs, meta.max_query_len, self.n_heads // self.n_kv
        if meta.q_index is None:
            qp = q.view(b, max_q, self.n_heads, self.d_head)
        else:
            qp = q.new_zeros(b * max_q, self.n_heads, self.d_head)
            qp.index_copy_(0, meta.q_index, q)
            qp = qp.view(b, max_q, self.n_heads, self.d_head)
        # Fold the query heads that share a K/V head into the row axis, so K/V are never
        # repeated: (B, max_q, KV*G, dh) -> (B, KV, G*max_q, dh).
        qg = qp.view(b, max_q, self.n_kv, group, self.d_head).permute(0, 2, 3, 1, 4)
        qg = qg.reshape(b, self.n_kv, group * max_q, self.d_head)
        bias = meta.alibi(alibi_slopes) if alibi_slopes is not None else None
        if bias is None:
            mask = meta.mask[:, None, None].expand(b, 1, group, max_q, meta.max_seq_len)
            mask = mask.reshape(b, 1, group * max_q, meta.max_seq_len)
        else:  # (B, H, max_q, S) -> (B, KV, G*max_q, S)
            mask = bias.to(q.dtype).reshape(b, self.n_kv, group * max_q, meta.max_seq_len)
        out = F.scaled_dot_product_attention(
            qg, keys, values, attn_mask=mask
        )  # (B, KV, G*max_q, dh)
        out = out.view(b, self.n_kv, group, max_q, self.d_head).permute(0, 3, 1, 2, 4)
        out = out.reshape(b * max_q, self.n_heads * self.d_head)
        return out if meta.q_index is None else out.index_select(0, meta.q_index)


def _gather(k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata) -> tuple[Tensor, Tensor]:
    """Each sequence's cached K and V, contiguous: (B, KV, max_seq_len, dh) each."""
    b, s = meta.num_seqs, meta.max_seq_len
    flat = meta.block_tables.view(-1)  # index_select copies whole contiguous blocks
    _, kv, dp, bs, p = k_cache.shape
    d = dp * p
    # K (B, nblk, KV, D/P, BS, P) -> (B, KV, nblk, BS, D/P, P); V (B, nblk, KV, BS/P, D, P)
    # -> (B, KV, nblk, BS/P, P, D)
    keys = k_cache.index_select(0, flat).view(b, -1, kv, dp, bs, p).permute(0, 2, 1, 4, 3, 5)
    values = v_cache.index_select(0, flat).view(b, -1, kv, bs // p, d, p)
    values = values.permute(0, 2, 1, 3, 5, 4)
    return keys.reshape(b, kv, -1, d)[:, :, :s], values.reshape(b, kv, -1, d)[:, :, :s]
