"""The KV block pool: free list, reference counts and prefix-cache hashes. Plain Python.

A full block is identified by a hash chained over every token before it, so equal
prefixes give equal hashes. When a request frees its blocks they keep their hash and stay
reusable by a later request with the same prefix until the pool needs them again: free
blocks are evicted least recently freed first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from service.engine.request import Request


def chain_hashes(token_ids: Sequence[int], block_size: int, known: list[int]) -> list[int]:
    """Extend `known` (hashes of the first full blocks) over every full block of token_ids."""
    hashes = list(known)
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else 0
        hashes.append(hash((parent, *token_ids[i * block_size : (i + 1) * block_size])))
    return hashes


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"num_blocks and block_size must be > 0, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block id
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU first
        self._hashes: dict[str, list[int]] = {}  # request id -> chained hashes of its full blocks
        self._registered: dict[str, int] = {}  # request id -> leading blocks already registered

    # ---- accounting -------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -----------------------------------------------------------------

    def lookup(self, request: Request) -> list[int]:
        """Cached blocks that hold a prefix of the request's tokens. At least one token is
        always left to compute, so the last hit is dropped when it would cover them all."""
        if not self.prefix_caching:
            return []
        hashes = self._request_hashes(request)
        hits: list[int] = []
        for h in hashes:
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        if hits and len(hits) * self.block_size >= request.num_tokens:
            hits.pop()
        return hits

    def _request_hashes(self, request: Request) -> list[int]:
        known = self._hashes.get(request.request_id, [])
        if len(known) < request.num_tokens // self.block_size:
            known = chain_hashes(request.token_ids, self.block_size, known)
            self._hashes[request.request_id] = known
        return known

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's computed full blocks so later requests can reuse them."""
        if not self.prefix_caching:
            return
        n_full = min(request.num_computed // self.block_size, len(request.block_table))
        start = self._registered.get(request.request_id, 0)
        if start >= n_full:  # the common decode step: no block filled up
            return
        self._registered[request.request_id] = n_full
        hashes = self._request_hashes(request)
        for i in range(start, n_full):
            block = request.block_table[i]
            if self.block_hash[block] is not None:
                continue
            if hashes[i] not in self.cached:
                self.cached[hashes[i]] = block
                self.block_hash[block] = hashes[i]

    # ---- allocation -------------------------------------------------------------------

    def can_allocate(self, hits: list[int], num_tokens: int) -> bool:
        """Can a waiting request reuse `hits` and get blocks for num_tokens in total?"""
        revived = sum(1 for b in hits if self.ref_count[b] == 0)
        return self.blocks_for(num_tokens) - len(hits) + revived <= self.num_free

    def allocate(self, request: Request, hits: list[int], num_tokens: int) -> None:
        if request.block_table:
            raise RuntimeError(f"request {request.request_id} already holds blocks")
        for b in hits:
            if self.ref_count[b] == 0:
                del self.free[b]
            self.ref_count[b] += 1
        request.block_table = list(hits)
        self._registered[request.request_id] = len(hits)  # hits are registered already
        self._grow(request, num_tokens)

    def can_append(self, request: Request, num_new: int) -> bool:
        need = self.blocks_for(request.num_computed + num_new) - len(request.block_table)
        return need <= self.num_free

    def append(self, request: Request, num_new: int) -> None:
        self._grow(request, request.num_computed + num_new)

    def _grow(self, request: Request, num_tokens: int) -> None:
        need = self.blocks_for(num_tokens) - len(request.block_table)
        if need > self.num_free:
            raise RuntimeError(f"out of KV blocks: need {need}, {self.num_free} free")
        for _ in range(need):
            request.block_table.append(self._take())

    def _take(self) -> int:
        block, _ = self.free.popitem(last=False)  # least recently freed
        old = self.block_hash[block]
        if old is not None:  # evict its cached contents
            if self.cached.get(old) == block:
                del self.cached[old]
            self.block_hash[block] = None
        self.ref_count[block] = 1
        return block

    def free_request(self, request: Request) -> None:
        """Release every block of the request (finish, abort or preemption)."""
        # Tail blocks first into the LRU, so a prefix's head outlives its tail.
        for block in reversed(request.block_table):
            self.ref_count[block] -= 1
            if self.ref_count[block] < 0:
                raise RuntimeError(f"block {block} freed twice")
            if self.ref_count[block] == 0:
                self.free[block] = None
        request.block_table = []
        self._registered.pop(request.request_id, None)

    def uncache_owned(self, request: Request) -> list[int]:
        """Drop the prefix-cache entries of the blocks only this request holds, and
        return them (for a request whose K/V cannot be trusted, e.g. non-finite values).
        Blocks shared with other requests are left alone."""
        owned = [b for b in request.block_table if self.ref_count[b] == 1]
        for block in owned:
            h = self.block_hash[block]
            if h is not None and self.cached.get(h) == block:
                del self.cached[h]
            self.block_hash[block] = None
        return owned

    def forget(self, request: Request) -> None:
        """Drop the per-request hash memo once the request is gone for good."""
        self._hashes.pop(request.request_id, None)
