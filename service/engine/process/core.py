"""The engine core's one loop: load, then take requests and aborts, schedule, run and
postprocess, and send each step's outputs for every request, the engine's snapshot and
the observer's events to the fronts (wire.py's messages), never waiting on HTTP. It runs
in a thread of the server's process or in a process of its own; `CoreSide`
(transport.py) is all it knows of which. In a process (`run`), it ignores SIGINT and
SIGTERM, which the fronts drain on, and exits if the process that started it is gone."""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol

import zmq

from service.engine.core.engine import LLMEngine
from service.engine.core.stats import EngineObserver, EngineSnapshot
from service.engine.output import RequestOutput
from service.engine.process import wire
from service.engine.process.transport import CoreSide, ZmqSide
from service.engine.request import Constraint
from service.engine.sample.structured import SETUP_POOL
from service.proctitle import name_process

log = logging.getLogger("kvserve.engine")
IDLE_POLL_MS = 500  # how often an idle engine looks at its fronts and its ranks
GRAMMAR_POLL_MS = 2  # how often an idle engine looks for grammars made ready

Observers = Callable[[str], EngineObserver]


class Served(Protocol):
    """What building the engine gives the core (service/build.py's Built)."""

    engine: LLMEngine
    model_id: str
    model_dir: Path | None
    audit: dict[str, Any]
    info: dict[str, str]

    @property
    def tokenizer(self) -> Any: ...
    def floors(self) -> dict[str, Any]: ...
    def device_memory(self) -> tuple[int, int] | None: ...


Make = Callable[[Observers], Served]


class Recorder:
    """The engine's observer where the fronts keep the metrics: each step's measurements,
    kept for the next message."""

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


def serve(
    make: Make,
    side: CoreSide,
    observer: Observers | None = None,
    keep: Callable[[Served], None] | None = None,
) -> int:
    """Build the engine (`make(observers)`), then loop until shut down or orphaned: 0,
    or 1 where the load or the loop failed (the fronts are told why). `observer(model
    id)` makes the engine's observer here (several fronts: the metrics their scrapes
    merge); without one, the observer's events go to front 0 with each step. `keep`
    receives what was built, before the fronts hear it is ready."""
    core = Core(side, observer)
    try:
        served = make(observer or (lambda _: core.recorder))
        served.engine.grammars.prepare()
    except BaseException as exc:  # the front logs it as it would its own load's
        side.send_all(wire.Failed(str(exc) or type(exc).__name__))
        return 1
    if keep is not None:
        keep(served)
    return core.serve(served)


def run(
    make: Make,
    inputs: list[str],
    outputs: list[str],
    parent: int,
    observer: Observers | None = None,
) -> None:
    """The engine process's main: requests from every endpoint in `inputs`, each front's
    outputs to its endpoint in `outputs` (front i at outputs[i]); it exits when its parent
    process (the front, or the supervisor of several) is gone."""
    name_process("engine core")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    ctx = zmq.Context()
    side = ZmqSide(ctx, inputs, outputs, parent)
    try:
        code = serve(make, side, observer)
    finally:
        side.close(linger=1000)
        ctx.term()
    raise SystemExit(code)


