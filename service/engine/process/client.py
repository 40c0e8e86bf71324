"""The front's one client of the engine core, over either transport (transport.py): it
starts the core (or, as one of `--api-server-count` fronts, meets the one its supervisor
started), checks each request itself (checks.py, with the limits the core sent and a
grammar cache), sends it, and hands each step's outputs to the streams waiting for them.
The routes hold this and nothing else of the engine.

What the core sends arrives on one thread of the link's (a reader thread, over either
transport, never the core's own): outputs go to each stream's event loop (one wake-up
per loop per step), where their text is made (service/engine/text/), the observer's
events to the metrics, the snapshot to whoever reads it next. When
the core stops (killed, crashed, its loop failed) every stream ends with EngineDeadError
and `alive` turns false: the server answers 503 and exits non-zero, for its supervisor to
restart it."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model.loader import tokenizer_for
from model.tokenizer import Tokenizer
from service.engine.core.checks import Checked, check_request
from service.engine.core.stats import EngineObserver, EngineSnapshot
from service.engine.output import RequestOutput
from service.engine.process import wire
from service.engine.process.streams import (
    Batches,
    EngineDeadError,
    RequestFailed,
    by_request,
    deliver,
    deltas,
    hand_off,
    settle,
)
from service.engine.process.transport import Link
from service.engine.request import ParamError, SamplingParams
from service.engine.sample.structured import Grammars
from service.engine.text.processor import RequestText, Stop

log = logging.getLogger("kvserve.engine")
READY_POLL_S = 0.25  # how often a front waiting for the load looks at whether the core runs


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[list[RequestOutput] | BaseException]
    open: int  # sequences not finished yet


class EngineClient:
    def __init__(self, link: Link, stuck_after_s: float = 60.0) -> None:
        self.link, self.stuck_after_s = link, stuck_after_s
        self.attach = link.attach
        self.front = link.attach.front if link.attach is not None else 0
        self.observer: EngineObserver | None = None  # the metrics, once they exist
        self._error: BaseException | None = None
        self.last_progress = time.monotonic()
        self.busy = False
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # the streams, the floors waiting, _closed
        self._floors: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        # LoRA adapter loads and unloads waiting for the core's answer, by ticket
        self._changes: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self.adapters: tuple[str, ...] = ()  # the LoRA adapters the engine serves
        self._memory: tuple[int, int] | None = None
        self._closed = False
        self._shut = False  # shutdown() was asked for
        self._ready = threading.Event()
        self._first: wire.Ready | wire.Failed | None = None  # what the load ended with

    # ---- lifecycle -------------------------------------------------------------------

    def start(self, timeout: float | None = None) -> wire.Ready:
        """Start the core (or find the one the supervisor started) and wait until it has
        loaded the model; a failure to load is raised here (as the core names it)."""
        self.link.start(self._receive, self._gone)
        ready = self._wait_ready(timeout)
        self.limits = ready.limits
        self._snapshot = ready.snapshot
        self.adapters = ready.snapshot.lora_adapters
        self.tokenizer, self.grammars = self._front_tables(ready)
        return ready

    def _wait_ready(self, timeout: float | None) -> wire.Ready:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready.wait(READY_POLL_S):
            if not self.link.is_alive():
                self._ready.wait(READY_POLL_S)  # what it sent before it stopped
                break
            if deadline is not None and time.monotonic() > deadline:
                self.link.kill()
                raise TimeoutError("the engine did not load the model in time")
        first = self._first
        if isinstance(first, wire.Ready):
            return first
        self.link.join(10)
        raise RuntimeError(first.error if first is not None else self.link.why_gone())

    def _front_tables(self, ready: wire.Ready) -> tuple[Tokenizer, Grammars]:
        """The tokenizer and grammar tables: the core's own where it runs in this process,
        else loaded here as the core loaded them."""
        served = self.link.shared()
        if served is not None:
            return served.tokenizer, served.engine.grammars
        tokenizer = tokenizer_for(Path(ready.model_dir) if ready.model_dir else None)
        if not tokenizer.eos_ids:
            tokenizer.eos_ids = list(ready.eos_ids)
        grammars = Grammars(tokenizer, ready.limits.vocab_size, ready.stop_ids)
        grammars.prepare()
        return tokenizer, grammars

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core (attached: leave it to the supervisor, which stops it once every
        front has drained) and end every open stream."""
        self._shut = True
        if self.attach is None and self.link.is_alive():
            self.link.stop(timeout)
        self._end_all(EngineDeadError("the engine was shut down"))
        self.link.close(timeout)

    def fail(self, error: BaseException) -> None:
        """Something outside the core broke it (a tensor-parallel rank exited)."""
        self._error = error
        self._end_all(EngineDeadError(f"engine is not running: {error!r}"))
        if self.link.is_alive():
            self.link.kill()

    @property
    def error(self) -> BaseException | None:
        """Why the core stopped (None: it did not, or it was shut down)."""
        if self._error is None and not self.link.is_alive() and not self._shut:
            self._error = EngineDeadError(self.link.why_gone())
        return self._error

    @property
    def alive(self) -> bool:
        return self.error is None and not self._closed and self.link.is_alive()

    def healthy(self) -> bool:
        """Alive, and making forward progress whenever it has work."""
        if not self.alive:
            return False
        return not self.busy or time.monotonic() - self.last_progress < self.stuck_after_s

    # ---- what the routes read --------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> Checked:
        """The request checked, the one time it is (ParamError / ContextLengthError),
        before anything is sent: the core queues what a front checked."""
        return check_request(prompt_ids, params, self.limits, self.grammars)

    def snapshot(self) -> EngineSnapshot:
        """The engine's state as of its last step (gauges and counters; immutable)."""
        return self._snapshot

    def device_memory(self) -> tuple[int, int] | None:
        return self._memory

    async def floors(self) -> dict[str, Any]:
        """This machine's floors for the model, measured by the core between steps."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[dict[str, Any]] = loop.create_future()
        with self._lock:
            if self._closed:
                raise EngineDeadError(f"engine is not running: {self.error!r}")
            self._floors.append((loop, future))
        self.link.send(wire.Floors(self.front))
        return await future

    async def change_adapter(self, name: str, path: str | None = None) -> None:
        """Load the LoRA adapter at `path` as `name` (None: unload `name`) in the engine;
        AdapterChangeError says why it could not be."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[wire.AdapterChanged] = loop.create_future()
        ticket = uuid.uuid4().hex
        with self._lock:
            if self._closed:
                raise EngineDeadError(f"engine is not running: {self.error!r}")
            self._changes[ticket] = (loop, future)
        self.link.send(wire.AdapterChange(ticket, name, path, self.front))
        answer = await future
        if answer.error is not None:
            raise AdapterChangeError(answer.error, answer.missing)

    # ---- requests --------------------------------------------------------------------

    def generate(self, request_id: str, request: Checked) -> AsyncIterator[list[RequestOutput]]:
        """Deltas for the request (and its n > 1 siblings), their text made here, until
        all have finished. Leaving the iterator early (client gone, cancelled) aborts the
        request."""
        params = request.params
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), params.n)
        with self._lock:
            if not self.alive:  # closed, or the core is gone
                raise EngineDeadError(f"engine is not running: {self.error!r}")
            self._streams[request_id] = stream
        self.link.send(wire.Add(request_id, request, self.front))
        text = RequestText(self.tokenizer, params)
        return deltas(stream.queue, text, _Ends(self, request_id))

    def abort(self, request_id: str) -> None:
        if self._release(request_id):
            self.link.send(wire.Abort(request_id))

    def _stopped(self, stop: Stop) -> None:
        with self._lock:
            if self._closed:
                return
        self.link.send(wire.Stopped(stop.sequence_id, stop.kept))

    def _release(self, request_id: str) -> bool:
        """Deliver nothing more to the request's stream; False when the core is gone."""
        with self._lock:
            self._streams.pop(request_id, None)
            return not self._closed

    # ---- what the core sends (on the link's thread) ----------------------------------

    def _receive(self, message: wire.FromEngine) -> None:
        if isinstance(message, wire.Step):
            self._step(message)
        elif isinstance(message, wire.FloorsResult):
            self._settle_floors(message)
        elif isinstance(message, wire.AdapterChanged):
            self.adapters = message.adapters
            with self._lock:
                waiting = self._changes.pop(message.ticket, None)
            if waiting is not None:
                settle(*waiting, message, None)
        elif isinstance(message, wire.Ready):
            self._first = self._first or message
            self._ready.set()
        else:
            log.error("engine: %s", message.error)
            self._first = self._first or message
            self._error = EngineDeadError(message.error)
            self._ready.set()
            self._end_all(EngineDeadError(message.error))

    def _gone(self) -> None:
        self._end_all(EngineDeadError(str(self.error or "the engine was shut down")))

    def _step(self, step: wire.Step) -> None:
        self._snapshot, self.busy, self._memory = step.snapshot, step.busy, step.device_memory
        self.adapters = step.snapshot.lora_adapters
        self.last_progress = time.monotonic()
        if self.observer is not None and step.events:
            self._replay(self.observer, step.events)
        batches: Batches = {}
        with self._lock:
            for rid, outs in by_request(step.outputs).items():
                stream = self._streams.get(rid)
                if stream is None:
                    continue
                stream.open -= sum(1 for o in outs if o.finished)
                if stream.open <= 0:
                    del self._streams[rid]
                batches.setdefault(stream.loop, []).append((stream.queue, outs))
            for rejected in step.failed:
                if (stream := self._streams.pop(rejected.request_id, None)) is not None:
                    batches.setdefault(stream.loop, []).append((stream.queue, _error(rejected)))
        hand_off(batches)

    @staticmethod
    def _replay(observer: EngineObserver, events: list[wire.Event]) -> None:
        """The core's observer events, told to the metrics; a failing observer is logged,
        never fatal to the streams."""
        for event in events:
            try:
                if isinstance(event, wire.StepEvent):
                    observer.on_step(event.seconds, event.num_tokens, event.num_seqs)
                elif isinstance(event, wire.Intervals):
                    observer.on_token_intervals(event.seconds)
                else:
                    observer.on_finished(event.output)
            except Exception:
                log.exception("metrics observer failed on %s", type(event).__name__)

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
            waiting += list(self._changes.values())
            self._changes = {}
        for stream in streams:
            deliver(stream.loop, stream.queue, error)
        for loop, future in waiting:
            settle(loop, future, None, error)


class AdapterChangeError(Exception):
    """A LoRA adapter load or unload the engine refused, and why (missing: no adapter of
    that name was loaded)."""

    def __init__(self, why: str, missing: bool = False) -> None:
        super().__init__(why)
        self.missing = missing


@dataclass(frozen=True, slots=True)
class _Ends:
    """How one request's stream ends (streams.Ends)."""

    client: EngineClient
    request_id: str

    def stop(self, stop: Stop) -> None:
        self.client._stopped(stop)

    def abort(self) -> None:
        self.client.abort(self.request_id)

    def close(self) -> None:
        self.client._release(self.request_id)


def _error(rejected: wire.Rejected) -> Exception:
    """The exception a stream ends with when the core could not take its request."""
    if rejected.param is not None:
        return ParamError(rejected.param, rejected.why)
    return RequestFailed(f"internal error: {rejected.why}")
