"""The KV block pool: free list, reference counts and the prefix cache. Plain Python.

A full block is keyed by SHA-256 chained over every token before it, from a root that
names the model, the request's cache_salt and its LoRA adapter: equal prefixes under
the same salt and adapter give equal keys, and nobody can construct a prompt whose key equals another user's. A hit is
trusted only after a check that does not depend on the hash at all: the cached block
holds exactly the request's tokens for that block, and was computed on top of exactly
the block the request matched one level up (entries carry a never-reused id, so a parent
that was evicted and refilled does not match). When a request frees its blocks they keep
their key and stay reusable until the pool needs them again: free blocks are evicted
least recently freed first; with a host tier (service/engine/kv/host_tier.py) an evicted
cached block is copied out there, and a hit on it copied back into a fresh block. A
cached block's record (prefix_keys.Cached) is all the pool keeps of it besides its
reference count.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from itertools import count

from msgspec.structs import replace

from service.engine.kv.disk_tier import Link
from service.engine.kv.host_tier import Copies, HostTier
from service.engine.kv.kv_events import QUIET, Quiet
from service.engine.kv.prefix_keys import Cached, Hit, Hits, chain_hashes, root_digest
from service.engine.kv.window_blocks import WindowBlocks
from service.engine.request import Request


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        namespace: str = "",
        windows: WindowBlocks | None = None,
        tier: HostTier | None = None,
        events: Quiet = QUIET,
    ) -> None:
        """namespace: what, besides the tokens, the KV depends on (the model): part of
        every key. windows: the windowed layers' own pool, where they have one
        (PagedKVCache.window_data): every method here keeps it in step. tier: where
        evicted cached blocks go (not beside a window pool). events: where what the
        prefix cache stores and evicts is reported (--kv-events-endpoint: KVEvents)."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"num_blocks and block_size must be > 0, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.namespace = namespace
        self.windows = windows
        if tier is not None and (windows is not None or not enable_prefix_caching):
            raise ValueError("a host tier needs the prefix cache and no window pool")
        self.tier = tier
        self.events = events
        # each cached block's record (None: the block holds no cached prefix)
        self.records: list[Cached | None] = [None] * num_blocks
        self._entries = count()  # entry ids are never reused
        self.cached: dict[bytes, int] = {}  # key -> block id
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU first
        self._hashes: dict[str, list[bytes]] = {}  # request id -> keys of its full blocks
        # request id -> (leading blocks already registered, the entry the next one sits on)
        self._registered: dict[str, tuple[int, int | bytes | None]] = {}

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

    def lookup(self, request: Request) -> Hits:
        """Cached blocks that hold a prefix of the request's tokens: the device pool's,
        else the tier's. At least one token is always left to compute, so the last hit is
        dropped when it would cover them all; with a window pool, hits past the last whose
        window is cached there too. Blocks past the hits that the disk holds are read
        ahead, and the hits say `loading` while the first of them is."""
        if not self.prefix_caching:
            return Hits()
        hashes, root = self._request_hashes(request), self._root(request)
        hits: list[Hit] = []
        parent: int | bytes | None = root
        for i, key in enumerate(hashes):
            hit = self._hit(key, self._tokens(request, i), parent, hashes[i - 1] if i else root)
            if hit is None:
                break
            hits.append(hit)
            parent = self._record(hit).entry
        tier, rest = self.tier, len(hits) < len(hashes)
        if rest and tier is not None and tier.prefetch(self._chain(request, hashes, len(hits))):
            return Hits(hits, loading=True)
        if hits and len(hits) * self.block_size >= request.num_tokens:
            hits.pop()
        if self.windows is None or not hits:
            return Hits(hits)
        keys = hashes[: len(hits)]
        records = [self._record(b) for b in hits]
        tokens, anchors = [r.tokens for r in records], [r.entry for r in records]
        m, window = self.windows.usable_hits(keys, tokens, anchors)  # type: ignore[arg-type]
        return Hits(hits[:m], window)

    def _hit(
        self, key: bytes, tokens: tuple[int, ...], parent: int | bytes | None, parent_key: bytes
    ) -> Hit | None:
        """The device block cached under `key` for these tokens on `parent`, else the
        tier's entry (one read from disk given an entry id of this run's)."""
        block = self._match(key, tokens, parent)
        if block is not None or self.tier is None:
            return block
        cached = self.tier.match(key, tokens, parent, parent_key)
        if cached is not None and cached.entry is None:
            cached = replace(cached, entry=next(self._entries))
        return cached

    def _record(self, hit: Hit) -> Cached:
        record = hit if isinstance(hit, Cached) else self.records[hit]
        assert record is not None
        return record

    def _chain(self, request: Request, hashes: list[bytes], start: int) -> Iterator[Link]:
        """The request's blocks from `start` on, as the disk tier reads them."""
        root = self._root(request)
        for i in range(start, len(hashes)):
            yield hashes[i], hashes[i - 1] if i else root, self._tokens(request, i)

    def _root(self, request: Request) -> bytes:
        return root_digest(self.namespace, request.params.cache_salt, request.lora_key)

    def _tokens(self, request: Request, i: int) -> tuple[int, ...]:
        return tuple(request.tokens(i * self.block_size, (i + 1) * self.block_size))

    def _match(self, key: bytes, tokens: tuple[int, ...], parent: int | bytes | None) -> int | None:
        """The cached block under `key`, if it holds exactly these tokens on top of
        exactly `parent` (an entry id, or the root key for a first block)."""
        block = self.cached.get(key)
        if block is None or parent is None:
            return None
        record = self.records[block]
        if record is None or record.tokens != tokens or record.parent != parent:
            return None  # a collision, forged or not: not this request's KV
        return block

    def _request_hashes(self, request: Request) -> list[bytes]:
        known = self._hashes.get(request.request_id, [])
        if len(known) < request.num_known // self.block_size:
            known = chain_hashes(request.token_ids, self.block_size, known, self._root(request))
            self._hashes[request.request_id] = known
        return known

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's computed full blocks so later requests can reuse them."""
        if not self.prefix_caching:
            return
        n_full = min(request.num_computed // self.block_size, len(request.block_table))
        start, parent = self._registered.get(request.request_id, (0, None))
        if start >= n_full:  # the common decode step: no block filled up
            return
        if start == 0:
            parent = self._root(request)
        hashes, root = self._request_hashes(request), self._root(request)
        for i in range(start, n_full):
            block, tokens = request.block_table[i], self._tokens(request, i)
            if self.records[block] is None and parent is not None:
                if hashes[i] not in self.cached:  # register it
                    above = hashes[i - 1] if i else root
                    record = Cached(hashes[i], tokens, parent, next(self._entries), above)
                    self.cached[hashes[i]], self.records[block] = block, record
                    self.events.stored(hashes[i], hashes[i - 1] if i else None, tokens)
                else:  # the same KV is cached already: chain on that entry
                    same = self._match(hashes[i], tokens, parent)
                    parent = self._entry(same) if same is not None else None
                    continue
            parent = self._entry(block)
        self._registered[request.request_id] = (n_full, parent)
        if self.windows is not None:
            # the entry id of the global block cached under a key, if any
            anchor = lambda key: self._entry(self.cached[key]) if key in self.cached else None  # noqa: E731
            self.windows.cache_full_blocks(request, hashes, anchor)

    def _entry(self, block: int) -> int | None:
        """The entry id of what the block caches (None: it caches nothing)."""
        record = self.records[block]
        return record.entry if record is not None else None

    # ---- allocation -------------------------------------------------------------------

    def can_allocate(self, hits: Sequence[Hit], num_tokens: int, reserve: int = 0) -> bool:
        """Can a waiting request reuse `hits` and get blocks for num_tokens in total,
        leaving `reserve` blocks free (and 1% of the window pool, where reserve is)?"""
        # a hit freed since needs its block back; one the tier holds, a fresh block
        revived = sum(1 for b in hits if isinstance(b, Cached) or self.ref_count[b] == 0)
        if self.blocks_for(num_tokens) - len(hits) + revived + reserve > self.num_free:
            return False
        if self.windows is None:
            return True
        window = hits.window if isinstance(hits, Hits) else []
        spare = max(1, self.windows.num_blocks // 100) if reserve else 0
        start = len(hits) * self.block_size
        return self.windows.can_allocate(window, start, num_tokens, spare)

    def allocate(self, request: Request, hits: Sequence[Hit], num_tokens: int) -> None:
        if request.block_table:
            raise RuntimeError(f"request {request.request_id} already holds blocks")
        if self.windows is not None:
            window = hits.window if isinstance(hits, Hits) else []
            self.windows.allocate(request, window, len(hits) * self.block_size, num_tokens)
        held = [b for b in hits if not isinstance(b, Cached)]
        for b in held:
            if self.ref_count[b] == 0:
                del self.free[b]
            self.ref_count[b] += 1
        request.block_table = self._restore(hits) if len(held) < len(hits) else held  # type: ignore[assignment]
        # hits are registered already; the next block sits on the last hit's entry
        last = self._entry(request.block_table[-1]) if hits else None
        self._registered[request.request_id] = (len(hits), last)
        self._grow(request, num_tokens)

    def can_append(self, request: Request, num_new: int) -> bool:
        need = self.blocks_for(request.num_computed + num_new) - len(request.block_table)
        if need > self.num_free:
            return False
        return self.windows is None or self.windows.can_append(request, num_new)

    def append(self, request: Request, num_new: int) -> None:
        if self.windows is not None:
            self.windows.append(request, num_new)
        self._grow(request, request.num_computed + num_new)

    def _grow(self, request: Request, num_tokens: int) -> None:
        need = self.blocks_for(num_tokens) - len(request.block_table)
        if need > self.num_free:
            raise RuntimeError(f"out of KV blocks: need {need}, {self.num_free} free")
        for _ in range(need):
            request.block_table.append(self._take())

    def _restore(self, hits: Sequence[Hit]) -> list[int]:
        """The hits as device blocks: fresh ones for those the tier holds, registered as
        the blocks they were (their records), their contents copied in before the step."""
        tier = self.tier
        assert tier is not None
        restore = [h for h in hits if isinstance(h, Cached)]
        claimed = {c.key: tier.claim(c.key) for c in restore}  # before any eviction
        table = []
        for hit in hits:
            if not isinstance(hit, Cached):
                table.append(hit)
                continue
            block = self._take()
            table.append(block)
            tier.copy_in(claimed[hit.key], block)
            if hit.key not in self.cached:
                self.cached[hit.key], self.records[block] = block, hit
                self.events.stored_entry(hit)
        return table

    def _take(self) -> int:
        block, _ = self.free.popitem(last=False)  # least recently freed
        record = self.records[block]
        if self.tier is not None and record is not None and self.cached.get(record.key) == block:
            self.tier.store(block, record)
        self._uncache(block)  # evict its cached contents
        self.ref_count[block] = 1
        return block

    def _uncache(self, block: int) -> None:
        record = self.records[block]
        if record is not None and self.cached.get(record.key) == block:
            del self.cached[record.key]
            self.events.removed(record.key)
        self.records[block] = None  # entries on top of it no longer match anything

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
        if self.windows is not None:
            self.windows.free_request(request)

    def uncache_owned(self, request: Request) -> tuple[list[int], list[int]]:
        """Drop the prefix-cache entries of the blocks only this request holds, and
        return them, and the window pool's (for a request whose K/V cannot be trusted,
        e.g. non-finite values). Blocks shared with other requests are left alone."""
        owned = [b for b in request.block_table if self.ref_count[b] == 1]
        for block in owned:
            self._uncache(block)
        windowed = self.windows.uncache_owned(request) if self.windows is not None else []
        return owned, windowed

    def forget(self, request: Request) -> None:
        """Drop the per-request hash memo once the request is gone for good."""
        self._hashes.pop(request.request_id, None)

    def last_copies(self) -> Copies:
        """At shutdown, with a tier: what goes to disk for a restart to find, the tier's
        entries and every block this pool caches (HostTier.everything)."""
        if self.tier is None:
            return Copies()
        device = [(b, r) for b in self.cached.values() if (r := self.records[b]) is not None]
        return self.tier.everything(device)
