"""The async front: the engine steps in its own thread; callers await per-request queues.

All engine state is touched by the engine thread alone. Callers talk to it through a
command queue (add, abort, call) and receive deltas through their asyncio queue, fed with
call_soon_threadsafe, so the event loop never waits on a forward pass. What other threads
read of the engine's state (the metrics, /health) is the immutable EngineSnapshot the
engine thread publishes after every step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from service.engine.engine import LLMEngine
from service.engine.output import RequestOutput
from service.engine.request import SamplingParams
from service.engine.stats import EngineSnapshot
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

log = logging.getLogger("kvserve.engine")
T = TypeVar("T")


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[list[RequestOutput] | BaseException]
    seq_ids: list[str]


class AsyncEngine:
    """`build` runs in the engine thread, which then steps the engine: all of PyTorch's
    work (loading, warm-up, every forward) stays on that one thread. On the CPU a second
    thread running torch ops gets its own OpenMP team; with more OpenMP threads than
    cores their workers sleep between ops, which is far slower per token
    (docs/decisions.md)."""

    def __init__(self, build: Callable[[], LLMEngine], stuck_after_s: float = 60.0) -> None:
        self._build = build
        self.engine: LLMEngine = None  # type: ignore[assignment]  # set by the engine thread
        self._ready = threading.Event()
        self.stuck_after_s = stuck_after_s
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self.error: BaseException | None = None  # why the loop died (None: it did not)
        self._closed = False  # the loop serves no more streams (died or shut down)
        self.last_progress = time.monotonic()
        self.busy = False  # the engine has unfinished work
        self._snapshot: EngineSnapshot | None = None  # published by the engine thread

    # ---- lifecycle -------------------------------------------------------------------

    def start(self, timeout: float | None = None) -> None:
        """Start the engine thread and wait until it has built the engine; a failure to
        build is raised here."""
        self._thread.start()
        self._ready.wait(timeout)
        if self.error is not None:
            raise self.error

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def fail(self, error: BaseException) -> None:
        """Something outside the loop broke the engine (a tensor-parallel rank exited):
        it is no longer alive, and the loop ends its streams and stops."""
        self.error = error
        self._stop.set()
        self._wake.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None and not self._closed

    def healthy(self) -> bool:
        """Alive, and making forward progress whenever it has work."""
        if not self.alive:
            return False
        return not self.busy or time.monotonic() - self.last_progress < self.stuck_after_s

    # ---- read-only views for callers (plain ints and floats: safe across threads) ------

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ParamError / ContextLengthError now, before anything is queued."""
        self.engine.validate(prompt_ids, params)

    def snapshot(self) -> EngineSnapshot:
        """The engine's state as of its last step (gauges and counters; immutable)."""
        assert self._snapshot is not None, "start() first"
        return self._snapshot

    # ---- the caller side -------------------------------------------------------------

    def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[list[RequestOutput]]:
        """Deltas for the request (and its n > 1 siblings) until all have finished.
        Leaving the iterator early (client gone, cancelled) aborts the request. Called
        from the event loop (the stream's queue belongs to it)."""
        if not self.alive:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), [])
        self._send(("add", request_id, prompt_ids, params, stream))
        if not self.alive:  # it died (or stopped) after the check above: nobody will answer
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        return deltas(stream.queue, params.n, lambda: self.abort(request_id))

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    async def call(self, fn: Callable[[], T]) -> T:
        """fn() run on the engine thread between steps (where all torch work happens)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._send(("call", fn, loop, future))
        if not self.alive:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        return await future

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    # ---- the engine thread -----------------------------------------------------------

    def _run(self) -> None:
        try:
            self.engine = self._build()
            self._snapshot = self.engine.snapshot()
        except BaseException as exc:
            self.error = exc
            return
        finally:
            self._ready.set()
        try:
            while not self._stop.is_set():
                self._drain_commands()
                self.busy = self.engine.has_unfinished()
                if not self.busy:
                    self._snapshot = self.engine.snapshot()  # aborts and adds show too
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    self.engine.idle()
                    self.last_progress = time.monotonic()
                    continue
                outputs = self.engine.step()
                self._snapshot = self.engine.snapshot()  # before the callers hear of it
                self._dispatch(outputs)
                del outputs  # nothing keeps the last outputs alive while idle
                self.last_progress = time.monotonic()
        except BaseException as exc:  # the loop itself died: fail everyone, report unhealthy
            log.exception("engine loop died")
            self.error = exc
            self._end_all(EngineDeadError(f"engine loop died: {exc!r}"))
        else:  # shut down (not an error): streams still open, and adds still queued, end
            self._end_all(EngineDeadError("the engine was shut down"))
            self.engine.close()

    def _end_all(self, error: EngineDeadError) -> None:
        """Every stream the loop will not serve any more, open or still queued, ends with
        `error`. `alive` turns false first, so a caller that sends after this has run
        sees it (generate checks `alive` after sending)."""
        self._closed = True
        for rid in list(self._streams):
            self._deliver(self._streams.pop(rid), error)
        for command in self._pending():
            if command[0] == "add":
                self._deliver(command[-1], error)
            elif command[0] == "call":
                settle(*command[2:], None, error)

    def _pending(self) -> Iterator[tuple]:
        """The commands queued so far, taken off the queue."""
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _drain_commands(self) -> None:
        for command in self._pending():
            if command[0] == "add":
                self._add(*command[1:])
            elif command[0] == "call":
                self._call(*command[1:])
            else:
                self._abort(command[1])

    @staticmethod
    def _call(fn: Callable[[], Any], loop: asyncio.AbstractEventLoop, future: Any) -> None:
        try:
            result, error = fn(), None
        except Exception as exc:  # the caller gets it; the loop goes on
            result, error = None, exc
        settle(loop, future, result, error)

    def _add(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, stream: _Stream
    ) -> None:
        try:
            stream.seq_ids = self.engine.add_request(request_id, prompt_ids, params)
        except ValueError as exc:  # the request's parameters (a 400)
            self._deliver(stream, exc)
            return
        except Exception as exc:  # a bug: this request fails alone, the loop goes on
            log.exception("request %s failed to start", request_id)
            for seq_id in list(self.engine.requests):  # siblings it added before failing
                if seq_id == request_id or seq_id.startswith(request_id + "."):
                    self.engine.drop(seq_id)
            self._deliver(stream, RequestFailed(f"internal error: {type(exc).__name__}"))
            return
        self._streams[request_id] = stream

    def _abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        outputs = [o for sid in stream.seq_ids if (o := self.engine.abort(sid)) is not None]
        if outputs:
            self._deliver(stream, outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        batches: Batches = {}
        for rid, outs in by_request(outputs, self._streams).items():
            stream = self._streams.get(rid)
            if stream is None:
                continue
            batches.setdefault(stream.loop, []).append((stream.queue, outs))
            if all(self.engine.requests.get(sid) is None for sid in stream.seq_ids):
                del self._streams[rid]
        hand_off(batches)

    @staticmethod
    def _deliver(stream: _Stream, item: list[RequestOutput] | BaseException) -> None:
        deliver(stream.loop, stream.queue, item)
