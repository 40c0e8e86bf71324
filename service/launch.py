"""Starting the tensor-parallel ranks of `kvserve serve --tensor-parallel-size N`.

Started by hand (no RANK in the environment), the server is rank 0 and starts ranks
1..N-1 itself on this host: the same command with the same settings (as KVSERVE_*
variables), RANK/WORLD_SIZE/LOCAL_RANK set and a free MASTER_PORT on 127.0.0.1. Started by
torchrun (RANK set), every process runs `kvserve serve`: rank 0 serves HTTP, the others
follow. A rank started here dies with its server (PR_SET_PDEATHSIG), and the server
hears of a rank that exits.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable

from service.config import Settings

log = logging.getLogger("kvserve.launch")
_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # in the child, before exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # a follower ignores SIGTERM


def rendezvous(world: int) -> dict[str, str]:
    """The variables every rank of a one-host group started here shares."""
    return {
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }


class RankProcesses:
    """Ranks 1..N-1 as child processes, watched: `on_exit(rank, status)` is called (from
    a watcher thread) when one exits before stop()."""

    def __init__(
        self, settings: Settings, shared: dict[str, str], on_exit: Callable[[int, int], None]
    ) -> None:
        env = dict(os.environ) | shared
        for key, value in settings.to_env().items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        self._stopping = False
        self.procs: list[subprocess.Popen] = []
        for rank in range(1, settings.tensor_parallel_size):
            rank_env = env | {"RANK": str(rank), "LOCAL_RANK": str(rank)}
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "service.cli", "serve"],
                    env=rank_env,
                    preexec_fn=_die_with_parent,
                )
            )
        for rank, proc in enumerate(self.procs, start=1):
            threading.Thread(
                target=self._watch,
                args=(rank, proc, on_exit),
                name=f"kvserve-rank{rank}",
                daemon=True,
            ).start()

    def _watch(
        self, rank: int, proc: subprocess.Popen, on_exit: Callable[[int, int], None]
    ) -> None:
        status = proc.wait()
        if not self._stopping:
            log.error("rank %d exited with status %d", rank, status)
            on_exit(rank, status)

    def leaving(self) -> None:
        """The engine is about to close and tell the ranks to leave: their exits from
        now on are expected, not failures."""
        self._stopping = True

    def stop(self, timeout: float = 3.0) -> None:
        """Wait for the ranks to leave (the engine's close() told them), then end them."""
        self._stopping = True
        for proc in self.procs:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
