"""How a front of several (`--api-server-count`, service/fronts.py) meets the engine process
its supervisor started: the endpoints it binds, and the engine watched through a pidfd."""

from __future__ import annotations

import os
import select
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Attach:
    """Where a front of several (service/fronts.py) meets the engine its supervisor
    started: it binds its own two endpoints, watches the engine's pid, and opens the
    stored responses every front shares (service/api/response_store.py)."""

    front: int
    inputs: str
    outputs: str
    engine_pid: int
    responses: str


class Sibling:
    """The engine process as a front of several sees it: not its child, watched through
    a pidfd (readable once the process has exited)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.exitcode = pid, None
        self.fd = os.pidfd_open(pid)

    def is_alive(self) -> bool:
        return not select.select([self.fd], [], [], 0)[0]

    def kill(self) -> None:
        """Not this front's to kill: its supervisor sees it fail and stops the rest."""

    def join(self, timeout: float | None = None) -> None:
        select.select([self.fd], [], [], timeout)
