"""POST /v1/chat/completions: a thin route over the serving logic."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from service.api.chat_output import ChoiceReader, MessageReader
from service.api.chat_template import TEMPLATE_VARIABLES
from service.api.harmony import HarmonyReader
from service.api.middleware import owner_of
from service.api.prompt_logprobs import check_size, vllm_prompt_logprobs
from service.api.protocol import APIError, ChatCompletionRequest
from service.api.reasoning import grammar_start, opens_thinking
from service.api.serving import (
    Choice,
    ClientDisconnected,
    check_stream_options,
    collect,
    encode_messages,
    finish_reason,
    generate,
    new_id,
    raise_if_failed,
    sampling_params,
    until_disconnect,
    validate_prompt,
)
from service.api.sse import encoded_in_turns, stream_chunks, usage
from service.api.state import ServingState
from service.api.tools import Tools, tools_of
from service.engine.core.checks import Checked
from service.engine.output import RequestOutput, TokenLogprobs
from service.engine.request import SamplingParams

router = APIRouter()


def _entry(state: ServingState, token_id: int, logprob: float) -> dict[str, Any]:
    raw = state.tokenizer.decode_bytes([token_id])
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}


def _logprobs(state: ServingState, lps: list[TokenLogprobs]) -> dict[str, Any]:
    return {
        "content": [
            {
                **_entry(state, lp.token_id, lp.logprob),
                "top_logprobs": [_entry(state, t, v) for t, v in lp.top],
            }
            for lp in lps
        ]
    }


@dataclass(frozen=True, slots=True)
class ChatRun:
    """A chat request made ready to run: its prompt, its sampling, and a reader per
    choice for its thinking, content and tool calls (chat_output.py). Chat completions
    and /v1/responses each format what the readers yield."""

    request: Checked  # its prompt and sampling
    markers: tuple[int, int] | None  # the model's think markers (None: it does not reason)
    thinking: bool  # the prompt left the think block open
    tools: Tools | None
    include_reasoning: bool
    harmony: bool = False  # the model writes harmony's channels (service/api/harmony.py)

    def reader(self) -> MessageReader:
        if self.harmony:
            return HarmonyReader(self.tools, self.include_reasoning)
        thinking = self.thinking if self.markers is not None else None
        return ChoiceReader(thinking, self.tools, self.include_reasoning)


async def prepare(state: ServingState, req: ChatCompletionRequest) -> ChatRun:
    """Render, tokenize and check a chat request (400s for what is wrong with it)."""
    tools = tools_of(req.tools, req.tool_choice, req.parallel_tool_calls, state.tool_format)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs to be true", param="top_logprobs")
    template_kwargs = _template_kwargs(req)
    budget = req.max_thinking_tokens or req.thinking_token_budget
    # rendering and tokenizing a large conversation (and, the first time, finding the
    # think markers) run off the event loop
    listed = tools.template_value() if tools is not None else None
    prompt, markers = await asyncio.to_thread(_render, state, req, template_kwargs, listed)
    if budget is not None and markers is None:
        param = "max_thinking_tokens" if req.max_thinking_tokens else "thinking_token_budget"
        raise APIError(400, f"{param}: the model has no <think> markers to budget", param=param)
    thinking = markers is not None and opens_thinking(prompt, markers)
    max_tokens = (
        req.max_completion_tokens or req.max_tokens or max(1, state.max_model_len - len(prompt))
    )
    top = (req.top_logprobs or 0) if req.logprobs else None
    lora = state.adapter_of(req.model)  # checked by the route
    params = sampling_params(req, max_tokens, top, req.prompt_logprobs, lora)
    if budget is not None:
        params = replace(params, thinking_budget=budget, think_ids=markers, thinking_open=thinking)
    params = _with_tools(params, tools)
    if state.harmony:  # its markers are special tokens the reader reads
        params = replace(params, skip_special_tokens=False)
    if params.constraint is not None and (start := grammar_start(prompt, markers)):
        params = replace(params, constraint=replace(params.constraint, think=start))
    checked = await validate_prompt(state, prompt, params)
    if req.prompt_logprobs is not None:
        check_size(len(prompt), req.n, [req.prompt_logprobs], "prompt_logprobs")
    return ChatRun(checked, markers, thinking, tools, req.include_reasoning, state.harmony)


def _with_tools(params: SamplingParams, tools: Tools | None) -> SamplingParams:
    """A request's sampling with its tools: their grammar, and special tokens kept where
    the model's call opens with one."""
    if tools is None:
        return params
    if tools.format.keeps_special_tokens:
        params = replace(params, skip_special_tokens=False)
    if params.constraint is None:
        return replace(params, constraint=tools.constraint())
    if tools.choice != "auto":
        raise APIError(400, "tool_choice required or a named function takes no structured "
                       "output beside it", param="tool_choice")  # fmt: skip
    return params


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
    state: ServingState = request.app.state.serving
    state.check_model(req.model, owner_of(request))
    req.priority = state.priority_of(req.priority, owner_of(request))
    include_usage = check_stream_options(req)
    run = await prepare(state, req)
    prompt, params = run.request.prompt_ids, run.request.params
    admission = state.admit(req.n, (len(prompt) + params.max_tokens) * req.n)
    rid, created = new_id("chatcmpl"), int(time.time())
    if req.stream:
        head = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": state.served_name(req.model),
        }
        readers = [run.reader() for _ in range(req.n)]
        body = _stream(state, req, run.request, head, include_usage, admission.release, readers)
        return StreamingResponse(
            body, media_type="text/event-stream", background=BackgroundTask(admission.arelease)
        )
    try:
        choices = await until_disconnect(request, collect(state, rid, run.request))
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        admission.release()
    raise_if_failed(choices)
    readers = [run.reader() for _ in choices]
    return await encoded_in_turns(_body(state, req, prompt, choices, readers, rid, created))


