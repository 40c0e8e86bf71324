"""The SSE wire format of streamed completions: chunks as generations deliver them,
the usage chunk, errors inside the stream once the 200 is sent, and [DONE]."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any, TypeVar

from fastapi.responses import JSONResponse

from service.api.protocol import APIError
from service.engine.output import RequestOutput

T = TypeVar("T")


async def merged(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators as their items arrive; cancel all on exit.
    A single iterator is passed through without the pump task and queue."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:  # type: ignore[type-var]
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(i: int, it: AsyncIterator[T]) -> None:
        try:
            async for item in it:
                await queue.put((i, item))
            await queue.put((i, done))
        except BaseException as exc:  # delivered to the consumer, re-raised there
            await queue.put((i, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


_to_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


class EncodedJSON(JSONResponse):
    """A JSON response whose body was encoded already (json_in_turns)."""

    def render(self, content: Any) -> bytes:
        return content


TURN_S = 0.002  # how long json_in_turns encodes before it lets the loop serve others


async def json_in_turns(value: Any) -> bytes:
    """`value` as JSON, encoded on the event loop in turns of about TURN_S, each followed
    by as long a pause for the loop's other work and the engine thread. A response of
    many prompt logprobs takes seconds to build and encode: at once it would stall every
    other stream for as long, and in a worker thread the GIL would (the loop waits for it
    after each of its system calls, several an event). Each turn's pieces are joined as
    it ends, so the last join copies a few thousand strings, not millions."""
    done: list[bytes] = []
    turn: list[str] = []
    end = time.perf_counter() + TURN_S
    for piece in pieces(value):
        turn.append(piece)
        if time.perf_counter() > end:
            done.append("".join(turn).encode())
            turn = []
            await asyncio.sleep(TURN_S)
            end = time.perf_counter() + TURN_S
    done.append("".join(turn).encode())
    return b"".join(done)


async def encoded_in_turns(body: dict[str, Any]) -> EncodedJSON:
    return EncodedJSON(await json_in_turns(body))


def pieces(value: Any, depth: int = 0) -> Iterator[str]:
    """`value` as JSON, in pieces: a container near the top or of many items an item at
    a time, an iterator (a lazily built list) as an array; the rest by the JSON encoder,
    whole."""
    if isinstance(value, dict) and (depth < 4 or len(value) > 32):
        yield "{"
        for i, (k, v) in enumerate(value.items()):
            yield ("," if i else "") + _to_json(k) + ":"
            yield from pieces(v, depth + 1)
        yield "}"
    elif isinstance(value, Iterator) or (
        isinstance(value, list | tuple) and (depth < 4 or len(value) > 32)
    ):
        yield "["
        for i, v in enumerate(value):
            if i:
                yield ","
            yield from pieces(v, depth + 1)
        yield "]"
    else:
        yield _leaf_json(value)


def _as_list(value: Any) -> list[Any]:
    if isinstance(value, Iterator):  # a lazy list inside a small container
        return list(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


_leaf_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), default=_as_list).encode


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else _to_json(data)
    return f"data: {payload}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


def sse_error(exc: BaseException) -> bytes:
    if isinstance(exc, APIError):
        return sse(exc.body())
    message = str(exc) or type(exc).__name__
    return sse(APIError(500, message).body())


async def stream_chunks(
    head: dict[str, Any],
    opening: Iterable[dict[str, Any]],
    streams: list[AsyncIterator[list[RequestOutput]]],
    choice: Callable[[int, RequestOutput], dict[str, Any] | None],
    prompt_tokens: int,
    include_usage: bool,
    release: Callable[[], None],
) -> AsyncIterator[bytes]:
    """The SSE body of a streamed chat or text completion: the `opening` choices (a
    role, an echo), then one chunk per delta that `choice(stream index, output)` turns
    into a choice (None: nothing to send), the usage chunk when asked for, an error inside
    the stream once the 200 is sent, the admission released, and [DONE]."""
    completion, cached = 0, {}
    try:
        for first in opening:
            yield sse({**head, "choices": [first]})
        async for i, outs in merged(streams):
            for out in outs:
                if out.finished and out.error:
                    raise APIError(500, out.error)
                completion += len(out.token_ids)
                cached[i] = out.num_cached_tokens
                if (item := choice(i, out)) is None:
                    continue
                if out.prompt_logprobs is None:
                    yield sse({**head, "choices": [item]})
                else:  # a prompt's scores, with its first token: large, built in turns
                    yield b"data: " + await json_in_turns({**head, "choices": [item]}) + b"\n\n"
        if include_usage:
            total = usage(prompt_tokens, completion, sum(cached.values()))
            yield sse({**head, "choices": [], "usage": total})
    except Exception as exc:  # the 200 is already sent: the error goes inside the stream
        yield sse_error(exc)
    finally:
        release()
    yield SSE_DONE


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
