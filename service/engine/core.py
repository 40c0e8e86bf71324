"""The engine core in its own process (`--engine-process on`): load, then schedule, run
and postprocess in a loop that never waits on HTTP. Requests (already checked by the
front) and aborts arrive on one ZMQ socket; each step's outputs for every request, the
engine's snapshot and the observer's events leave on another as one message
(service/engine/wire.py). The front (client.py) starts it and shuts it down; it ignores
SIGINT and SIGTERM, which the front drains on, and exits if the front goes away."""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable
from concurrent.futures import Future

import zmq

from service.config import Settings
from service.engine import wire
from service.engine.output import RequestOutput
from service.engine.stats import EngineObserver, EngineSnapshot
from service.engine.structured import SETUP_POOL
from service.proctitle import name_process

log = logging.getLogger("kvserve.engine")
IDLE_POLL_MS = 500  # how often an idle engine looks at its front and its ranks
GRAMMAR_POLL_MS = 2  # how often an idle engine looks for grammars made ready


class Recorder:
    """The engine's observer: keeps each step's measurements for the next message."""

    def __init__(self) -> None:
        self.events: list[wire.Event] = []

    def on_step(self, seconds: float, num_tokens: int, num_seqs: int) -> None:
        self.events.append(wire.StepEvent(seconds, num_tokens, num_seqs))

    def on_token_intervals(self, seconds: list[float]) -> None:
        self.events.append(wire.Intervals(list(seconds)))

    def on_finished(self, output: RequestOutput) -> None:
        self.events.append(wire.Finished(output))

    def take(self) -> list[wire.Event]:
        events, self.events = self.events, []
        return events


def run(
    settings: Settings,
    inputs: list[str],
    outputs: list[str],
    parent: int,
    observer: Callable[[str], EngineObserver] | None = None,
) -> None:
    """The engine process's main (multiprocessing's spawn target): requests from every
    endpoint in `inputs`, each front's outputs to its endpoint in `outputs` (front i at
    outputs[i]); it exits when its parent process (the front, or the supervisor of
    several) is gone. `observer(model id)` makes the engine's observer here (with several
    fronts, the metrics the fronts' scrapes merge); without one, the observer's events go
    to front 0 with each step."""
    name_process("engine core")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    for endpoint in inputs:
        pull.connect(endpoint)
    fronts = Fronts(ctx, outputs)
    try:
        Core(settings, pull, fronts, parent, observer).serve()
    finally:
        fronts.close(linger=1000)
        pull.close(linger=0)
        ctx.term()


class Fronts:
    """One PUSH socket per front process. Sends never block (no high-water mark): a
    front that died keeps its queue only until the supervisor says it is gone."""

    def __init__(self, ctx: zmq.Context, endpoints: list[str]) -> None:
        self.ctx, self.endpoints = ctx, endpoints
        self.sockets = [self._open(e) for e in endpoints]

    def _open(self, endpoint: str) -> zmq.Socket:
        socket = self.ctx.socket(zmq.PUSH)
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.connect(endpoint)
        return socket

    def __len__(self) -> int:
        return len(self.sockets)

    def send(self, front: int, message: object) -> None:
        self.sockets[front].send(wire.encode(message))

    def send_all(self, message: object) -> None:
        data = wire.encode(message)
        for socket in self.sockets:
            socket.send(data)

    def reset(self, front: int) -> None:
        """Drop what was queued for a dead front; its replacement connects afresh."""
        self.sockets[front].close(linger=0)
        self.sockets[front] = self._open(self.endpoints[front])

    def close(self, linger: int) -> None:
        for socket in self.sockets:
            socket.close(linger=linger)


