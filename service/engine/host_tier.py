"""The prefix cache's second tier: full, hashed blocks the device pool evicts, kept in a
bounded pool of host memory (`--kv-host-gib`) and copied back on a later hit instead of
recomputed. Plain Python: which host slot holds which cached block, and the copies a
step owes; the bytes are PagedKVCache's host pool, copied by the runner on every rank.

An entry keeps what the device pool's hit checks read (service/engine/blocks.py): the
block's tokens, the entry it was computed on top of and its own entry id, so that a
restored block, and the blocks cached on top of it, chain exactly as before it left.
Entries leave least recently stored first.

A step's copies run before its forward, copies out before copies in: a block the step
takes from the device pool has its old contents copied out first, and a slot restored
from is not handed out again until the step's copies have run (`drain`)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Cached:
    """A cached block's identity, as the device pool's prefix cache checks it."""

    key: bytes
    tokens: tuple[int, ...]
    parent: int | bytes  # the entry it sits on, or the root key for a first block
    entry: int  # its own entry id (never reused)


@dataclass(slots=True)
class Copies:
    """The copies a step owes, in order: out (device block, host slot), then in (host
    slot, device block)."""

    out: list[tuple[int, int]] = field(default_factory=list)
    into: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.out or self.into)


@dataclass(slots=True)
class TierStats:
    stored: int = 0  # blocks copied out to the tier
    restored: int = 0  # blocks copied back (prefix hits the device pool had lost)
    dropped: int = 0  # entries the tier itself evicted to make room


class HostTier:
    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"a host tier needs slots, got {num_slots}")
        self.num_slots = num_slots
        self.free = list(range(num_slots - 1, -1, -1))
        self.slots: OrderedDict[bytes, tuple[int, Cached]] = OrderedDict()  # oldest first
        self.held: list[int] = []  # slots restored from this step: free once it ran
        self.copies = Copies()
        self.stats = TierStats()

    @property
    def num_used(self) -> int:
        return len(self.slots)

    def store(self, block: int, cached: Cached) -> None:
        """The device pool evicts `block`, which holds `cached`: copy it out."""
        if cached.key in self.slots:  # stored already (the same KV): newest again
            self.slots.move_to_end(cached.key)
            return
        if not self.free:
            self.stats.dropped += 1
            if not self.slots:  # every slot is being restored from this step
                return
            _, (slot, _) = self.slots.popitem(last=False)
            self.free.append(slot)
        slot = self.free.pop()
        self.slots[cached.key] = (slot, cached)
        self.copies.out.append((block, slot))
        self.stats.stored += 1

    def match(
        self, key: bytes, tokens: tuple[int, ...], parent: int | bytes | None
    ) -> Cached | None:
        """The entry under `key` if it holds exactly these tokens on top of exactly
        `parent`, as the device pool's _match checks."""
        found = self.slots.get(key)
        if found is None or parent is None:
            return None
        cached = found[1]
        return cached if cached.tokens == tokens and cached.parent == parent else None

    def claim(self, key: bytes) -> int:
        """Take the entry under `key` out of the tier, to be copied back: its slot."""
        slot, _ = self.slots.pop(key)
        self.held.append(slot)
        return slot

    def copy_in(self, slot: int, block: int) -> None:
        self.copies.into.append((slot, block))
        self.stats.restored += 1

    def drain(self) -> Copies:
        """The copies owed so far, handed to the runner to run before the step's forward;
        the slots they restored from are free again after them."""
        copies, self.copies = self.copies, Copies()
        self.free.extend(self.held)
        self.held = []
        return copies
