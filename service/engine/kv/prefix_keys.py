"""The prefix cache's keys and a prompt's hits: a full block is keyed by SHA-256 chained
over every token before it, from a root that names the model and the request's
cache_salt and LoRA adapter (service/engine/kv/blocks.py checks every hit besides)."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

import msgspec


class Cached(msgspec.Struct, frozen=True, gc=False):
    """A cached block's record, what every hit on it is checked against: its key, its
    tokens, the entry it was computed on top of, its own entry id, and its parent's key.
    The device pool keeps one per cached block (blocks.py), the host tier one per slot,
    and a disk file holds the same fields (but the entry id, which is this run's). As
    many as the pool has blocks, they hold bytes and numbers alone: the garbage
    collector does not track them (gc=False), and the pool's size adds nothing to a
    collection."""

    key: bytes
    tokens: tuple[int, ...]
    parent: int | bytes  # the entry it sits on, or the root key for a first block
    entry: int | None  # its own entry id (never reused); None: read from disk, none yet
    parent_key: bytes  # the key of the block it sits on (the root key for a first)


def block_digest(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a full block: SHA-256 over its parent's key and its tokens (int64)."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


def root_digest(namespace: str, salt: str | None, adapter: str = "") -> bytes:
    """The parent key of a request's first block: what else changes the KV (the model,
    and the LoRA adapter's digest: "" for the base model) and who may share it (the
    cache_salt)."""
    return hashlib.sha256(f"kvserve\0{namespace}\0{salt or ''}\0{adapter}".encode()).digest()


def chain_hashes(
    token_ids: Sequence[int], block_size: int, known: list[bytes], root: bytes
) -> list[bytes]:
    """Extend `known` (keys of the first full blocks) over every full block of token_ids."""
    hashes = list(known)
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else root
        hashes.append(block_digest(parent, token_ids[i * block_size : (i + 1) * block_size]))
    return hashes


Hit = int | Cached  # a device block, or an entry a tier holds (a block is taken for it)


class Hits(list[Hit]):
    """A prompt's prefix-cache hits, in order: the device blocks of its first tokens, and
    where a tier holds the block instead, that tier's entry; `window` the windowed
    layers' pool's blocks for the window of their end (WindowBlocks); `loading`: blocks
    past these are being read from disk (the request waits for them)."""

    window: list[int]
    loading: bool

    def __init__(
        self, blocks: Sequence[Hit] = (), window: Sequence[int] = (), loading: bool = False
    ) -> None:
        super().__init__(blocks)
        self.window = list(window)
        self.loading = loading
