"""How the engine core (core.py) and the client (client.py) reach each other. Two
transports, one pair of interfaces:

- in a thread of the server's process (`InThread`, `--engine-process off`): requests go
  on a queue the core's thread reads, and the core's messages on a queue a reader thread
  hands to the client; nothing is encoded.
- in a process of its own (`InProcess`, `--engine-process on`, and every front of
  `--api-server-count`): wire.py's messages over ZMQ sockets, one pair per front, and a
  reader thread in the front that decodes what the core sends.

Either way the client's side of a step (the streams' hand-offs, the metrics' replay) runs
on the reader thread, never on the core's.

The core sees a `CoreSide` (wait, take, send to a front); the client a `Link` (start the
core, send to it, watch it). Which transport serves is chosen once, in service/build.py."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import queue
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import zmq

from service.engine.process import wire
from service.engine.process.attach import Attach, Sibling, engine_gone
from service.proctitle import name_thread

log = logging.getLogger("kvserve.engine")
READ_POLL_MS = 250  # how often a front's reader looks at whether the engine still runs

Deliver = Callable[[wire.FromEngine], None]


class CoreSide(Protocol):
    """What the core's loop reads from and writes to."""

    fronts: int

    def wait(self, timeout_ms: int) -> bool:
        """Whether a message waits, after at most timeout_ms."""
        ...

    def take(self) -> Iterator[wire.ToEngine]: ...
    def send(self, front: int, message: wire.FromEngine) -> None: ...
    def send_all(self, message: wire.FromEngine) -> None: ...
    def reset(self, front: int) -> None: ...
    def orphaned(self) -> bool:
        """Whoever started the core is gone (the core then exits)."""
        ...


class Link(Protocol):
    """A front's hold on the core: starts it, sends to it, says whether it still runs.
    The messages it receives go to `deliver`, on a thread of the link's own; `gone` is
    called once, when the core has stopped."""

    attach: Attach | None

    def start(self, deliver: Deliver, gone: Callable[[], None]) -> None: ...
    def shared(self) -> Any:
        """What the core built (core.Served) where it runs in this process, else None."""
        ...

    def send(self, message: wire.ToEngine) -> None: ...
    def is_alive(self) -> bool: ...
    def why_gone(self) -> str: ...
    def join(self, timeout: float | None) -> None: ...
    def stop(self, timeout: float) -> None:
        """Ask the core to finish, wait for it, and kill it if it has not."""
        ...

    def kill(self) -> None: ...
    def close(self, timeout: float) -> None: ...


# ---- in a thread ----------------------------------------------------------------------


class ThreadSide:
    """The core's side in a thread: a queue in, a queue out."""

    fronts = 1

    def __init__(self) -> None:
        self.inbox: queue.SimpleQueue[wire.ToEngine] = queue.SimpleQueue()
        self.outbox: queue.SimpleQueue[wire.FromEngine | None] = queue.SimpleQueue()
        self._held: list[wire.ToEngine] = []

    def wait(self, timeout_ms: int) -> bool:
        if not self._held:
            try:
                self._held.append(self.inbox.get(timeout=timeout_ms / 1000))
            except queue.Empty:
                return False
        return True

    def take(self) -> Iterator[wire.ToEngine]:
        while self._held:
            yield self._held.pop()
        while True:
            try:
                yield self.inbox.get_nowait()
            except queue.Empty:
                return

    def send(self, front: int, message: wire.FromEngine) -> None:
        self.outbox.put(message)

    def send_all(self, message: wire.FromEngine) -> None:
        self.outbox.put(message)

    def reset(self, front: int) -> None:
        """One front, which lives as long as the process."""

    def orphaned(self) -> bool:
        return False


class InThread:
    """The core in a thread of this process: `serve(side, keep)` is the core's main
    (core.py's `serve` with the engine's builder bound), which hands what it built to
    `keep`; the thread does all of PyTorch's work (docs/decisions.md: one thread for
    torch)."""

    attach: Attach | None = None

    def __init__(self, serve: Callable[[ThreadSide, Callable[[Any], None]], Any]) -> None:
        self._serve = serve
        self._served: Any = None  # what the core built (core.Served), once it has

    def start(self, deliver: Deliver, gone: Callable[[], None]) -> None:
        self.side = ThreadSide()

        def main() -> None:
            name_thread("engine core")
            try:
                self._serve(self.side, self.keep)
            finally:
                self.side.outbox.put(None)  # the reader delivers what came before, then ends

        self._thread = threading.Thread(target=main, name="kvserve-engine", daemon=True)
        self._reader = threading.Thread(
            target=self._read, args=(deliver, gone), name="kvserve-engine-reader", daemon=True
        )
        self._thread.start()
        self._reader.start()

    def _read(self, deliver: Deliver, gone: Callable[[], None]) -> None:
        try:
            while True:
                message = self.side.outbox.get()
                if message is None:
                    return
                deliver(message)
                del message  # an idle core sends nothing more: hold no outputs meanwhile
        finally:
            gone()

    def keep(self, served: Any) -> None:
        """The core built its engine: the front shares its tokenizer and grammar tables."""
        self._served = served

    def shared(self) -> Any:
        return self._served

    def send(self, message: wire.ToEngine) -> None:
        self.side.inbox.put(message)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def why_gone(self) -> str:
        return "the engine thread stopped"

    def join(self, timeout: float | None) -> None:
        self._thread.join(timeout)
        self._reader.join(timeout)

    def stop(self, timeout: float) -> None:
        self.send(wire.Shutdown())
        self.join(timeout)

    def kill(self) -> None:
        """A thread cannot be killed: it stops at its next look at the queue."""
        self.send(wire.Shutdown())

    def close(self, timeout: float) -> None:
        self.join(timeout)