def _body(
    state: ServingState,
    req: ChatCompletionRequest,
    prompt: list[int],
    choices: list[Choice],
    readers: list[MessageReader],
    rid: str,
    created: int,
) -> dict[str, Any]:
    body = {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": state.served_name(req.model),
        "choices": [
            {
                "index": i,
                "message": reader.message(c.text),
                "logprobs": _logprobs(state, c.logprobs) if req.logprobs else None,
                "finish_reason": reader.finish_reason(c.finish_reason),
            }
            for i, (c, reader) in enumerate(zip(choices, readers, strict=True))
        ],
        "usage": usage(len(prompt), sum(len(c.token_ids) for c in choices), choices[0].cached),
    }
    if req.prompt_logprobs is not None:  # vLLM's: the rendered prompt's tokens
        scored = choices[0].prompt_logprobs or []
        body["prompt_logprobs"] = vllm_prompt_logprobs(state, scored, req.prompt_logprobs)
    return body


def _stream(
    state: ServingState,
    req: ChatCompletionRequest,
    checked: Checked,
    head: dict[str, Any],
    include_usage: bool,
    release: Any,
    readers: list[MessageReader],
) -> AsyncIterator[bytes]:
    """readers: each choice's (its thinking, content and tool calls apart)."""

    def choice(_: int, out: RequestOutput) -> dict[str, Any] | None:
        reader = readers[out.index]
        delta = reader.feed(out.text, out.finished)
        reason = reader.finish_reason(finish_reason(out))
        scored = req.prompt_logprobs is not None and out.prompt_logprobs is not None
        if not (delta or scored) and reason is None and not (req.logprobs and out.logprobs):
            return None  # empty deltas are skipped, unless they carry logprobs
        entry = {
            "index": out.index,
            "delta": delta,
            "logprobs": _logprobs(state, out.logprobs) if req.logprobs else None,
            "finish_reason": reason,
        }
        if scored:  # with the first token, as vLLM
            entry["prompt_logprobs"] = vllm_prompt_logprobs(
                state, out.prompt_logprobs or [], req.prompt_logprobs or 0
            )
        return entry

    roles = (  # the first chunk of each choice names the role
        {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
         "finish_reason": None}
        for i in range(req.n)
    )  # fmt: skip
    streams = [generate(state, head["id"], checked)]
    prompt_tokens = len(checked.prompt_ids)
    return stream_chunks(head, roles, streams, choice, prompt_tokens, include_usage, release)


def _template_kwargs(req: ChatCompletionRequest) -> dict[str, Any] | None:
    """chat_template_kwargs, and reasoning_effort as the templates that take it read it
    (gpt-oss's)."""
    kwargs = req.chat_template_kwargs
    taken = sorted(set(kwargs or ()) & set(TEMPLATE_VARIABLES))
    if taken:
        raise APIError(
            400,
            f"chat_template_kwargs cannot set {taken[0]!r} (the server sets it)",
            param="chat_template_kwargs",
        )
    if req.reasoning_effort is not None:
        kwargs = {"reasoning_effort": req.reasoning_effort, **(kwargs or {})}
    return kwargs


def _render(
    state: ServingState,
    req: ChatCompletionRequest,
    template_kwargs: dict[str, Any] | None,
    tools: list[dict[str, Any]] | None,
) -> tuple[list[int], tuple[int, int] | None]:
    """The prompt's ids, and the model's think markers (None: it does not reason)."""
    prompt = encode_messages(state, req.messages, req.add_generation_prompt, template_kwargs, tools)
    return prompt, state.think_ids
