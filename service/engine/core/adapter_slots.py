"""Which LoRA adapters the model's bank holds (model/adapters.py), for the requests that
run under them. A request takes a slot when the scheduler admits it and gives it back
when it finishes or is preempted; an adapter no running request uses stays in its slot
until another needs one (least recently used first), so a busy adapter is loaded once.
A request whose adapter finds no slot free waits, and the requests behind it go first.
"""

from __future__ import annotations

from model.adapters import LoraAdapter, LoraBank
from service.engine.request import Request


class AdapterSlots:
    def __init__(self, known: dict[str, LoraAdapter], bank: LoraBank) -> None:
        self.known = known  # name -> the adapter, in host memory
        self.bank = bank
        slots = len(bank.names)
        self.users = [0] * slots  # running requests per slot
        self.used_at = [0] * slots  # when each was last taken: the least recent goes first
        self.clock = 0
        self.loads = 0  # adapters put into a slot
        self.evictions = 0  # ... in place of another

    def key(self, name: str) -> str:
        """The digest an adapter's prefix-cache keys start from."""
        return self.known[name].digest

    def acquire(self, request: Request) -> bool:
        """Give the request its adapter's slot, loading the adapter where it is not in
        one; False (the request waits): every slot is in use by other adapters."""
        name = request.params.lora
        if name is None:
            return True
        slot = self._slot_of(name)
        if slot is None:
            free = [s for s, n in enumerate(self.users) if n == 0]
            if not free:
                return False
            slot = min(free, key=self.used_at.__getitem__)
            self.evictions += self.bank.names[slot] is not None
            self.bank.load(self.known[name], slot)
            self.loads += 1
        self.users[slot] += 1
        self.clock += 1
        self.used_at[slot] = self.clock
        request.lora_slot = slot
        return True

    def release(self, request: Request) -> None:
        if request.lora_slot >= 0:
            self.users[request.lora_slot] -= 1
            request.lora_slot = -1

    def _slot_of(self, name: str) -> int | None:
        return next((s for s, held in enumerate(self.bank.names) if held == name), None)

    def running(self) -> dict[str, int]:
        """Each adapter in a slot that running requests use, with their count."""
        return {name: n for name, n in zip(self.bank.names, self.users, strict=True) if name and n}
