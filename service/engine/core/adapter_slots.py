"""The LoRA adapters an engine serves and which of them sit in its model's bank
(model/adapters.py). Adapters come from --lora-modules at start and from loads at run
time (read off the engine's thread, added between steps); an unloaded adapter takes no
new request, and goes once the requests that named it have finished.

A request takes its adapter's slot when the scheduler admits it and gives it back when
it finishes or is preempted; an adapter no running request uses stays in its slot until
another needs one (least recently used first), so a busy adapter is loaded once. A
request whose adapter finds no slot free waits, and the requests behind it go first.
The slots are decided here; the bank is filled by the runner before the step that needs
it (SlotFill, on every tensor-parallel rank).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import torch

from model.adapters import Adapters, LoraAdapter
from model.config import ModelConfig
from model.hub import adapter_folder
from model.lora import rank_share, read_adapter
from model.parallel import Shares
from service.engine.exec.ranks import SlotFill
from service.engine.request import ParamError, Request
from service.engine.sample.structured import lower_priority


class AdapterSlots:
    def __init__(
        self,
        adapters: Adapters,
        cfg: ModelConfig,
        max_rank: int,
        download_dir: str | None,
        shares: Shares | None = None,
    ) -> None:
        """cfg: the whole model's; shares: this rank's share of it (tensor parallelism)."""
        self.adapters, self.known = adapters, adapters.known  # name -> in host memory
        self.cfg, self.max_rank, self.download_dir = cfg, max_rank, download_dir
        self.shares = shares
        self.retiring: set[str] = set()  # unloaded: gone once their requests are
        self.holders: Counter[str] = Counter()  # requests in the engine per adapter
        slots = adapters.bank.slots
        self.names: list[str | None] = [None] * slots  # the adapter in each slot
        self.users = [0] * slots  # running requests per slot
        self.used_at = [0] * slots  # when each was last taken: the least recent goes first
        self.clock = 0
        self.due: list[SlotFill] = []  # slots to fill before the next step
        self.loads = 0  # adapters put into a slot
        self.evictions = 0  # ... in place of another
        self.requests: Counter[str] = Counter()  # requests each adapter has taken
        self._reader: ThreadPoolExecutor | None = None  # read_later's thread

    def read(self, name: str, path: str) -> LoraAdapter:
        """The adapter at `path` (a folder or a Hub repo id), for this model (this rank's
        share); ValueError naming what cannot be served. File work: may run off the
        engine's thread."""
        adapter = read_adapter(adapter_folder(path, self.download_dir), self.cfg, name,
                               self.max_rank)  # fmt: skip
        if self.shares is None:
            return adapter
        return replace(adapter, linears=rank_share(adapter.linears, self.cfg, self.shares))

    def read_later(self, name: str, path: str) -> Future[LoraAdapter]:
        """read() in a thread of its own, below the engine's priority, whose torch ops
        run on one core: a team of torch's threads there would take cores from the
        step's OpenMP threads, which then wait for each other (docs/decisions.md)."""
        if self._reader is None:
            self._reader = ThreadPoolExecutor(1, "kvserve-adapter-read", initializer=_one_core)
            self._reader.submit(int).result()  # the thread is up, its torch on one core
            # torch.set_num_threads is that thread's own, but also what threads started
            # later begin with: this thread's count again for them
            torch.set_num_threads(torch.get_num_threads())
        return self._reader.submit(self.read, name, path)

    @property
    def served(self) -> tuple[str, ...]:
        """The names a request may give (not those unloaded)."""
        return tuple(n for n in self.known if n not in self.retiring)

    def add(self, adapter: LoraAdapter) -> None:
        if adapter.name in self.known:
            state = "is being unloaded" if adapter.name in self.retiring else "is loaded already"
            raise ValueError(f"the LoRA adapter {adapter.name!r} {state}")
        self.known[adapter.name] = adapter

    def remove(self, name: str) -> None:
        """Unload: no new request may name it; it goes when its last request has."""
        if name not in self.served:
            raise KeyError(f"no LoRA adapter {name!r} is loaded")
        self.retiring.add(name)
        self._forget_idle(name)

    def enter(self, request: Request) -> None:
        """A request naming an adapter comes in: it holds the adapter until it ends."""
        name = request.params.lora
        if name is None:
            return
        if name not in self.served:
            raise ParamError("model", f"no LoRA adapter {name!r} is served")
        self.holders[name] += 1
        self.requests[name] += 1
        request.lora_key = self.known[name].digest

    def leave(self, request: Request) -> None:
        """The request has ended: its slot and its hold on the adapter go."""
        self.release(request)
        name = request.params.lora
        if name is not None and request.lora_key:
            request.lora_key = ""
            self.holders[name] -= 1
            self._forget_idle(name)

    def acquire(self, request: Request) -> bool:
        """Give the request its adapter's slot, filling a free one (before the next
        step: `due`) where the adapter is in none; False (the request waits): every slot
        is in use by other adapters."""
        name = request.params.lora
        if name is None:
            return True
        slot = self._slot_of(name)
        if slot is None:
            free = [s for s, n in enumerate(self.users) if n == 0]
            if not free:
                return False
            slot = min(free, key=self.used_at.__getitem__)
            self.evictions += self.names[slot] is not None
            self.names[slot] = name
            self.due.append(SlotFill(name, slot))
            self.loads += 1
        self.users[slot] += 1
        self.clock += 1
        self.used_at[slot] = self.clock
        request.lora_slot = slot
        return True

    def release(self, request: Request) -> None:
        """The request stops running (preempted or ended): its slot is free to others."""
        if request.lora_slot >= 0:
            self.users[request.lora_slot] -= 1
            request.lora_slot = -1

    def take_due(self) -> list[SlotFill]:
        due, self.due = self.due, []
        return due

    def _slot_of(self, name: str) -> int | None:
        return next((s for s, held in enumerate(self.names) if held == name), None)

    def _forget_idle(self, name: str) -> None:
        """An unloaded adapter without requests: out of host memory and of its slot."""
        if name in self.retiring and self.holders[name] == 0:
            self.retiring.discard(name)
            del self.known[name], self.holders[name]
            slot = self._slot_of(name)
            if slot is not None:
                self.names[slot] = None

    def gauges(self, running: list[Request], waiting: Iterable[Request]) -> dict[str, Any]:
        """EngineSnapshot's lora_ fields."""

        def names(requests: Iterable[Request]) -> tuple[str, ...]:
            return tuple(sorted({r.params.lora for r in requests if r.params.lora}))

        return {
            "lora_adapters": self.served,
            "lora_running": names(running),
            "lora_waiting": names(waiting),
            "lora_requests": tuple(sorted(self.requests.items())),
            "max_loras": len(self.users),
            "lora_loads": self.loads,
            "lora_evictions": self.evictions,
        }

    def running(self) -> dict[str, int]:
        """Each adapter in a slot that running requests use, with their count."""
        return {name: n for name, n in zip(self.names, self.users, strict=True) if name and n}


def _one_core() -> None:
    """A reading thread's start: below the engine's priority, torch's ops on one core
    (its count taken first: torch sets a thread's own on its first call, from what was
    set last in any thread)."""
    lower_priority()
    torch.get_num_threads()
    torch.set_num_threads(1)
