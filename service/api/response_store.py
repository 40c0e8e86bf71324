"""The stored responses `previous_response_id` continues from: each response's whole
conversation (its input and its output, as chat messages), in memory, bounded by count
(the oldest evicted first) and by age (--responses-store-size, --responses-store-ttl)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any


class ResponseStore:
    def __init__(self, size: int, ttl: float, clock: Callable[[], float] = time.monotonic):
        self.size, self.ttl, self.clock = size, ttl, clock
        self._items: OrderedDict[str, tuple[float, list[dict[str, Any]]]] = OrderedDict()

    def put(self, response_id: str, messages: list[dict[str, Any]]) -> None:
        self._items[response_id] = (self.clock() + self.ttl, messages)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> list[dict[str, Any]] | None:
        """The conversation up to and with that response (None: never stored, evicted
        or expired)."""
        item = self._items.get(response_id)
        if item is None:
            return None
        if item[0] < self.clock():
            del self._items[response_id]
            return None
        return list(item[1])
