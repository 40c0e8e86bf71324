"""The SSE wire format of streamed completions: chunks as generations deliver them,
the usage chunk, errors inside the stream once the 200 is sent, and [DONE]."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, TypeVar

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
                if (item := choice(i, out)) is not None:
                    yield sse({**head, "choices": [item]})
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
