"""`kvserve serve --api-server-count N` (N > 1): one engine process, N HTTP front processes
on one port, and this process supervising them.

This process binds the port, starts the engine core (service/engine/process/core.py) and the
fronts (each the whole FastAPI app with its own event loop, attached to the engine
through its own pair of ZMQ sockets, service/engine/process/client.py), then watches them:
- a front that dies is replaced; the engine aborts what it had asked for (FrontGone);
- the engine dying ends every front (each sees it through a pidfd, answers 503, ends its
  streams with an error event and exits non-zero); this process then exits non-zero;
- SIGTERM or SIGINT drains every front, then stops the engine, and exits 0.
Each front listens on its own socket of the port (SO_REUSEPORT), and the kernel spreads
new connections across them; a request's stream stays in the front it reached. Every process writes its counters and histograms to a shared
folder (prometheus_client's multiprocess mode), merged by whichever front is scraped.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import zmq

from service.build import engine_process
from service.config import Settings
from service.engine.process import wire
from service.engine.process.attach import Attach, engine_gone
from service.proctitle import name_process

log = logging.getLogger("kvserve.server")
SPAWN = multiprocessing.get_context("spawn")
ENGINE_GRACE_S = 10.0  # how long the fronts have to end once the engine is gone


def engine_metrics(model_id: str) -> Any:
    """The engine process's observer: the metrics, in the shared folder (spawn target's
    argument, so a module-level function)."""
    from service.api.metrics import Metrics

    return Metrics(model_id)


def front_main(settings: Settings, attach: Attach, replacing: bool) -> None:
    """A front process: the app on its own listening socket of the shared port, attached
    to the engine. A first front listens at once (every front is loading: /health says
    so); one replacing a dead front attaches first, so that no connection the kernel
    gives it meets a loading front while the others serve."""
    from service.api.app import build_state, create_app
    from service.server import configure_logging, run_app

    name_process(f"front {attach.front}")
    os.setpgrp()  # a terminal's Ctrl-C reaches the supervisor, which drains the fronts
    configure_logging(settings.log_level)
    if replacing:
        state = build_state(settings, attach)
        app = create_app(settings, lambda _: state)
    else:
        app = create_app(settings, lambda s: build_state(s, attach))
    listener = bind(settings)
    listener.listen(2048)
    sys.exit(run_app(app, settings, sockets=[listener]))


def bind(settings: Settings) -> socket.socket:
    """A socket on the port that others of this user may bind too (SO_REUSEPORT): each
    front listens on its own and the kernel spreads new connections across them by
    their addresses. (One socket shared by every front would not spread them: the front
    that wakes first accepts every connection waiting.) The supervisor binds one it
    never listens on, which holds the port and says at once when it is taken."""
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((settings.host, settings.port))
    return sock


class Supervisor:
    def __init__(self, settings: Settings, folder: Path) -> None:
        self.settings = settings
        n = settings.api_server_count
        # each front's two endpoints: requests to the engine, its outputs back
        self.endpoints = [
            (f"ipc://{folder / f'in-{i}'}", f"ipc://{folder / f'out-{i}'}") for i in range(n)
        ]
        self.ctx = zmq.Context()
        self.control = self.ctx.socket(zmq.PUSH)  # FrontGone and Shutdown to the engine
        control = f"ipc://{folder / 'control'}"
        self.control.bind(control)
        self.engine = SPAWN.Process(
            target=engine_process,
            args=(
                settings,
                [control, *(inputs for inputs, _ in self.endpoints)],
                [outputs for _, outputs in self.endpoints],
                os.getpid(),
                engine_metrics,
            ),
            name="kvserve-engine",
            daemon=True,
        )
        self.responses = str(folder / "responses.sqlite")  # the fronts' shared store
        self.engine_status = folder / "engine-status"  # its exit code, for the fronts
        self.fronts: list[Any] = [None] * n
        self.stopping = False

    def start(self) -> None:
        self.engine.start()
        log.info("engine process started", extra={"pid": self.engine.pid})
        for i in range(len(self.fronts)):
            self._start_front(i, replacing=False)

    def _start_front(self, i: int, replacing: bool) -> None:
        attach = Attach(i, *self.endpoints[i], self.engine.pid, self.responses,
                        str(self.engine_status))  # fmt: skip
        front = SPAWN.Process(
            target=front_main,
            args=(self.settings, attach, replacing),
            name=f"kvserve-front-{i}",
        )
        front.start()
        self.fronts[i] = front
        log.info("front process started", extra={"front": i, "pid": front.pid})

    def stop(self, *_: Any) -> None:
        """Drain: SIGTERM to every front (each finishes its streams), then the engine."""
        if self.stopping:
            return
        self.stopping = True
        log.info("draining %d fronts", len(self.fronts))
        for front in self.fronts:
            if front.is_alive():
                os.kill(front.pid, signal.SIGTERM)

    def watch(self) -> int:
        """Until every process has ended: the exit status."""
        while True:
            alive = [f for f in self.fronts if f.exitcode is None]
            if not alive:
                break
            wait([f.sentinel for f in alive] + [self.engine.sentinel], timeout=1.0)
            if self.stopping:
                continue
            if not self.engine.is_alive():
                return self._engine_gone()
            for i, front in enumerate(self.fronts):
                if front.exitcode is None:
                    continue
                self.engine.join(1.0)  # a front ends on its own when the engine has died
                if not self.engine.is_alive():
                    return self._engine_gone()
                self._front_gone(i, front.exitcode)
        self._tell(wire.Shutdown())
        self.engine.join(self.settings.shutdown_timeout)
        if self.engine.is_alive():
            self.engine.kill()
        return 0 if self.engine.exitcode == 0 else 1

    def _front_gone(self, i: int, status: int) -> None:
        log.error("front %d exited with status %s: replacing it", i, status)
        self._tell(wire.FrontGone(i))
        self._start_front(i, replacing=True)

    def _tell(self, message: Any) -> None:
        """A message to the engine; none when it is gone (nobody reads it)."""
        with contextlib.suppress(zmq.Again):
            self.control.send(wire.encode(message), zmq.NOBLOCK)

    def _engine_gone(self) -> int:
        code = self.engine.exitcode
        written = self.engine_status.with_suffix(".tmp")
        written.write_text(str(code))
        os.replace(written, self.engine_status)  # a front reads all of it or nothing
        log.error("%s: the fronts end", engine_gone(code))
        deadline = time.monotonic() + ENGINE_GRACE_S
        for front in self.fronts:
            front.join(max(0.0, deadline - time.monotonic()))
            if front.is_alive():
                front.kill()
        return 1

    def close(self) -> None:
        for front in self.fronts:
            if front is not None and front.is_alive():
                front.kill()
        if self.engine.is_alive():
            self.engine.kill()
        self.control.close(linger=0)
        self.ctx.term()


RUN_PREFIX = "kvserve-"  # a supervisor's run folder, in the temporary folder (0700)
OWNER = "owner"  # in a run folder: the pid and start time of the supervisor that made it


def process_key(pid: int) -> str | None:
    """A live process's pid and start time (None: no such process): the pair a reused
    pid does not repeat."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return f"{pid} {stat.rpartition(')')[2].split()[19]}"  # field 22, starttime


