"""The prefix cache's second tier: full, hashed blocks the device pool evicts, kept in a
bounded pool of host memory (`--kv-host-gib`) and copied back on a later hit instead of
recomputed. Plain Python: which host slot holds which cached block, and the copies a
step owes; the bytes are PagedKVCache's host pool, copied by the runner on every rank.

An entry keeps what the device pool's hit checks read (service/engine/kv/blocks.py): the
block's tokens, the entry it was computed on top of and its own entry id, so that a
restored block, and the blocks cached on top of it, chain exactly as before it left.
Entries leave least recently stored first.

Behind it, optionally, the disk tier (service/engine/kv/disk_tier.py): an entry the host
tier drops is written there, and a hit there, read ahead off the scheduler's thread, is
copied into a fresh block. The block pool sees one tier: this one.

A step's copies run before its forward, in this order: dropped entries' bytes to disk
(from their host slot, or from the device block of one stored and dropped in the same
step), copies out, copies in, blocks read from disk. A block the step takes from the
device pool has its old contents copied out first, and a slot restored from is not
handed out again until the step's copies have run (`drain`)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

from torch import Tensor

from model.kv_cache import PagedKVCache
from service.engine.kv.disk_tier import DiskTier, Link
from service.engine.kv.kv_events import QUIET, Quiet
from service.engine.kv.prefix_keys import Cached


@dataclass(slots=True)
class Copies:
    """The copies a step owes, run in this order: dropped entries' bytes to disk (from a
    host slot, or from the device block of one stored this step), out (device block,
    host slot), in (host slot, device block), blocks read from disk (their bytes,
    device block)."""

    spill: list[tuple[int, Cached]] = field(default_factory=list)
    spill_device: list[tuple[int, Cached]] = field(default_factory=list)  # (device block, entry)
    out: list[tuple[int, int]] = field(default_factory=list)
    into: list[tuple[int, int]] = field(default_factory=list)
    load: list[tuple[Tensor, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.spill or self.spill_device or self.out or self.into or self.load)


@dataclass(frozen=True, slots=True)
class InSlot:
    """A claimed entry's bytes in a host slot: copied in from there."""

    slot: int

    def copy_into(self, block: int, copies: Copies) -> None:
        copies.into.append((self.slot, block))


@dataclass(frozen=True, slots=True)
class ReadFromDisk:
    """A claimed entry's bytes, read from its disk file ahead: loaded into the block."""

    data: Tensor

    def copy_into(self, block: int, copies: Copies) -> None:
        copies.load.append((self.data, block))


@dataclass(slots=True)
class TierStats:
    stored: int = 0  # blocks copied out to the tier
    restored: int = 0  # blocks copied back (prefix hits the device pool had lost)
    dropped: int = 0  # entries the tier itself evicted to make room


class HostTier:
    def __init__(self, num_slots: int, disk: DiskTier | None = None, events: Quiet = QUIET) -> None:
        """disk: the tier behind this one, where there is one; events: as the block
        manager's (the tier's entries are reported with host=True)."""
        if num_slots <= 0:
            raise ValueError(f"a host tier needs slots, got {num_slots}")
        self.num_slots, self.disk = num_slots, disk
        self.free = list(range(num_slots - 1, -1, -1))
        self.slots: OrderedDict[bytes, tuple[int, Cached]] = OrderedDict()  # oldest first
        self.held: list[int] = []  # slots restored from this step: free once it ran
        self.fresh: set[int] = set()  # slots copied out to this step: their bytes not there yet
        self.copies = Copies()
        self.stats = TierStats()
        self.events = events

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
            _, (slot, old) = self.slots.popitem(last=False)
            self.events.removed(old.key, host=True)
            if slot in self.fresh:  # its bytes are still in the block it left
                out = self.copies.out
                i = next(i for i in range(len(out) - 1, -1, -1) if out[i][1] == slot)
                if self.disk is not None:
                    self.copies.spill_device.append((out[i][0], old))
                del out[i]
                self.fresh.discard(slot)
            elif self.disk is not None:
                self.copies.spill.append((slot, old))
            self.free.append(slot)
        slot = self.free.pop()
        self.slots[cached.key] = (slot, cached)
        self.fresh.add(slot)
        self.copies.out.append((block, slot))
        self.events.stored_entry(cached, host=True)
        self.stats.stored += 1

    def match(self, key: bytes, tokens: tuple[int, ...], parent: int | bytes | None,
              parent_key: bytes) -> Cached | None:  # fmt: skip
        """The entry under `key` if it holds exactly these tokens on top of exactly
        `parent`, as the device pool's _match checks; else a block read from disk under
        `key` with these tokens on `parent_key` (no entry id: the pool gives it one)."""
        found = self.slots.get(key)
        if found is not None:
            cached = found[1]
            ok = parent is not None and cached.tokens == tokens and cached.parent == parent
            return cached if ok else None
        if self.disk is None or parent is None or not self.disk.ready(key, parent_key, tokens):
            return None
        return Cached(key, tokens, parent, None, parent_key)

    def prefetch(self, chain: Iterator[Link]) -> bool:
        """Read ahead the next blocks of a prompt that the disk holds (DiskTier.prefetch):
        True while the first is still to be read."""
        return self.disk is not None and self.disk.prefetch(chain)

    def wait_for_reads(self, timeout: float) -> None:
        if self.disk is not None:
            self.disk.wait_for_reads(timeout)

    def claim(self, key: bytes) -> InSlot | ReadFromDisk:
        """Take the entry under `key` out of the tier, to be copied back (copy_in): from
        its slot, or its bytes read from disk."""
        if key in self.slots:
            slot, _ = self.slots.pop(key)
            self.held.append(slot)
            self.events.removed(key, host=True)
            return InSlot(slot)
        assert self.disk is not None
        return ReadFromDisk(self.disk.claim(key))

    def copy_in(self, claimed: InSlot | ReadFromDisk, block: int) -> None:
        claimed.copy_into(block, self.copies)
        self.stats.restored += 1

    def drain(self) -> Copies:
        """The copies owed so far, handed to the runner to run before the step's forward;
        the slots they restored from are free again after them."""
        copies, self.copies = self.copies, Copies()
        self.free.extend(self.held)
        self.held = []
        self.fresh.clear()
        return copies

    def everything(self, device: list[tuple[int, Cached]]) -> Copies:
        """At shutdown: every entry's bytes to disk, this tier's and the device pool's
        cached blocks (`device`: block, record), so a restart finds them there."""
        if self.disk is None:
            return Copies()
        return Copies(spill=list(self.slots.values()), spill_device=device)

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()


def run_copies(copies: Copies, kv_cache: PagedKVCache, disk: DiskTier | None) -> None:
    """A step's copies, in their order (the module's docstring says why)."""
    for slot, cached in copies.spill:
        assert disk is not None
        disk.write(cached.key, cached.parent_key, cached.tokens, kv_cache.host_block(slot))
    for block, cached in copies.spill_device:
        assert disk is not None
        disk.write(cached.key, cached.parent_key, cached.tokens, kv_cache.device_block(block))
    kv_cache.copy_blocks(copies.out, out=True)
    kv_cache.copy_blocks(copies.into, out=False)
    kv_cache.load_blocks(copies.load)
