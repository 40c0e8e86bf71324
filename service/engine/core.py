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
from concurrent.futures import Future

import zmq

from service.config import Settings
from service.engine import wire
from service.engine.output import RequestOutput
from service.engine.structured import SETUP_POOL

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


def run(settings: Settings, inputs: str, outputs: str, front_pid: int) -> None:
    """The engine process's main (multiprocessing's spawn target)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(inputs)
    push.connect(outputs)
    try:
        Core(settings, pull, push, front_pid).serve()
    finally:
        push.close(linger=1000)
        pull.close(linger=0)
        ctx.term()


class Core:
    def __init__(self, settings: Settings, pull: zmq.Socket, push: zmq.Socket, front: int):
        self.settings, self.pull, self.push, self.front = settings, pull, push, front
        self.recorder = Recorder()
        self.seq_ids: dict[str, list[str]] = {}  # request id -> its sequences' ids
        self.failed: list[tuple[str, str]] = []
        self.outputs: list[RequestOutput] = []
        # requests whose grammar's start matcher is being built off the step (llguidance
        # releases the GIL), added once it is: a large grammar never stalls a step
        self.preparing: dict[str, tuple[Future, wire.Add]] = {}

    def serve(self) -> None:
        from service.build import build

        try:
            built = build(self.settings, lambda _: self.recorder)
            engine = built.engine
            engine.grammars.prepare()
        except BaseException as exc:  # the front logs it as it would its own load's
            self.push.send(wire.encode(wire.Failed(str(exc) or type(exc).__name__)))
            raise SystemExit(1) from None
        self.engine, self.built = engine, built
        self.push.send(
            wire.encode(
                wire.Ready(
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
            )
        )
        try:
            self._loop()
        except BaseException as exc:  # the loop died: the front fails every stream
            log.exception("engine loop died")
            self.push.send(wire.encode(wire.Failed(f"engine loop died: {_why(exc)}")))
            raise SystemExit(1) from None
        engine.close()

    def _loop(self) -> None:
        engine = self.engine
        while True:
            busy = engine.has_unfinished()
            wait = 0 if busy else GRAMMAR_POLL_MS if self.preparing else IDLE_POLL_MS
            if self.pull.poll(wait) and self._drain():
                return  # shut down
            self._add_prepared()
            if os.getppid() != self.front:
                log.error("the front process is gone: the engine exits")
                return
            if engine.has_unfinished():
                self.outputs += engine.step()
            elif not (self.outputs or self.failed):
                engine.idle()
                continue
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
                self._floors()
            else:
                return True

    def _add(self, add: wire.Add) -> None:
        engine = self.engine
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

    def _floors(self) -> None:
        try:
            result = wire.FloorsResult(self.built.floors())
        except Exception as exc:
            result = wire.FloorsResult(None, _why(exc))
        self.push.send(wire.encode(result))

    def _publish(self) -> None:
        engine = self.engine
        for rid in [
            r for r, ids in self.seq_ids.items() if not any(i in engine.requests for i in ids)
        ]:
            del self.seq_ids[rid]
        step = wire.Step(
            outputs=self.outputs,
            failed=self.failed,
            snapshot=engine.snapshot(),
            events=self.recorder.take(),
            busy=engine.has_unfinished(),
            device_memory=self.built.device_memory(),
        )
        self.outputs, self.failed = [], []
        self.push.send(wire.encode(step))


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
