"""The windowed layers' KV pool (PagedKVCache.window_data): Gemma 2 and 3's windowed
layers beside their global ones, or every layer of a model whose every layer is windowed
(Mistral, Phi-3 with sliding_window). Plain Python, driven by BlockManager.

A query at position p of a windowed layer sees keys p - window + 1 .. p, so a sequence
about to compute from position `start` on needs, in this pool, only the blocks from the
one holding key start - window + 1: the blocks before it are released as the sequence
moves on, and never taken for a prompt that starts past them (a prefix-cache hit). Its
`window_table` has an entry for every block of its context, the pool's null block for
those it does not hold; the global layers' table holds them all (with every layer
windowed, block ids that hold no K/V: they chain the prefix cache's entries).

Released blocks keep their prefix-cache key until the pool needs them again, as
BlockManager's do. A cached block is trusted only for the same key, the same tokens and
the same global block under it: each carries the entry id of the global block of its
position when it was registered (never reused, so an evicted and refilled global block
does not match), and a hit of the global chain is a hit here only if that is the entry.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from service.engine.request import Request


class WindowBlocks:
    def __init__(self, num_blocks: int, block_size: int, window: int, prefix_caching: bool):
        if num_blocks <= 0 or window <= 0:
            raise ValueError(f"num_blocks and window must be > 0, got {num_blocks}, {window}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.window = window
        self.prefix_caching = prefix_caching
        self.null = num_blocks  # PagedKVCache.window_null_block: a table entry not held
        self.ref_count = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU first
        self.cached: dict[bytes, int] = {}  # key -> block id
        # what a cached block holds, checked on every hit: its key, its tokens, the entry
        # id of the global block of its position
        self.block_key: list[bytes | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.block_anchor: list[int | None] = [None] * num_blocks
        self._registered: dict[str, int] = {}  # request id -> leading blocks registered

    @property
    def num_free(self) -> int:
        return len(self.free)

    def first_needed(self, start: int) -> int:
        """The first block that queries from position `start` on see."""
        return max(0, start - self.window + 1) // self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def held_by(self, num_tokens: int) -> int:
        """The blocks a sequence of num_tokens holds here as it computes its last one."""
        return self.blocks_for(num_tokens) - self.first_needed(num_tokens - 1)

    # ---- prefix cache -----------------------------------------------------------------

    def usable_hits(
        self, keys: Sequence[bytes], tokens: Sequence[tuple[int, ...]], anchors: Sequence[int]
    ) -> tuple[int, list[int]]:
        """Of a prompt's global hits (their keys, tokens and global entries, in order), how
        many the windowed layers can start after, and this pool's blocks for the window
        of their end: the most m whose blocks first_needed(m * block_size) .. m - 1 are
        cached here (0 hits need none)."""
        if not self.prefix_caching:
            return 0, []
        found = [self._match(k, t, a) for k, t, a in zip(keys, tokens, anchors, strict=True)]
        best, run = 0, 0  # run: cached blocks in a row, ending at block m - 1
        for m, block in enumerate(found, 1):
            run = run + 1 if block is not None else 0
            if run >= m - self.first_needed(m * self.block_size):
                best = m
        return best, found[self.first_needed(best * self.block_size) : best]  # type: ignore[return-value]

    def _match(self, key: bytes, tokens: tuple[int, ...], anchor: int) -> int | None:
        block = self.cached.get(key)
        if block is None or self.block_tokens[block] != tokens:
            return None
        return block if self.block_anchor[block] == anchor else None

    def cache_full_blocks(
        self,
        request: Request,
        keys: Sequence[bytes],
        anchor: Callable[[bytes], int | None],
    ) -> None:
        """Register the request's computed full blocks it holds here (keys: those of its
        first full blocks; anchor: the entry id of the global block cached under a key,
        None where none is)."""
        if not self.prefix_caching:
            return
        n_full = min(request.num_computed // self.block_size, len(keys))
        start = self._registered.get(request.request_id, 0)
        for i in range(start, n_full):
            block = request.window_table[i]
            if block == self.null or self.block_key[block] is not None:
                continue
            anchor_id = anchor(keys[i])
            if anchor_id is None or keys[i] in self.cached:  # none, or cached already
                continue
            self.cached[keys[i]] = block
            self.block_key[block] = keys[i]
            self.block_tokens[block] = tuple(
                request.tokens(i * self.block_size, (i + 1) * self.block_size)
            )
            self.block_anchor[block] = anchor_id
        self._registered[request.request_id] = max(start, n_full)

    # ---- allocation -------------------------------------------------------------------

    def can_allocate(self, hits: list[int], start: int, num_tokens: int, reserve: int) -> bool:
        """Room for a prompt that reuses `hits` (the window of its first `start` tokens)
        and computes up to num_tokens, leaving `reserve` blocks free?"""
        fresh = self.blocks_for(num_tokens) - self.first_needed(start) - len(hits)
        revived = sum(1 for b in hits if self.ref_count[b] == 0)
        return fresh + revived + reserve <= self.num_free

    def allocate(self, request: Request, hits: list[int], start: int, num_tokens: int) -> None:
        """hits: this pool's blocks for the window of the first `start` tokens (a multiple
        of the block size: the global hits' end), from usable_hits."""
        first = self.first_needed(start)
        if first + len(hits) != start // self.block_size:
            raise ValueError(f"{len(hits)} window hits for {start} cached tokens")
        for b in hits:
            if self.ref_count[b] == 0:
                del self.free[b]
            self.ref_count[b] += 1
        request.window_table = [self.null] * first + list(hits)
        self._registered[request.request_id] = first + len(hits)
        self._grow(request, num_tokens)

    def can_append(self, request: Request, num_new: int) -> bool:
        start = request.num_computed
        need = self.blocks_for(start + num_new) - len(request.window_table)
        released = sum(1 for b in self._behind(request, start) if self.ref_count[b] == 1)
        return need <= self.num_free + released

    def append(self, request: Request, num_new: int) -> None:
        """Release the blocks behind the window of the step's first query, then take the
        blocks its new tokens need."""
        start = request.num_computed
        first = self.first_needed(start)
        for i in range(first):
            block = request.window_table[i]
            if block != self.null:
                self._release(block)
                request.window_table[i] = self.null
        self._grow(request, start + num_new)

    def _behind(self, request: Request, start: int) -> list[int]:
        """The blocks the request holds behind the window of a step from `start`."""
        return [b for b in request.window_table[: self.first_needed(start)] if b != self.null]

    def _grow(self, request: Request, num_tokens: int) -> None:
        need = self.blocks_for(num_tokens) - len(request.window_table)
        if need > self.num_free:
            raise RuntimeError(f"out of window KV blocks: need {need}, {self.num_free} free")
        for _ in range(need):
            block, _ = self.free.popitem(last=False)  # least recently freed
            self._uncache(block)
            self.ref_count[block] = 1
            request.window_table.append(block)

    def _release(self, block: int) -> None:
        self.ref_count[block] -= 1
        if self.ref_count[block] < 0:
            raise RuntimeError(f"window block {block} freed twice")
        if self.ref_count[block] == 0:
            self.free[block] = None

    def _uncache(self, block: int) -> None:
        key = self.block_key[block]
        if key is not None and self.cached.get(key) == block:
            del self.cached[key]
        self.block_key[block] = self.block_tokens[block] = self.block_anchor[block] = None

    def free_request(self, request: Request) -> None:
        for block in reversed(request.window_table):  # tail first, as BlockManager
            if block != self.null:
                self._release(block)
        request.window_table = []
        self._registered.pop(request.request_id, None)

    def uncache_owned(self, request: Request) -> list[int]:
        owned = [b for b in request.window_table if b != self.null and self.ref_count[b] == 1]
        for block in owned:
            self._uncache(block)
        return owned