class Core:
    def __init__(
        self,
        settings: Settings,
        pull: zmq.Socket,
        fronts: Fronts,
        parent: int,
        observer: Callable[[str], EngineObserver] | None,
    ) -> None:
        self.settings, self.pull, self.fronts, self.parent = settings, pull, fronts, parent
        self.recorder = Recorder()
        self.observer = observer
        self.seq_ids: dict[str, list[str]] = {}  # request id -> its sequences' ids
        self.front_of: dict[str, int] = {}  # request id -> the front whose stream it is
        self.failed: list[tuple[str, str]] = []
        self.outputs: list[RequestOutput] = []
        # requests whose grammar's start matcher is being built off the step (llguidance
        # releases the GIL), added once it is: a large grammar never stalls a step
        self.preparing: dict[str, tuple[Future, wire.Add]] = {}
        self.sent: EngineSnapshot | None = None  # the snapshot the fronts have last

    def serve(self) -> None:
        from service.build import build

        try:
            built = build(self.settings, self.observer or (lambda _: self.recorder))
            engine = built.engine
            engine.grammars.prepare()
        except BaseException as exc:  # the front logs it as it would its own load's
            self.fronts.send_all(wire.Failed(str(exc) or type(exc).__name__))
            raise SystemExit(1) from None
        self.engine, self.built = engine, built
        self.fronts.send_all(self._ready())
        try:
            self._loop()
        except BaseException as exc:  # the loop died: the fronts fail every stream
            log.exception("engine loop died")
            self.fronts.send_all(wire.Failed(f"engine loop died: {_why(exc)}"))
            raise SystemExit(1) from None
        engine.close()

    def _ready(self) -> wire.Ready:
        engine, built = self.engine, self.built
        return wire.Ready(
            limits=engine.limits,
            eos_ids=list(built.tokenizer.eos_ids),
            stop_ids=sorted(engine.eos_ids),
            max_num_seqs=engine.max_num_seqs,
            model_id=built.model_id,
            model_dir=str(built.model_dir) if built.model_dir else None,
            audit=built.audit,
            info=built.info,
            snapshot=engine.snapshot(),
        )

    def _loop(self) -> None:
        engine = self.engine
        while True:
            busy = engine.has_unfinished()
            wait = 0 if busy else GRAMMAR_POLL_MS if self.preparing else IDLE_POLL_MS
            if self.pull.poll(wait) and self._drain():
                return  # shut down
            self._add_prepared()
            if os.getppid() != self.parent:
                log.error("the process that started the engine is gone: the engine exits")
                return
            if engine.has_unfinished():
                self.outputs += engine.step()
            elif not (self.outputs or self.failed):
                engine.idle()
                if engine.snapshot() == self.sent:
                    continue  # idle, and nothing the fronts read has changed
            self._publish()

    def _drain(self) -> bool:
        """Take every message waiting; True on Shutdown."""
        while True:
            try:
                message = wire.decode_to_engine(self.pull.recv(zmq.NOBLOCK))
            except zmq.Again:
                return False
            if isinstance(message, wire.Add) and message.params.constraint is not None:
                check = self.engine.grammars.check
                future = SETUP_POOL.submit(check, message.params.constraint)
                self.preparing[message.request_id] = (future, message)
            elif isinstance(message, wire.Add):
                self._add(message)
            elif isinstance(message, wire.Abort):
                self._abort(message.request_id)
            elif isinstance(message, wire.Floors):
                self._floors(message.front)
            elif isinstance(message, wire.FrontGone):
                self._front_gone(message.front)
            else:
                return True

    def _add(self, add: wire.Add) -> None:
        engine = self.engine
        self.front_of[add.request_id] = add.front
        try:
            self.seq_ids[add.request_id] = engine.add_request(
                add.request_id, add.prompt_ids, add.params
            )
        except Exception as exc:  # this request fails alone; the loop goes on
            if not isinstance(exc, ValueError):
                log.exception("request %s failed to start", add.request_id)
            for seq_id in list(engine.requests):  # siblings it added before failing
                if seq_id == add.request_id or seq_id.startswith(add.request_id + "."):
                    engine.drop(seq_id)
            self.failed.append((add.request_id, _why(exc)))

    def _add_prepared(self) -> None:
        """Add the requests whose grammar is ready (or failed: the add says why)."""
        for rid in [r for r, (future, _) in self.preparing.items() if future.done()]:
            self._add(self.preparing.pop(rid)[1])

    def _abort(self, request_id: str) -> None:
        self.preparing.pop(request_id, None)
        for seq_id in self.seq_ids.pop(request_id, ()):
            if (out := self.engine.abort(seq_id)) is not None:
                self.outputs.append(out)

    def _front_gone(self, front: int) -> None:
        """Abort what the dead front asked for (its KV blocks go back to the pool) and
        queue a Ready for the front that replaces it."""
        gone = [rid for rid, f in self.front_of.items() if f == front]
        for rid in gone:
            self._abort(rid)
        log.warning("front %d is gone: %d of its requests aborted", front, len(gone))
        self.fronts.reset(front)
        self.fronts.send(front, self._ready())

    def _floors(self, front: int) -> None:
        try:
            result = wire.FloorsResult(self.built.floors())
        except Exception as exc:
            result = wire.FloorsResult(None, _why(exc))
        self.fronts.send(front, result)

    def _publish(self) -> None:
        """Each front its requests' outputs and the engine's snapshot; the observer's
        events, where a front replays them (one front, no observer here), to front 0."""
        engine = self.engine
        for rid in [
            r for r, ids in self.seq_ids.items() if not any(i in engine.requests for i in ids)
        ]:
            del self.seq_ids[rid]
        outputs: list[list[RequestOutput]] = [[] for _ in range(len(self.fronts))]
        failed: list[list[tuple[str, str]]] = [[] for _ in range(len(self.fronts))]
        for out in self.outputs:
            outputs[self._front(out.request_id)].append(out)
        for rid, why in self.failed:
            failed[self._front(rid)].append((rid, why))
        for rid in [r for r in self.front_of if r not in self.seq_ids and r not in self.preparing]:
            del self.front_of[rid]
        snapshot, busy = engine.snapshot(), engine.has_unfinished()
        self.sent = snapshot
        memory, events = self.built.device_memory(), self.recorder.take()
        for front in range(len(self.fronts)):
            step = wire.Step(
                outputs[front], failed[front], snapshot, events if front == 0 else [], busy, memory
            )
            self.fronts.send(front, step)
        self.outputs, self.failed = [], []

    def _front(self, request_id: str) -> int:
        """The front of a request or of one of its sequences (`{id}.{i}`)."""
        front = self.front_of.get(request_id)
        if front is None:
            front = self.front_of.get(request_id.rpartition(".")[0], 0)
        return front


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
