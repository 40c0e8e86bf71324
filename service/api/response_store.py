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
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, expires REAL NOT NULL,
    messages TEXT NOT NULL, response TEXT NOT NULL, inputs TEXT NOT NULL)"""


class ResponseStore:
    def __init__(
        self,
        size: int,
        ttl: float,
        path: str = IN_MEMORY,
        clock: Callable[[], float] = time.time,  # wall time: the fronts share it
    ):
        self.size, self.ttl, self.clock = size, ttl, clock
        self._db = sqlite3.connect(path, timeout=10.0, check_same_thread=False)
        self._lock = threading.Lock()  # one connection, the routes' threads
        with self._lock, self._db:
            if path != IN_MEMORY:
                self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(_SCHEMA)

    def put(
        self,
        response_id: str,
        messages: list[dict[str, Any]],
        response: dict[str, Any],
        inputs: list[dict[str, Any]] | None = None,
    ) -> None:
        row = (response_id, self.clock() + self.ttl, json.dumps(messages), json.dumps(response),
               json.dumps(inputs or []))  # fmt: skip
        with self._lock, self._db:
            self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,))
            self._db.execute(
                "INSERT INTO responses (id, expires, messages, response, inputs) "
                "VALUES (?, ?, ?, ?, ?)",
                row,
            )
            self._db.execute(
                "DELETE FROM responses WHERE seq <= "
                "(SELECT seq FROM responses ORDER BY seq DESC LIMIT 1 OFFSET ?)",
                (self.size,),
            )

    def get(self, response_id: str) -> list[dict[str, Any]] | None:
        """The conversation up to and with that response (None: never stored, evicted
        or expired)."""
        return self._column(response_id, "messages")

    def response(self, response_id: str) -> dict[str, Any] | None:
        """The response object as it was returned (None as get's)."""
        return self._column(response_id, "response")

    def inputs(self, response_id: str) -> list[dict[str, Any]] | None:
        """The input items that response was given (None as get's)."""
        return self._column(response_id, "inputs")

    def delete(self, response_id: str) -> bool:
        """Forget a response; False: there was none to forget."""
        with self._lock, self._db:
            gone = self._db.execute(
                "DELETE FROM responses WHERE id = ? AND expires >= ?",
                (response_id, self.clock()),
            )
            return gone.rowcount > 0

    def __len__(self) -> int:
        with self._lock:
            (n,) = self._db.execute(
                "SELECT COUNT(*) FROM responses WHERE expires >= ?", (self.clock(),)
            ).fetchone()
        return n

    def _column(self, response_id: str, column: str) -> Any:
        with self._lock, self._db:
            self._db.execute("DELETE FROM responses WHERE expires < ?", (self.clock(),))
            row = self._db.execute(
                f"SELECT {column} FROM responses WHERE id = ?", (response_id,)
            ).fetchone()
        return json.loads(row[0]) if row is not None else None
