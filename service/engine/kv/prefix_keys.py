"""The prefix cache's keys and a prompt's hits: a full block is keyed by SHA-256 chained
over every token before it, from a root that names the model and the request's
cache_salt (service/engine/kv/blocks.py checks every hit besides)."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from service.engine.kv.host_tier import Cached

RESTORE = -1  # a hit the host tier holds: a device block is taken for it at allocation


def block_digest(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a full block: SHA-256 over its parent's key and its tokens (int64)."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


def root_digest(namespace: str, salt: str | None) -> bytes:
    """The parent key of a request's first block: what else changes the KV (the model)
    and who may share it (the cache_salt)."""
    return hashlib.sha256(f"kvserve\0{namespace}\0{salt or ''}".encode()).digest()


def chain_hashes(
    token_ids: Sequence[int], block_size: int, known: list[bytes], root: bytes
) -> list[bytes]:
    """Extend `known` (keys of the first full blocks) over every full block of token_ids."""
    hashes = list(known)
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else root
        hashes.append(block_digest(parent, token_ids[i * block_size : (i + 1) * block_size]))
    return hashes


class Hits(list[int]):
    """A prompt's prefix-cache hits: the blocks of its first tokens (RESTORE where the
    host tier holds the block instead: `restore` says which entry, by its place), and
    `window` the windowed layers' pool's blocks for the window of their end
    (WindowBlocks)."""

    window: list[int]
    restore: list[tuple[int, Cached]]

    def __init__(
        self,
        blocks: Sequence[int] = (),
        window: Sequence[int] = (),
        restore: Sequence[tuple[int, Cached]] = (),
    ) -> None:
        super().__init__(blocks)
        self.window = list(window)
        self.restore = list(restore)
