"""Serving logic shared by the completion and chat routes: admission and backpressure,
request -> SamplingParams, running generations, and the SSE wire format."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from model.tokenizer import Tokenizer
from service.api.chat_template import ChatTemplate, ChatTemplateError
from service.api.metrics import Metrics
from service.api.protocol import APIError, SamplingFields
from service.api.structured import constraint_of
from service.config import Settings
from service.engine.async_engine import AsyncEngine, EngineDeadError, RequestFailed
from service.engine.engine import ContextLengthError
from service.engine.output import RequestOutput
from service.engine.request import ParamError, SamplingParams

log = logging.getLogger("kvserve.api")
T = TypeVar("T")


@dataclass
class ServingState:
    settings: Settings
    engine: AsyncEngine
    tokenizer: Tokenizer
    model_id: str
    template: ChatTemplate
    audit: dict[str, Any]
    metrics: Metrics
    # this machine's floors for the model (torch work: run on the engine thread), and
    # their first measurement
    measure_floors: Callable[[], dict[str, Any]] = dict
    floors: dict[str, Any] | None = None
    inflight: int = 0  # admitted sequences not yet finished
    inflight_tokens: int = 0  # their KV demand: prompt + max_tokens each
    draining: bool = False
    started: float = field(default_factory=time.time)
    # (when, KV tokens) of recently released admissions: how fast demand drains
    released: deque[tuple[float, int]] = field(default_factory=deque)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_id:
            raise APIError(
                404,
                f"The model '{name}' does not exist; this server serves '{self.model_id}'",
                param="model",
                code="model_not_found",
            )

    def admit(self, n_seqs: int, kv_tokens: int = 0) -> Admission:
        """Take n sequences (needing up to kv_tokens of KV cache) in, or answer 503
        (draining) or 429: the waiting queue is full by count, or what is in flight
        would need more KV than the pool and a queue of the same proportion hold."""
        if self.draining:
            raise APIError(503, "The server is shutting down and accepts no new requests")
        if not self.engine.alive:
            raise APIError(503, "The engine is not running")
        settings = self.settings
        waiting = max(0, self.inflight + n_seqs - settings.max_num_seqs)
        if waiting > settings.max_queue:
            raise APIError(
                429,
                f"The server is at capacity ({self.inflight} sequences in flight, "
                f"waiting queue cap {settings.max_queue}); retry shortly",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        pool = int(self.audit.get("kv_pool_tokens", 0))
        allowed = pool * (1 + settings.max_queue / settings.max_num_seqs)
        excess = self.inflight_tokens + kv_tokens - allowed
        if pool and self.inflight_tokens and excess > 0:
            raise APIError(
                429,
                f"The KV cache is oversubscribed ({self.inflight_tokens} tokens of prompt + "
                f"max_tokens in flight for a pool of {pool}); retry shortly",
                code="kv_cache_full",
                headers={"Retry-After": str(self._drain_seconds(excess))},
            )
        self.inflight += n_seqs
        self.inflight_tokens += kv_tokens
        return Admission(self, n_seqs, kv_tokens)

    def _drain_seconds(self, tokens: float, window: float = 30.0) -> int:
        """Seconds until `tokens` of demand drain at the rate admissions were released
        over the last `window` seconds (1 to 60; 1 when nothing finished lately)."""
        now = time.monotonic()
        while self.released and now - self.released[0][0] > window:
            self.released.popleft()
        rate = sum(t for _, t in self.released) / window
        return 1 if rate == 0 else max(1, min(60, math.ceil(tokens / rate)))


class Admission:
    """Releases its sequences exactly once, whichever way the request ends."""

    def __init__(self, state: ServingState, n: int, kv_tokens: int = 0) -> None:
        self.state, self.n, self.kv_tokens = state, n, kv_tokens

    def release(self) -> None:
        if self.n:
            self.state.inflight -= self.n
            self.state.inflight_tokens -= self.kv_tokens
            self.state.released.append((time.monotonic(), self.kv_tokens))
            self.n = 0

    async def arelease(self) -> None:
        """release() as a response's background task: Starlette runs a sync one in a worker
        thread, where `inflight -= n` would race the event loop's `+=`."""
        self.release()


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sampling_params(req: SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    bias = []
    for key, value in (req.logit_bias or {}).items():
        try:
            bias.append((int(key), float(value)))
        except ValueError:
            raise APIError(
                400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
            ) from None
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            logit_bias=tuple(bias),
            seed=req.seed,
            n=req.n,
            stop=stop,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            cache_salt=req.cache_salt,
            constraint=constraint_of(req),
        )
    except ParamError as exc:
        raise bad_request(exc) from None


