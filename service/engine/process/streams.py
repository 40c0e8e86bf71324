"""What the client (client.py) hands its callers: a request's deltas from its queue, the
errors that end a stream, and the thread-safe hand-offs onto a caller's event loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, Protocol

from msgspec.structs import replace

from service.engine.output import RequestOutput
from service.engine.text.processor import RequestText, Stop

# items for callers' queues, by the event loop each queue belongs to
Batches = dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]]


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can make progress."""


class RequestFailed(RuntimeError):
    """The engine could not take this request (a bug, not the request's parameters);
    other requests are unaffected."""


async def deltas(
    queue: asyncio.Queue[list[RequestOutput] | BaseException],
    text: RequestText,
    ends: Ends,
) -> AsyncIterator[list[RequestOutput]]:
    """A request's deltas from its queue, with their text (`text`: the front's output
    processor), until its sequences have finished (an error put on the queue is raised);
    a stop string's end is told to the core as it is found, and leaving early aborts.
    Steps that arrived while the caller was busy come as one delta (coalesce): a caller
    that falls behind the engine catches up with one SSE event per sequence, not one per
    step, and one that keeps up gets every step as it comes, so no token waits for
    another."""
    remaining = text.params.n
    try:
        while remaining:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            error, waiting = None, []
            while not queue.empty():
                more = queue.get_nowait()
                if isinstance(more, BaseException):
                    error = more
                    break
                waiting.append(more)
            outs, stops = text.process(coalesce([item, *waiting]) if waiting else item)
            for stop in stops:
                ends.stop(stop)
            remaining -= sum(1 for o in outs if o.finished)
            if outs:
                yield outs
            if error is not None:
                raise error
    finally:
        if remaining:
            ends.abort()
        else:
            ends.close()


class Ends(Protocol):
    """How a request's stream ends at the client (client.py)."""

    def stop(self, stop: Stop) -> None:
        """A stop string ended one of its sequences: tell the core."""

    def abort(self) -> None:
        """The caller left before the end: the core drops the request."""

    def close(self) -> None:
        """Every sequence has ended: nothing more is delivered."""


def coalesce(steps: list[list[RequestOutput]]) -> list[RequestOutput]:
    """Several steps' deltas of one request as one: per sequence, the tokens and logprobs
    joined in order, the counts, finish and times from the latest. A failed
    output stays apart, after the text that came before it."""
    joined: list[RequestOutput] = []
    at: dict[tuple[str, int], int] = {}
    for outs in steps:
        for out in outs:
            key = (out.request_id, out.index)
            if key in at and out.error is None:
                first = joined[at[key]]
                joined[at[key]] = replace(
                    out,
                    token_ids=first.token_ids + out.token_ids,
                    logprobs=first.logprobs + out.logprobs,
                    prompt_logprobs=first.prompt_logprobs or out.prompt_logprobs,
                )
            else:
                at[key] = len(joined)
                joined.append(out)
    return joined


def settle(
    loop: asyncio.AbstractEventLoop, future: Any, result: Any, error: BaseException | None
) -> None:
    """Resolve an asyncio future from another thread (nothing if its loop closed)."""

    def done() -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(done)


def put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)


def by_request(outputs: list[RequestOutput]) -> dict[str, list[RequestOutput]]:
    """A step's outputs by the client's request each answers (n > 1: its sequences')."""
    grouped: dict[str, list[RequestOutput]] = {}
    for out in outputs:
        grouped.setdefault(out.asked_as, []).append(out)
    return grouped


def hand_off(batches: Batches) -> None:
    """Put the items on their queues from another thread: one wake-up per event loop per
    step, not one per stream (each call_soon_threadsafe writes to the loop's self-pipe);
    nothing where a loop has closed (nobody listens)."""
    for loop, items in batches.items():
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(put_all, items)


def deliver(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, item: Any) -> None:
    """One item onto one caller's queue from another thread (nothing if its loop closed)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(queue.put_nowait, item)
