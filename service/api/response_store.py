"""The stored responses: each response's object (what GET /v1/responses/{id} returns), its
input items (GET /v1/responses/{id}/input_items) and its whole conversation (its input
and its output, as chat messages, which `previous_response_id` continues), bounded by
count (the oldest evicted first) and by age (--responses-store-size,
--responses-store-ttl).

One SQLite database holds them: in memory for a single front; with `--api-server-count`
N > 1 a file in the supervisor's run folder that every front opens (service/fronts.py),
so a continuation finds its response whichever front the kernel hands it to. Each call
is one short transaction; SQLite's locking keeps the fronts' writes apart."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Callable
from typing import Any

IN_MEMORY = ":memory:"
_SCHEMA = """CREATE TABLE IF NOT EXISTS responses (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, owner TEXT NOT NULL,
    expires REAL NOT NULL, bytes INTEGER NOT NULL,
    messages TEXT NOT NULL, response TEXT NOT NULL, inputs TEXT NOT NULL)"""


class ResponseStore:
    def __init__(
        self,
        size: int,
        ttl: float,
        budget: int,
        path: str = IN_MEMORY,
        clock: Callable[[], float] = time.time,  # wall time: the fronts share it
    ):
        self.size, self.ttl, self.budget, self.clock = size, ttl, budget, clock
        self._db = sqlite3.connect(path, timeout=10.0, check_same_thread=False)
        self._lock = threading.Lock()  # one connection, the routes' threads
        with self._lock, self._db:
            if path != IN_MEMORY:
                self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(_SCHEMA)

    def put(
        self,
        response_id: str,
        owner: str,
        messages: list[dict[str, Any]],
        response: dict[str, Any],
        inputs: list[dict[str, Any]] | None = None,
    ) -> bool:
        """Store a response (False: it alone is larger than the store's byte budget, and
        is not kept)."""
        texts = (json.dumps(messages), json.dumps(response), json.dumps(inputs or []))
        size = sum(len(t) for t in texts)
        if size > self.budget:
            return False
        with self._lock, self._db:
            self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,))
            self._db.execute(
                "INSERT INTO responses (id, owner, expires, bytes, messages, response, inputs) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (response_id, owner, self.clock() + self.ttl, size, *texts),
            )
            self._evict()
        return True

    def _evict(self) -> None:
        """The oldest past the count, then the oldest past the byte budget."""
        self._db.execute(
            "DELETE FROM responses WHERE seq <= "
            "(SELECT seq FROM responses ORDER BY seq DESC LIMIT 1 OFFSET ?)",
            (self.size,),
        )
        self._db.execute(
            "DELETE FROM responses WHERE seq <= (SELECT seq FROM (SELECT seq, SUM(bytes) "
            "OVER (ORDER BY seq DESC) AS newer FROM responses) WHERE newer > ? "
            "ORDER BY seq DESC LIMIT 1)",
            (self.budget,),
        )

    def get(self, response_id: str, owner: str) -> list[dict[str, Any]] | None:
        """The conversation up to and with that response (None: never stored, another
        key's, evicted or expired)."""
        return self._column(response_id, owner, "messages")

    def response(self, response_id: str, owner: str) -> dict[str, Any] | None:
        """The response object as it was returned (None as get's)."""
        return self._column(response_id, owner, "response")

    def inputs(self, response_id: str, owner: str) -> list[dict[str, Any]] | None:
        """The input items that response was given (None as get's)."""
        return self._column(response_id, owner, "inputs")

    def delete(self, response_id: str, owner: str) -> bool:
        """Forget a response; False: there was none of this owner's to forget."""
        with self._lock, self._db:
            gone = self._db.execute(
                "DELETE FROM responses WHERE id = ? AND owner = ? AND expires >= ?",
                (response_id, owner, self.clock()),
            )
            return gone.rowcount > 0

    @property
    def num_bytes(self) -> int:
        """The stored responses' JSON, in bytes (what the budget bounds)."""
        with self._lock:
            (n,) = self._db.execute("SELECT COALESCE(SUM(bytes), 0) FROM responses").fetchone()
        return n

    def __len__(self) -> int:
        with self._lock:
            (n,) = self._db.execute(
                "SELECT COUNT(*) FROM responses WHERE expires >= ?", (self.clock(),)
            ).fetchone()
        return n

    def _column(self, response_id: str, owner: str, column: str) -> Any:
        with self._lock, self._db:
            self._db.execute("DELETE FROM responses WHERE expires < ?", (self.clock(),))
            row = self._db.execute(
                f"SELECT {column} FROM responses WHERE id = ? AND owner = ?", (response_id, owner)
            ).fetchone()
        return json.loads(row[0]) if row is not None else None
