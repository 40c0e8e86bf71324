"""The stored responses: each response's object (what GET /v1/responses/{id} returns) and
its whole conversation (its input and its output, as chat messages, which
`previous_response_id` continues), in memory, bounded by count (the oldest evicted
first) and by age (--responses-store-size, --responses-store-ttl)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any


class ResponseStore:
    def __init__(self, size: int, ttl: float, clock: Callable[[], float] = time.monotonic):
        self.size, self.ttl, self.clock = size, ttl, clock
        self._items: OrderedDict[str, tuple[float, list[dict[str, Any]], dict[str, Any]]] = (
            OrderedDict()
        )

    def put(
        self, response_id: str, messages: list[dict[str, Any]], response: dict[str, Any]
    ) -> None:
        self._items[response_id] = (self.clock() + self.ttl, messages, response)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> list[dict[str, Any]] | None:
        """The conversation up to and with that response (None: never stored, evicted
        or expired)."""
        item = self._live(response_id)
        return list(item[1]) if item is not None else None

    def response(self, response_id: str) -> dict[str, Any] | None:
        """The response object as it was returned (None as get's)."""
        item = self._live(response_id)
        return item[2] if item is not None else None

    def delete(self, response_id: str) -> bool:
        """Forget a response; False: there was none to forget."""
        return self._live(response_id) is not None and bool(self._items.pop(response_id))

    def _live(self, response_id: str) -> tuple[float, list[dict[str, Any]], dict[str, Any]] | None:
        item = self._items.get(response_id)
        if item is not None and item[0] < self.clock():
            del self._items[response_id]
            return None
        return item
