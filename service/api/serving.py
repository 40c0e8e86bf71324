"""Serving logic shared by the completion and chat routes: request -> SamplingParams,
the engine's checks as 400s, running generations, and a client that leaves. Admission is
in state.py, the SSE wire format in sse.py."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from model.tokenizer import Tokenizer
from service.api.chat_template import ChatTemplateError
from service.api.protocol import APIError, SamplingFields
from service.api.state import ServingState
from service.api.structured import constraint_of
from service.engine.core.checks import Checked, ContextLengthError
from service.engine.output import RequestOutput
from service.engine.process.streams import EngineDeadError, RequestFailed
from service.engine.request import ParamError, SamplingParams
from service.engine.sample.structured import SETUP_POOL
from service.limits import MAX_PROMPTS

T = TypeVar("T")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sampling_params(
    req: SamplingFields,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    lora: str | None = None,
) -> SamplingParams:
    """lora: the adapter the request's model names (ServingState.check_model)."""
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
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens,
            cache_salt=req.cache_salt,
            lora=lora,
            priority=req.priority or 0,
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
) -> Checked:
    """The request checked (the one time it is), else a 400; a structured-output
    constraint is compiled, and its start matcher built, off the event loop and below
    the engine's priority."""
    try:
        if params.constraint is None:
            return state.engine.validate(prompt_ids, params)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(SETUP_POOL, state.engine.validate, prompt_ids, params)
    except ParamError as exc:
        raise bad_request(exc) from None


def prompt_ids(state: ServingState, value: str | list[Any], param: str) -> list[list[int]]:
    """A prompt (or an embeddings input) in any of OpenAI's forms: a string, strings, token
    ids, lists of ids; as token ids, one list per prompt."""
    if isinstance(value, str):
        return [state.tokenizer.encode(value)]
    if not value:
        raise APIError(400, f"{param}: must not be empty", param=param)
    if not isinstance(value[0], int) and len(value) > MAX_PROMPTS:
        raise APIError(400, f"at most {MAX_PROMPTS} prompts in one request", param=param)
    if all(isinstance(x, str) for x in value):
        return [state.tokenizer.encode(x) for x in value]
    if all(isinstance(x, int) for x in value):
        return [list(value)]
    if all(isinstance(x, list) for x in value):
        return [list(x) for x in value]
    raise APIError(400, f"{param} must be a string, a list of strings, or token ids", param=param)


def encode_messages(
    state: ServingState,
    messages: list[Any],
    add_generation_prompt: bool,
    template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Chat messages rendered with the model's template (template_kwargs: a request's
    chat_template_kwargs; tools: its tools, as templates read them), as token ids."""
    rendered = [_message(m) for m in messages]
    if tools:
        template_kwargs = {**(template_kwargs or {}), "tools": tools}
    try:
        text = state.template.render(rendered, add_generation_prompt, template_kwargs)
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), param="messages") from None
    # the template writes any BOS itself; special tokens in it are real special tokens
    return state.tokenizer.encode(text, add_bos=False)


def _message(m: Any) -> dict[str, Any]:
    """A message as templates read it: an assistant's tool calls with their arguments as
    objects (templates write them with tojson), a tool result's call id."""
    out: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.name:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        out["tool_calls"] = [_template_call(c) for c in m.tool_calls]
    return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function") or {}
    arguments = fn.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise APIError(
                400, "a tool call's arguments must be a JSON object", param="messages"
            ) from None
    # both shapes templates read: tool_call.function.arguments, tool_call.arguments
    function = {**fn, "arguments": arguments}
    return {**call, "function": function, "name": fn.get("name"), "arguments": arguments}


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
    prompt_logprobs: list[Any] | None = None  # the first choice's (SamplingParams)
    finish_reason: str | None = None
    cached: int = 0
    error: str | None = None


async def collect(state: ServingState, request_id: str, request: Checked) -> list[Choice]:
    choices = [Choice() for _ in range(request.params.n)]
    async for outs in generate(state, request_id, request):
        for out in outs:
            c = choices[out.index]
            c.text += out.text
            c.token_ids += out.token_ids
            c.logprobs += out.logprobs
            if out.prompt_logprobs is not None:
                c.prompt_logprobs = out.prompt_logprobs
            c.cached = out.num_cached_tokens
            if out.finished:
                c.finish_reason = out.finish_reason.value if out.finish_reason else None
                c.error = out.error
    return choices


async def generate(
    state: ServingState, request_id: str, request: Checked
) -> AsyncIterator[list[RequestOutput]]:
    try:
        async for outs in state.engine.generate(request_id, request):
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


def finish_reason(out: RequestOutput) -> str | None:
    return out.finish_reason.value if out.finished and out.finish_reason else None


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode_bytes([token_id]).decode("utf-8", errors="replace")
