"""What attention needs about one step's flattened batch (AttentionMetadata).

One forward runs a flattened batch of T new tokens from B sequences, each contributing
`query_len` tokens (a prefill chunk, or 1 for a decode) on top of what it already has
cached; token t of a sequence lives in cache slot
`block_table[t // block_size] * block_size + t % block_size`. The model itself never sees
the scheduler: this is all it is told.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate, chain

import torch
from torch import Tensor


@dataclass(slots=True)
class AttentionMetadata:
    """What attention needs about one step's flattened batch. The fields every backend
    reads are built up front; the padded dense view (mask, q_pos, q_index), which only
    the `torch` reference reads, is built the first time it is asked for."""

    positions: Tensor  # (T,) absolute position of every new token
    query_lens: list[int]  # new tokens per sequence, sums to T
    seq_lens: list[int]  # context per sequence after this step (cached + new)
    slot_mapping: Tensor | None = None  # (T,) flat cache slot of each new token, -1: none
    slot_blocks: Tensor | None = None  # (T,) slot_mapping // block_size
    slot_offsets: Tensor | None = None  # (T,) slot_mapping % block_size
    block_tables: Tensor | None = None  # (B, max_blocks) block ids, padded with the null block
    row_lens: Tensor | None = None  # (T,) keys each new token sees: its position + 1
    row_seq: Tensor | None = None  # (T,) sequence of each new token; None: one per sequence
    # each sequence's prompt length, where the engine gives it (LongRoPE turns a prompt
    # past the pretraining length otherwise: Transformer.rope_rows)
    prompt_lens: list[int] | None = None
    # the triton backend's int32 view of the batch (model/backends/triton/backend.py fills them)
    query_start: Tensor | None = None  # (B + 1,) first row of each sequence
    seq_lens_t: Tensor | None = None  # (B,) seq_lens on the device
    _dense: tuple[Tensor, Tensor, Tensor | None] | None = None  # mask, q_pos, q_index
    _alibi: Tensor | None = None  # the ALiBi bias, built once per forward
    _groups: list[tuple[Tensor, AttentionMetadata]] | None = None  # see groups()
    # the windowed layers' metadata where they keep their K/V in a pool of their own
    # (PagedKVCache.window_data): the same rows, that pool's slots and block tables
    window: AttentionMetadata | None = None
    # what a backend derives from the step once and reads in every layer (its key names
    # the backend and what it is, e.g. a sliding window's view of the block tables)
    memo: dict[object, object] = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.positions.device

    def _dense_view(self) -> tuple[Tensor, Tensor, Tensor | None]:
        if self._dense is None:
            self._dense = _dense_view(self.query_lens, self.seq_lens, self.device)
        return self._dense

    @property
    def mask(self) -> Tensor:
        """(B, max_q, max_seq) bool: query i of sequence b may see key j."""
        return self._dense_view()[0]

    @property
    def q_pos(self) -> Tensor:
        """(B, max_q) absolute position of each (padded) query row."""
        return self._dense_view()[1]

    @property
    def q_index(self) -> Tensor | None:
        """(T,) row in the padded (B * max_q) layout; None: no padding."""
        if min(self.query_lens) == max(self.query_lens):
            return None
        return self._dense_view()[2]

    def alibi(self, slopes: Tensor) -> Tensor:
        if self._alibi is None:
            self._alibi = alibi_bias(self, slopes)
        return self._alibi

    def groups(self, block_size: int) -> list[tuple[Tensor, AttentionMetadata]]:
        """The batch split so that padding stays small: the decodes together, each longer
        query alone. (token rows, metadata of those sequences) per group, built once per
        forward. For the torch reference backend, which pads queries."""
        if self._groups is None:
            starts = [0, *accumulate(self.query_lens)]
            decodes = [i for i, n in enumerate(self.query_lens) if n == 1]
            longer = [[i] for i, n in enumerate(self.query_lens) if n > 1]
            self._groups = []
            for seqs in ([decodes] if decodes else []) + longer:
                rows = [r for i in seqs for r in range(starts[i], starts[i + 1])]
                self._groups.append(
                    (torch.tensor(rows, device=self.device), self.select(seqs, block_size))
                )
        return self._groups

    def select(self, seqs: list[int], block_size: int) -> AttentionMetadata:
        """Attention metadata of some of the batch's sequences (their block tables cut to
        the blocks they use)."""
        query = [self.query_lens[i] for i in seqs]
        cached = [self.seq_lens[i] - n for i, n in zip(seqs, query, strict=True)]
        sub = AttentionMetadata._build(cached, query, self.device)
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
        return max(self.query_lens)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens)

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
        _check_lens(cached_lens, query_lens)
        positions: list[int] = []
        slots: list[int] = []
        for table, start, n in zip(block_tables, cached_lens, query_lens, strict=True):
            if (start + n + block_size - 1) // block_size > len(table):
                raise ValueError(
                    f"block table of {len(table)} blocks cannot hold {start + n} tokens"
                )
            span = range(start, start + n)
            positions.extend(span)
            slots.extend(table[p // block_size] * block_size + p % block_size for p in span)
        width = max(len(t) for t in block_tables)
        # every index of the step in one tensor (one host -> device copy), viewed per field
        fields = [
            positions,
            slots,
            [s // block_size for s in slots],
            [s % block_size for s in slots],
            [p + 1 for p in positions],
        ]
        if max(query_lens) > 1:  # the sequence of each row (decodes: row b is sequence b)
            fields.append([b for b, n in enumerate(query_lens) for _ in range(n)])
        for t in block_tables:
            fields += [t, [pad_block] * (width - len(t))]
        flat = torch.tensor(list(chain.from_iterable(fields)), dtype=torch.long).to(device)
        n_rows = len(fields) - 2 * len(block_tables)
        rows = flat[: n_rows * len(positions)].view(n_rows, -1)
        return cls(
            positions=rows[0],
            query_lens=list(query_lens),
            seq_lens=[c + q for c, q in zip(cached_lens, query_lens, strict=True)],
            slot_mapping=rows[1],
            slot_blocks=rows[2],
            slot_offsets=rows[3],
            block_tables=flat[rows.numel() :].view(-1, width),
            row_lens=rows[4],
            row_seq=rows[5] if n_rows > 5 else None,
        )

    @classmethod
    def _build(
        cls, cached_lens: Sequence[int], query_lens: Sequence[int], device: torch.device | str
    ) -> AttentionMetadata:
        _check_lens(cached_lens, query_lens)
        seq_lens = [c + q for c, q in zip(cached_lens, query_lens, strict=True)]
        # whole-batch ops, not one arange per sequence (a host cost paid every step)
        cached_t = torch.tensor(list(cached_lens), dtype=torch.long)
        row_seq = None
        if max(query_lens) == 1:
            positions = cached_t.clone()
        else:
            q_t = torch.tensor(list(query_lens), dtype=torch.long)
            row_seq = torch.repeat_interleave(torch.arange(len(query_lens)), q_t)
            # token i of sequence b sits at cached_b + (i - first_b)
            positions = torch.arange(len(row_seq)) + (cached_t - (q_t.cumsum(0) - q_t))[row_seq]
        return cls(
            positions=positions.to(device),
            query_lens=list(query_lens),
            seq_lens=seq_lens,
            row_seq=row_seq.to(device) if row_seq is not None else None,
        )


def _check_lens(cached_lens: Sequence[int], query_lens: Sequence[int]) -> None:
    if len(cached_lens) != len(query_lens) or not query_lens:
        raise ValueError("need one cached length and one query length per sequence")
    if min(query_lens) <= 0:
        raise ValueError("every sequence needs at least one new token")


def _dense_view(
    query_lens: Sequence[int], seq_lens: Sequence[int], device: torch.device
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The batch padded to its longest query: the mask (B, max_q, max_seq), each padded
    row's position (B, max_q), and each real row's index in the padding (T,) or None."""
    max_q, max_s = max(query_lens), max(seq_lens)
    cached_t = torch.tensor([s - q for s, q in zip(seq_lens, query_lens, strict=True)])
    seq_t = torch.tensor(list(seq_lens))
    q_pos = cached_t[:, None] + torch.arange(max_q)[None, :]  # (B, max_q)
    k_pos = torch.arange(max_s)
    # Padded query rows (i >= query_len) still see every valid key, so no row is empty.
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (
        k_pos[None, None, :] < seq_t[:, None, None]
    )
    q_index = None
    if min(query_lens) != max_q:
        q_index = torch.tensor(
            [b * max_q + i for b, q in enumerate(query_lens) for i in range(q)], dtype=torch.long
        ).to(device)
    return mask.to(device), q_pos.to(device), q_index


def alibi_bias(meta: AttentionMetadata, slopes: Tensor) -> Tensor:
    """(B, H, max_q, max_seq) additive bias: -slope * distance, -inf where masked."""
    k_pos = torch.arange(meta.max_seq_len, device=meta.q_pos.device)
    dist = (meta.q_pos[:, :, None] - k_pos[None, None, :]).float()  # (B, max_q, S)
    bias = -slopes.to(dist.device)[None, :, None, None] * dist[:, None]
    return bias.masked_fill(~meta.mask[:, None], float("-inf"))