def clean_stale_run_folders(root: Path) -> list[Path]:
    """Delete the run folders under `root` whose supervisor is gone (killed before it
    could: they hold its users' stored responses); those of running supervisors, other
    users' and folders that are not run folders stay. Returns what it deleted."""
    gone = []
    for folder in root.glob(RUN_PREFIX + "*"):
        try:
            owner = (folder / OWNER).read_text().strip()
            mine = folder.lstat().st_uid == os.geteuid() and folder.is_dir()
        except OSError:
            continue
        pid = owner.split()[0] if owner else ""
        if mine and pid.isdigit() and process_key(int(pid)) != owner:
            shutil.rmtree(folder, ignore_errors=True)
            gone.append(folder)
    if gone:
        log.info("deleted %d run folders of supervisors that had died", len(gone))
    return gone


def serve_fronts(settings: Settings) -> int:
    from service.api.metrics import MULTIPROCESS
    from service.server import configure_logging

    configure_logging(settings.log_level)
    try:
        held = bind(settings)
    except OSError as exc:
        where = f"{settings.host}:{settings.port}"
        print(f"kvserve: error: cannot listen on {where}: {exc}", file=sys.stderr)
        return 1
    clean_stale_run_folders(Path(tempfile.gettempdir()))
    with tempfile.TemporaryDirectory(prefix=RUN_PREFIX) as name:
        folder = Path(name)
        (folder / OWNER).write_text(process_key(os.getpid()) or "")
        (folder / "metrics").mkdir()
        os.environ[MULTIPROCESS] = str(folder / "metrics")  # read by the processes it starts
        supervisor = Supervisor(settings, folder)
        signal.signal(signal.SIGTERM, supervisor.stop)
        signal.signal(signal.SIGINT, supervisor.stop)
        try:
            supervisor.start()
            log.info(
                "serving",
                extra={"fronts": settings.api_server_count, "port": settings.port},
            )
            return supervisor.watch()
        finally:
            supervisor.close()
            held.close()
