"""The front's side of `--engine-process on`: starts the engine core process (core.py) or,
as one of `--api-server-count` fronts, attaches to the one its supervisor started
(attach.py, service/fronts.py); checks each request itself (service/engine/checks.py,
with the limits and a grammar cache of its own), sends it over ZMQ, and hands each
step's outputs to the streams waiting for them. It answers the routes as AsyncEngine does (generate, abort, validate,
snapshot, alive, healthy), so service/api cannot tell which it has.

One reader thread receives the engine's messages: outputs go to each stream's event loop
(one wake-up per loop per step), the observer's events to the metrics, the snapshot to
whoever reads it next. When the engine process dies (killed, crashed, its loop failed)
every stream ends with EngineDeadError and `alive` turns false: the server answers 503 and
exits non-zero, for its supervisor to restart it."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from model.loader import tokenizer_for
from model.tokenizer import Tokenizer
from service.config import Settings
from service.engine import core, wire
from service.engine.attach import Attach, Sibling, engine_gone
from service.engine.checks import check_request
from service.engine.output import RequestOutput
from service.engine.request import SamplingParams
from service.engine.stats import EngineObserver, EngineSnapshot
from service.engine.streams import (
    Batches,
    EngineDeadError,
    RequestFailed,
    by_request,
    deliver,
    deltas,
    hand_off,
    settle,
)
from service.engine.structured import Grammars

log = logging.getLogger("kvserve.engine")


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[list[RequestOutput] | BaseException]
    open: int  # sequences not finished yet


class EngineClient:
    def __init__(
        self, settings: Settings, stuck_after_s: float = 60.0, attach: Attach | None = None
    ) -> None:
        self.settings, self.stuck_after_s, self.attach = settings, stuck_after_s, attach
        self.front = attach.front if attach is not None else 0
        self.observer: EngineObserver | None = None  # the metrics, once they exist
        self._error: BaseException | None = None
        self.last_progress = time.monotonic()
        self.busy = False
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # the streams and the sending socket
        self._floors: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._memory: tuple[int, int] | None = None
        self._closed = False
        self._shut = False  # shutdown() was asked for
        # the sockets' folder when this front starts the engine itself
        self._dir = None if attach else tempfile.TemporaryDirectory(prefix="kvserve-engine-")
        self._ctx = zmq.Context()

    # ---- lifecycle -------------------------------------------------------------------

    def start(self, timeout: float | None = None) -> wire.Ready:
        """Start the engine process (or, attached, find the one the supervisor started)
        and wait until it has loaded the model; a failure to load is raised here (as the
        engine process names it)."""
        attach = self.attach
        folder = Path(self._dir.name) if self._dir else None
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
                target=core.run,
                args=(self.settings, [inputs], [outputs], os.getpid()),
                name="kvserve-engine",
                daemon=True,
            )
            self.process.start()
        ready = self._wait_ready(timeout)
        self.limits = ready.limits
        self._snapshot = ready.snapshot
        self.tokenizer = _tokenizer(ready)
        self.grammars = Grammars(self.tokenizer, ready.limits.vocab_size, ready.stop_ids)
        self.grammars.prepare()
        self._reader = threading.Thread(target=self._read, name="kvserve-engine-reader")
        self._reader.daemon = True
        self._reader.start()
        return ready

    def _wait_ready(self, timeout: float | None) -> wire.Ready:
        deadline = None if timeout is None else time.monotonic() + timeout
        while deadline is None or time.monotonic() < deadline:
            if self._pull.poll(250):
                message = wire.decode_from_engine(self._pull.recv())
                if isinstance(message, wire.Ready):
                    return message
                if isinstance(message, wire.Failed):
                    self.process.join(10)
                    raise RuntimeError(message.error)
            elif not self.process.is_alive():
                raise RuntimeError(engine_gone(self.process.exitcode))
        self.process.kill()
        raise TimeoutError("the engine process did not load the model in time")

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine (attached: leave it to the supervisor, which stops it once
        every front has drained) and end every open stream."""
        self._shut = True
        if self.attach is None and self.process.is_alive():
            self._send(wire.Shutdown())
            self.process.join(timeout)
            if self.process.is_alive():
                self.process.kill()
        self._end_all(EngineDeadError("the engine was shut down"))
        self._reader.join(timeout)

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._end_all(EngineDeadError(f"engine is not running: {error!r}"))
        if self.process.is_alive():
            self.process.kill()

    @property
    def error(self) -> BaseException | None:
        """Why the engine stopped (None: it did not, or it was shut down)."""
        if self._error is None and not self.process.is_alive() and not self._shut:
            self._error = EngineDeadError(engine_gone(self.process.exitcode))
        return self._error

    @property
    def alive(self) -> bool:
        return self.error is None and not self._closed and self.process.is_alive()

    def healthy(self) -> bool:
        if not self.alive:
            return False
        return not self.busy or time.monotonic() - self.last_progress < self.stuck_after_s

    # ---- what the routes read --------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        check_request(prompt_ids, params, self.limits, self.grammars)

    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    def device_memory(self) -> tuple[int, int] | None:
        return self._memory

    async def floors(self) -> dict[str, Any]:
        """This machine's floors for the model, measured by the engine between steps."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[dict[str, Any]] = loop.create_future()
        with self._lock:
            self._floors.append((loop, future))
        self._send(wire.Floors(self.front))
        return await future

    # ---- requests --------------------------------------------------------------------

    def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[list[RequestOutput]]:
        """Deltas for the request (and its n > 1 siblings) until all have finished.
        Leaving the iterator early aborts the request in the engine."""
        if not self.alive:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), params.n)
        with self._lock:
            self._streams[request_id] = stream
        self._send(wire.Add(request_id, prompt_ids, params, self.front))
        return deltas(stream.queue, params.n, lambda: self.abort(request_id))

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
        self._send(wire.Abort(request_id))

    def _send(self, message: Any) -> None:
        data = wire.encode(message)
        with self._lock:
            if not self._closed:
                self._push.send(data)

    # ---- the reader thread -----------------------------------------------------------

    def _read(self) -> None:
        while not self._closed:
            if not self._pull.poll(250):
                if not self.process.is_alive():
                    self._end_all(EngineDeadError(str(self.error or "the engine was shut down")))
                    return
                continue
            message = wire.decode_from_engine(self._pull.recv())
            if isinstance(message, wire.Step):
                self._step(message)
            elif isinstance(message, wire.FloorsResult):
                self._settle_floors(message)
            elif isinstance(message, wire.Failed):
                log.error("engine process: %s", message.error)
                self._error = EngineDeadError(message.error)
                self._end_all(EngineDeadError(message.error))

    def _step(self, step: wire.Step) -> None:
        self._snapshot, self.busy, self._memory = step.snapshot, step.busy, step.device_memory
        self.last_progress = time.monotonic()
        observer = self.observer
        if observer is not None:
            for event in step.events:
                if isinstance(event, wire.StepEvent):
                    observer.on_step(event.seconds, event.num_tokens, event.num_seqs)
                elif isinstance(event, wire.Intervals):
                    observer.on_token_intervals(event.seconds)
                else:
                    observer.on_finished(event.output)
        batches: Batches = {}
        with self._lock:
            for rid, outs in by_request(step.outputs, self._streams).items():
                stream = self._streams.get(rid)
                if stream is None:
                    continue
                stream.open -= sum(1 for o in outs if o.finished)
                if stream.open <= 0:
                    del self._streams[rid]
                batches.setdefault(stream.loop, []).append((stream.queue, outs))
            for rid, why in step.failed:
                if (stream := self._streams.pop(rid, None)) is not None:
                    error = RequestFailed(f"internal error: {why}")
                    batches.setdefault(stream.loop, []).append((stream.queue, error))
        hand_off(batches)

    def _settle_floors(self, result: wire.FloorsResult) -> None:
        with self._lock:
            waiting, self._floors = self._floors, []
        error = RuntimeError(result.error) if result.error else None
        for loop, future in waiting:
            settle(loop, future, result.floors, error)

    def _end_all(self, error: EngineDeadError) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            streams, self._streams = list(self._streams.values()), {}
            waiting, self._floors = self._floors, []
        for stream in streams:
            deliver(stream.loop, stream.queue, error)
        for loop, future in waiting:
            settle(loop, future, None, error)


def _tokenizer(ready: wire.Ready) -> Tokenizer:
    """The served model's tokenizer, as the engine loaded it."""
    tokenizer = tokenizer_for(Path(ready.model_dir) if ready.model_dir else None)
    if not tokenizer.eos_ids:
        tokenizer.eos_ids = list(ready.eos_ids)
    return tokenizer
