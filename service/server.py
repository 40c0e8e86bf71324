"""`kvserve serve`: uvicorn with JSON logs and a graceful SIGTERM.

On SIGTERM (or Ctrl-C) the server stops admitting work (new requests get 503 and /health
turns 503), lets in-flight requests finish for up to `shutdown_timeout` seconds, then
exits with status 0. A second signal exits at once.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

import uvicorn

from model.parallel import env_rank
from service.api.app import create_app
from service.config import Settings
from service.launch import RankProcesses, rendezvous
from service.proctitle import name_process

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry |= {k: v for k, v in record.__dict__.items() if k not in _STANDARD}
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    logging.getLogger("uvicorn.access").disabled = True  # kvserve logs each request itself


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: Any, timeout: float) -> None:
        super().__init__(config)
        self.app, self.timeout = app, timeout
        self._draining = False

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._draining:
            return super().handle_exit(sig, frame)  # second signal: stop now
        self._draining = True
        threading.Thread(target=self._drain, name="kvserve-drain", daemon=True).start()

    def _drain(self) -> None:
        state = getattr(self.app.state, "serving", None)
        log = logging.getLogger("kvserve.server")
        if state is not None:
            state.draining = True
            deadline = time.monotonic() + self.timeout
            log.info("draining", extra={"inflight": state.inflight, "timeout_s": self.timeout})
            while state.inflight > 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            log.info("drained", extra={"inflight": state.inflight})
        leaving = getattr(self.app.state, "ranks_leaving", None)
        if leaving is not None:  # the engine closes next, and tells its ranks to leave
            leaving()
        self.should_exit = True


def serve(settings: Settings) -> int:
    configure_logging(settings.log_level)
    world = settings.tensor_parallel_size
    if world > 1 and env_rank() != 0:
        return follow(settings)  # a rank started by torchrun or by rank 0 below
    started_by_hand = world > 1 and "RANK" not in os.environ
    if started_by_hand:  # a model that does not split stops here, before any rank starts
        from service.build import check_split, served_model_dir

        check_split(settings, served_model_dir(settings))
    app = create_app(settings)
    ranks = None
    if started_by_hand:  # start ranks 1..N-1
        shared = rendezvous(world)
        os.environ.update(shared | {"RANK": "0", "LOCAL_RANK": "0"})  # read by build()
        ranks = RankProcesses(settings, shared, lambda r, s: _rank_exited(app, r, s))
        app.state.ranks_leaving = ranks.leaving
    try:
        return run_app(app, settings)
    finally:
        if ranks is not None:
            ranks.stop()


def run_app(app: Any, settings: Settings, sockets: list[socket.socket] | None = None) -> int:
    """Serve the app (on settings' host and port, or on sockets already bound) until a
    signal drains it or its engine dies; the exit status: 1 when the model failed to load
    or the engine died, else 0."""
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        log_level=settings.log_level,
        timeout_graceful_shutdown=5,
    )
    server = DrainingServer(config, app, settings.shutdown_timeout)
    app.state.stop_server = lambda: setattr(server, "should_exit", True)
    server.run(sockets=sockets)
    load_error = getattr(app.state, "load_error", None)
    if load_error is not None:
        print(f"kvserve: error: {load_error}", file=sys.stderr)
        return 1
    serving = getattr(app.state, "serving", None)
    if serving is not None and serving.engine.error is not None:
        return 1  # the engine loop died: a supervisor should restart the process
    return 0


def _rank_exited(app: Any, rank: int, status: int) -> None:
    """A rank this server started exited: fail the engine (or the load) and exit."""
    from service.engine.exec.ranks import RankError

    error = RankError(f"tensor-parallel rank {rank} exited with status {status}")
    serving = getattr(app.state, "serving", None)
    if serving is not None:
        serving.engine.fail(error)  # /health 503; the app's watcher stops the server
        return
    if getattr(app.state, "load_error", None) is None:  # the load's own reason first
        app.state.load_error = error
    stop = getattr(app.state, "stop_server", None)
    if stop is not None:
        stop()


def follow(settings: Settings) -> int:
    """A rank other than 0: build its share of the engine and run rank 0's forwards."""
    from service.build import build

    rank = env_rank()
    name_process(f"rank {rank}")
    log = logging.getLogger("kvserve.server")
    # SIGTERM (torchrun passes it to every rank) waits for rank 0: it drains its requests,
    # which needs this rank, then tells it to stop; if rank 0 is gone instead, the next
    # collective fails within --rank-timeout
    signal.signal(signal.SIGTERM, lambda *_: log.info("rank %d: SIGTERM, waiting for rank 0", rank))
    try:
        built = build(settings)
    except Exception as exc:
        print(f"kvserve: error: rank {rank}: {exc}", file=sys.stderr)
        return 1
    try:
        built.engine.follow()
    except Exception as exc:
        log.error("rank %d stopped: %s", rank, exc)
        return 1
    log.info("rank %d done", rank)
    return 0
