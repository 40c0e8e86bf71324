"""How a front of several (`--api-server-count`, service/fronts.py) meets the engine process
its supervisor started: the endpoints it binds, and the engine watched through a pidfd."""

from __future__ import annotations

import os
import select
import signal
import time
from dataclasses import dataclass
from pathlib import Path

STATUS_WAIT_S = 1.0  # how long a front waits for the supervisor to write the status


@dataclass(frozen=True, slots=True)
class Attach:
    """Where a front of several (service/fronts.py) meets the engine its supervisor
    started: it binds its own two endpoints, watches the engine's pid, and opens the
    stored responses every front shares (service/api/response_store.py); the engine's
    exit status is written to `engine_status` by the supervisor once it is gone."""

    front: int
    inputs: str
    outputs: str
    engine_pid: int
    responses: str
    engine_status: str


def engine_gone(code: int | None) -> str:
    """How the engine process ended, in words (code: its exit code, negative for a
    signal, None where it is not known)."""
    if code is None:
        return "the engine process exited"
    if code < 0:
        try:
            return f"the engine process was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"the engine process was killed by signal {-code}"
    return f"the engine process exited with status {code}"


class Sibling:
    """The engine process as a front of several sees it: not its child, watched through
    a pidfd (readable once the process has exited); its exit code is what the supervisor
    (its parent) writes to `status`."""

    def __init__(self, pid: int, status: str) -> None:
        self.pid, self.status = pid, Path(status)
        self.fd = os.pidfd_open(pid)
        self._code: int | None = None

    @property
    def exitcode(self) -> int | None:
        """None while it runs; once it has exited, its code as the supervisor wrote it
        (waited for a moment: the supervisor sees the exit as the fronts do)."""
        if self._code is None and not self.is_alive():
            deadline = time.monotonic() + STATUS_WAIT_S
            while not self.status.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            try:
                self._code = int(self.status.read_text())
            except (OSError, ValueError):
                return None
        return self._code

    def is_alive(self) -> bool:
        return not select.select([self.fd], [], [], 0)[0]

    def kill(self) -> None:
        """Not this front's to kill: its supervisor sees it fail and stops the rest."""

    def join(self, timeout: float | None = None) -> None:
        select.select([self.fd], [], [], timeout)