class Core:
    def __init__(self, side: CoreSide, observer: Observers | None) -> None:
        self.side, self.observer = side, observer
        self.recorder = Recorder()
        self.seq_ids: dict[str, list[str]] = {}  # request id -> its sequences' ids
        self.front_of: dict[str, int] = {}  # request id -> the front whose stream it is
        self.failed: list[wire.Rejected] = []
        self.outputs: list[RequestOutput] = []
        # requests whose grammar's start matcher is being built off the step (llguidance
        # releases the GIL), added once it is: a large grammar never stalls a step
        self.preparing: dict[str, tuple[Future, wire.Add]] = {}
        # LoRA adapters being read off the step (their files), added once they are
        self.reading: dict[str, tuple[Future, wire.AdapterChange]] = {}
        self.sent: EngineSnapshot | None = None  # the snapshot the fronts have last

    def serve(self, served: Served) -> int:
        self.engine, self.built = served.engine, served
        self.side.send_all(self._ready())
        try:
            self._loop()
        except BaseException as exc:  # the loop died: the fronts fail every stream
            log.exception("engine loop died")
            self.side.send_all(wire.Failed(f"engine loop died: {_why(exc)}"))
            return 1
        self.engine.close()
        return 0

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
            pending = self.preparing or self.reading
            wait = 0 if busy else GRAMMAR_POLL_MS if pending else IDLE_POLL_MS
            if self.side.wait(wait) and self._drain():
                return  # shut down
            self._add_prepared()
            self._add_read()
            if self.side.orphaned():
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
        for message in self.side.take():
            if isinstance(message, wire.Add) and message.request.params.constraint is not None:
                self._prepare(message, message.request.params.constraint)
            elif isinstance(message, wire.Add):
                self._add(message)
            elif isinstance(message, wire.Abort):
                self._abort(message.request_id)
            elif isinstance(message, wire.Stopped):
                if (out := self.engine.stop(message.sequence_id, message.kept)) is not None:
                    self.outputs.append(out)
            elif isinstance(message, wire.Floors):
                self._floors(message.front)
            elif isinstance(message, wire.AdapterChange):
                self._change_adapter(message)
            elif isinstance(message, wire.FrontGone):
                self._front_gone(message.front)
            else:
                return True
        return False

    def _prepare(self, add: wire.Add, constraint: Constraint) -> None:
        """Build the grammar's start matcher off the step, from the grammar the front
        compiled and validated (in a thread, the front's and the core's cache are one)."""
        grammars = self.engine.grammars
        if add.request.grammar is not None:
            grammars.adopt(constraint, add.request.grammar)
        self.preparing[add.request_id] = (SETUP_POOL.submit(grammars.check, constraint), add)

    def _add(self, add: wire.Add) -> None:
        engine = self.engine
        self.front_of[add.request_id] = add.front
        try:
            self.seq_ids[add.request_id] = engine.add(add.request_id, add.request)
        except Exception as exc:  # this request fails alone; the loop goes on
            if not isinstance(exc, ValueError):
                log.exception("request %s failed to start", add.request_id)
            for seq_id, request in list(engine.requests.items()):  # those it added
                if request.asked_as == add.request_id:
                    engine.drop(seq_id)
            self.failed.append(wire.Rejected.of(add.request_id, exc))

    def _add_prepared(self) -> None:
        """Add the requests whose grammar is ready (or failed: the add says why)."""
        for rid in [r for r, (future, _) in self.preparing.items() if future.done()]:
            self._add(self.preparing.pop(rid)[1])

    def _change_adapter(self, change: wire.AdapterChange) -> None:
        """Unload now (its requests finish first), or read the adapter's files off the
        step and add it when they are read (_add_read)."""
        adapters = self.engine.adapters
        if adapters is None or self.engine.ranks is not None:
            why = (
                "LoRA adapters are not served (start with --enable-lora or --lora-modules)"
                if adapters is None
                else "LoRA adapters load at run time on one rank (--tensor-parallel-size 1)"
            )
            served = adapters.served if adapters is not None else ()
            self.side.send(change.front, wire.AdapterChanged(change.ticket, served, why))
        elif change.path is None:
            try:
                adapters.remove(change.name)
                self._adapter_changed(change)
            except KeyError as exc:
                self._adapter_changed(change, exc.args[0], missing=True)
        else:
            future = adapters.read_later(change.name, change.path)
            self.reading[change.ticket] = (future, change)

    def _add_read(self) -> None:
        """Add the adapters whose files are read (or answer why they cannot be)."""
        for ticket in [t for t, (future, _) in self.reading.items() if future.done()]:
            future, change = self.reading.pop(ticket)
            try:
                self.engine.adapters.add(future.result())
            except ValueError as exc:  # what cannot be served, named
                self._adapter_changed(change, str(exc))
            except Exception as exc:  # the adapter fails alone; the loop goes on
                self._adapter_changed(change, _why(exc))
            else:
                self._adapter_changed(change)

    def _adapter_changed(
        self, change: wire.AdapterChange, error: str | None = None, missing: bool = False
    ) -> None:
        served = self.engine.adapters.served
        self.side.send(change.front, wire.AdapterChanged(change.ticket, served, error, missing))

    def _abort(self, request_id: str) -> None:
        if self.preparing.pop(request_id, None) is not None:  # never added: nothing to send
            self.front_of.pop(request_id, None)
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
        self.side.reset(front)
        self.side.send(front, self._ready())

    def _floors(self, front: int) -> None:
        try:
            result = wire.FloorsResult(self.built.floors())
        except Exception as exc:
            result = wire.FloorsResult(None, _why(exc))
        self.side.send(front, result)

    def _publish(self) -> None:
        """Each front its requests' outputs and the engine's snapshot; the observer's
        events, where a front replays them (one front, no observer here), to front 0."""
        engine = self.engine
        outputs: list[list[RequestOutput]] = [[] for _ in range(self.side.fronts)]
        failed: list[list[wire.Rejected]] = [[] for _ in range(self.side.fronts)]
        for out in self.outputs:
            outputs[self.front_of.get(out.asked_as, 0)].append(out)
        for rejected in self.failed:
            failed[self.front_of.pop(rejected.request_id, 0)].append(rejected)
        self._forget_finished()
        snapshot, busy = engine.snapshot(), engine.has_unfinished()
        self.sent = snapshot
        memory, events = self.built.device_memory(), self.recorder.take()
        for front in range(self.side.fronts):
            step = wire.Step(
                outputs[front], failed[front], snapshot, events if front == 0 else [], busy, memory
            )
            self.side.send(front, step)
        self.outputs, self.failed = [], []

    def _forget_finished(self) -> None:
        """Forget the requests whose last sequence finished in this step's outputs."""
        running = self.engine.requests
        for out in self.outputs:
            rid = out.asked_as
            if out.finished and not any(i in running for i in self.seq_ids.get(rid, ())):
                self.seq_ids.pop(rid, None)
                self.front_of.pop(rid, None)


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