def bad_request(exc: ParamError) -> APIError:
    """The engine's parameter errors as 400s naming the parameter."""
    if isinstance(exc, ContextLengthError):
        message = str(exc).split(": ", 1)[-1]  # the message states the limit and counts
        return APIError(400, message, param=exc.param, code="context_length_exceeded")
    return APIError(400, str(exc), param=exc.param)


async def validate_prompt(
    state: ServingState, prompt_ids: list[int], params: SamplingParams
) -> None:
    """The engine's checks of a request; a structured-output constraint is compiled (the
    first one builds the tokenizer's token table, about a second) off the event loop."""
    try:
        if params.constraint is None:
            state.engine.validate(prompt_ids, params)
        else:
            await asyncio.to_thread(state.engine.validate, prompt_ids, params)
    except ParamError as exc:
        raise bad_request(exc) from None


def encode_messages(
    state: ServingState, messages: list[Any], add_generation_prompt: bool
) -> list[int]:
    """Chat messages rendered with the model's template, as token ids."""
    rendered = [
        {"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
        for m in messages
    ]
    try:
        text = state.template.render(rendered, add_generation_prompt=add_generation_prompt)
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), param="messages") from None
    # the template writes any BOS itself; special tokens in it are real special tokens
    return state.tokenizer.encode(text, add_bos=False)


def check_stream_options(req: SamplingFields) -> bool:
    if req.stream_options is not None and not req.stream:
        raise APIError(
            400, "stream_options is only allowed when stream is true", param="stream_options"
        )
    return bool(req.stream and req.stream_options and req.stream_options.include_usage)


@dataclass
class Choice:
    """Everything generated for one choice, accumulated from the deltas."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    cached: int = 0
    error: str | None = None


async def collect(
    state: ServingState, request_id: str, prompt_ids: list[int], params: SamplingParams
) -> list[Choice]:
    choices = [Choice() for _ in range(params.n)]
    async for outs in generate(state, request_id, prompt_ids, params):
        for out in outs:
            c = choices[out.index]
            c.text += out.text
            c.token_ids += out.token_ids
            c.logprobs += out.logprobs
            c.cached = out.num_cached_tokens
            if out.finished:
                c.finish_reason = out.finish_reason.value if out.finish_reason else None
                c.error = out.error
    return choices


async def generate(
    state: ServingState, request_id: str, prompt_ids: list[int], params: SamplingParams
) -> AsyncIterator[list[RequestOutput]]:
    try:
        async for outs in state.engine.generate(request_id, prompt_ids, params):
            yield outs
    except EngineDeadError as exc:
        raise APIError(503, f"The engine stopped: {exc}") from None
    except ParamError as exc:
        raise bad_request(exc) from None
    except RequestFailed as exc:  # logged by the engine with the request id
        raise GenerationFailed(f"request {request_id}: {exc}") from None


def raise_if_failed(choices: list[Choice]) -> None:
    failed = next((c for c in choices if c.finish_reason == "error"), None)
    if failed is not None:
        raise GenerationFailed(failed.error or "generation failed")


class GenerationFailed(Exception):
    """The engine failed this request after admitting it (answered 500, others unaffected)."""


class ClientDisconnected(Exception):
    pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts its generations) if the client leaves."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientDisconnected
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


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


def finish_reason(out: RequestOutput) -> str | None:
    return out.finish_reason.value if out.finished and out.finish_reason else None


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode_bytes([token_id]).decode("utf-8", errors="replace")