# ---- in a process ---------------------------------------------------------------------


class ZmqSide:
    """The core's side in a process: requests from every front's endpoint on one PULL
    socket, one PUSH socket per front. Sends never block (no high-water mark): a front
    that died keeps its queue only until the supervisor says it is gone."""

    def __init__(self, ctx: zmq.Context, inputs: list[str], outputs: list[str], parent: int):
        self.ctx, self.endpoints, self.parent = ctx, outputs, parent
        self.pull = ctx.socket(zmq.PULL)
        for endpoint in inputs:
            self.pull.connect(endpoint)
        self.sockets = [self._open(e) for e in outputs]
        self.fronts = len(outputs)

    def _open(self, endpoint: str) -> zmq.Socket:
        socket = self.ctx.socket(zmq.PUSH)
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.connect(endpoint)
        return socket

    def wait(self, timeout_ms: int) -> bool:
        return bool(self.pull.poll(timeout_ms))

    def take(self) -> Iterator[wire.ToEngine]:
        while True:
            try:
                yield wire.decode_to_engine(self.pull.recv(zmq.NOBLOCK))
            except zmq.Again:
                return

    def send(self, front: int, message: wire.FromEngine) -> None:
        self.sockets[front].send(wire.encode(message))

    def send_all(self, message: wire.FromEngine) -> None:
        data = wire.encode(message)
        for socket in self.sockets:
            socket.send(data)

    def reset(self, front: int) -> None:
        """Drop what was queued for a dead front; its replacement connects afresh."""
        self.sockets[front].close(linger=0)
        self.sockets[front] = self._open(self.endpoints[front])

    def orphaned(self) -> bool:
        return os.getppid() != self.parent

    def close(self, linger: int) -> None:
        for socket in self.sockets:
            socket.close(linger=linger)
        self.pull.close(linger=0)


class InProcess:
    """The core in a process of its own: started here (`target(inputs, outputs, parent
    pid)` in a spawned process) or, attached as one front of several, the one the
    supervisor started (service/fronts.py). A reader thread decodes what it sends."""

    def __init__(self, target: Callable[..., None], attach: Attach | None = None) -> None:
        self.target, self.attach = target, attach
        # the sockets' folder when this front starts the engine itself
        self._dir = None if attach else tempfile.TemporaryDirectory(prefix="kvserve-engine-")
        self._ctx = zmq.Context()
        self._lock = threading.Lock()  # the sending socket
        self._closed = threading.Event()

    def start(self, deliver: Deliver, gone: Callable[[], None]) -> None:
        attach, folder = self.attach, Path(self._dir.name) if self._dir else None
        inputs = attach.inputs if attach else f"ipc://{folder / 'inputs'}"
        outputs = attach.outputs if attach else f"ipc://{folder / 'outputs'}"
        self._push, self._pull = self._ctx.socket(zmq.PUSH), self._ctx.socket(zmq.PULL)
        self._push.bind(inputs)
        self._pull.bind(outputs)
        if attach is not None:
            self.process: Any = Sibling(attach.engine_pid, attach.engine_status)
        else:
            spawn = multiprocessing.get_context("spawn")
            self.process = spawn.Process(
                target=self.target,
                args=([inputs], [outputs], os.getpid()),
                name="kvserve-engine",
                daemon=True,
            )
            self.process.start()
        self._reader = threading.Thread(
            target=self._read, args=(deliver, gone), name="kvserve-engine-reader", daemon=True
        )
        self._reader.start()

    def _read(self, deliver: Deliver, gone: Callable[[], None]) -> None:
        while not self._closed.is_set():
            if self._pull.poll(READ_POLL_MS):
                deliver(wire.decode_from_engine(self._pull.recv()))
            elif not self.process.is_alive():
                break
        gone()

    def shared(self) -> None:
        return None

    def send(self, message: wire.ToEngine) -> None:
        data = wire.encode(message)
        with self._lock:
            if not self._closed.is_set():
                self._push.send(data)

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def why_gone(self) -> str:
        return engine_gone(self.process.exitcode)

    def join(self, timeout: float | None) -> None:
        self.process.join(timeout)

    def stop(self, timeout: float) -> None:
        """The Shutdown is not sent where the core no longer reads (it is exiting)."""
        with self._lock, contextlib.suppress(zmq.Again):
            self._push.send(wire.encode(wire.Shutdown()), zmq.NOBLOCK)
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()

    def kill(self) -> None:
        self.process.kill()

    def close(self, timeout: float) -> None:
        """Stop reading and drop what was not sent (the core is gone or going)."""
        with self._lock:
            self._closed.set()
        self._reader.join(timeout)
        self._push.close(linger=0)
        if not self._reader.is_alive():
            self._pull.close(linger=0)
            self._ctx.term()
