"""POST /v1/responses: OpenAI's Responses API over the chat path (service/api/chat.py
prepares the request, chat_output.py reads its thinking, text and tool calls), formatted
here from the generation's deltas: `input` (text, or message, function_call and
function_call_output items) after `instructions`, `tools` and `tool_choice`,
`text.format`, `max_output_tokens`; the answer as output items (reasoning, message,
function_call), and streamed as the Responses API's events. `previous_response_id`
continues a stored conversation (service/api/response_store.py); one not stored is a
404."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError
from starlette.background import BackgroundTask

from service.api.chat import ChatRun, prepare
from service.api.middleware import owner_of
from service.api.protocol import APIError, ChatCompletionRequest
from service.api.serving import (
    ClientDisconnected,
    collect,
    finish_reason,
    generate,
    raise_if_failed,
    until_disconnect,
)
from service.api.sse import usage
from service.api.state import ServingState
from service.limits import MAX_MESSAGES, MAX_TOOLS, PRIORITY_RANGE

router = APIRouter()


# OpenAI's bounds on metadata: it is stored and returned, never read by the model
MetadataKey = Annotated[str, StringConstraints(max_length=64)]
MetadataValue = Annotated[str, StringConstraints(max_length=512)]


class TextConfig(BaseModel):
    """`text`: the output's format; any other key is refused (it would be stored)."""

    model_config = ConfigDict(extra="forbid")
    format: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(BaseModel):
    """`reasoning`: its effort reaches the templates that read one (gpt-oss's)."""

    model_config = ConfigDict(extra="ignore")
    effort: Literal["minimal", "low", "medium", "high"] | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    input: str | list[dict[str, Any]] = Field(max_length=MAX_MESSAGES)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    priority: int | None = Field(default=None, ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1])
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[MetadataKey, MetadataValue] | None = Field(default=None, max_length=16)
    reasoning: ReasoningConfig | None = None


def _new(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- the request, as a chat request ---------------------------------------------------


def _messages(state: ServingState, req: ResponsesRequest, owner: str) -> list[dict[str, Any]]:
    """The conversation: the stored one before (without its instructions), these
    instructions, this input."""
    earlier: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        found = state.responses.get(req.previous_response_id, owner)
        if found is None:
            raise APIError(404, f"Response with id '{req.previous_response_id}' not found.",
                           param="previous_response_id", code="not_found")  # fmt: skip
        earlier = found
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    return system + earlier + _items(req.input)


def _items(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": item.get("role", "user"), "content": _text(item, i)})
        elif kind == "function_call":
            _strings(item, i, "call_id", "name", "arguments")
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}  # fmt: skip
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            _strings(item, i, "call_id")
            output = item.get("output")
            text = output if isinstance(output, str) else json.dumps(output)
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        elif kind != "reasoning":  # earlier thinking is not sent back to the model
            raise APIError(400, f"input[{i}]: item type {kind!r} is not supported",
                           param=f"input[{i}]")  # fmt: skip
    return out


_ITEM_IDS = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
             "reasoning": "rs"}  # fmt: skip


def _input_items(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input as the items GET /v1/responses/{id}/input_items lists: a text input as
    one user message, each item with an id (its own where it had one) and only the
    fields its type has (what else a client sends is not stored)."""
    if isinstance(value, str):
        value = [{"type": "message", "role": "user",
                  "content": [{"type": "input_text", "text": value}]}]  # fmt: skip
    items = []
    for item in value:
        kind = item.get("type", "message")
        kept = {k: item[k] for k in _ITEM_FIELDS.get(kind, ()) if k in item}
        if isinstance(kept.get("content"), list):
            kept["content"] = [_part(p) for p in kept["content"]]
        items.append({"id": _new(_ITEM_IDS.get(kind, "item")), **kept, "type": kind})
    return items


_ITEM_FIELDS = {
    "message": ("id", "role", "content", "status"),
    "function_call": ("id", "call_id", "name", "arguments", "status"),
    "function_call_output": ("id", "call_id", "output", "status"),
    "reasoning": ("id", "summary", "content", "status"),
}


def _part(part: Any) -> Any:
    """A content part as stored: its type and text."""
    if not isinstance(part, dict):
        return part
    return {k: part[k] for k in ("type", "text") if k in part}


def _strings(item: dict[str, Any], i: int, *names: str) -> None:
    for name in names:
        if not isinstance(item.get(name), str):
            raise APIError(400, f"input[{i}].{name} must be a string", param=f"input[{i}].{name}")


def _text(item: dict[str, Any], i: int) -> str:
    content = item.get("content", "")
    if isinstance(content, str):
        return content
    parts = []
    for part in content if isinstance(content, list) else []:
        if not isinstance(part, dict) or part.get("type") not in (
            "input_text",
            "output_text",
            "text",
        ):
            raise APIError(400, f"input[{i}]: a content part must be text",
                           param=f"input[{i}].content")  # fmt: skip
        parts.append(part.get("text", ""))
    return "".join(parts)


def _tools(req: ResponsesRequest) -> tuple[list[dict[str, Any]] | None, Any]:
    """Its function tools and tool_choice in the chat API's shapes."""
    tools = None
    if req.tools:
        tools = []
        for i, tool in enumerate(req.tools):
            if tool.get("type") != "function":
                raise APIError(400, f"tools[{i}]: only function tools are supported",
                               param=f"tools[{i}]")  # fmt: skip
            fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
            tools.append({"type": "function", "function": fn})
    choice = req.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return tools, choice


def _format(req: ResponsesRequest) -> dict[str, Any] | None:
    fmt = req.text.format if req.text else None
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return {"type": fmt.get("type")}  # json_object, or what the chat path refuses


def _chat_request(state: ServingState, req: ResponsesRequest, owner: str) -> tuple:
    """The request as a chat request (run by the chat path's preparation, chat.prepare),
    and its conversation."""
    messages = _messages(state, req, owner)
    tools, choice = _tools(req)
    body = {
        "model": req.model, "messages": messages, "tools": tools, "tool_choice": choice,
        "parallel_tool_calls": req.parallel_tool_calls, "response_format": _format(req),
        "max_tokens": req.max_output_tokens, "temperature": req.temperature,
        "top_p": req.top_p, "priority": state.priority_of(req.priority, owner),
        "reasoning_effort": req.reasoning.effort if req.reasoning else None,
    }  # fmt: skip
    try:
        return ChatCompletionRequest(**body), messages
    except ValidationError as exc:
        error = exc.errors()[0]
        raise APIError(400, f"input: {error['msg']}", param="input") from None


# ---- the answer, as output items ------------------------------------------------------


def _output(message: dict[str, Any]) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        items.append(_reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        items.append(_message_item(message["content"]))
    for call in message.get("tool_calls") or []:
        items.append(
            _call_item(call["id"], call["function"]["name"], call["function"]["arguments"])
        )
    return items


def _reasoning_item(text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": _new("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}  # fmt: skip


def _message_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": _new("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}  # fmt: skip


def _call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": _new("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}  # fmt: skip


def _response(
    req: ResponsesRequest, rid: str, created: int, model: str, output: list, usage: dict | None,
    finish: str | None,
) -> dict[str, Any]:  # fmt: skip
    incomplete = finish == "length"
    return {
        "id": rid, "object": "response", "created_at": created, "model": model,
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None, "output": output, "instructions": req.instructions,
        "tools": _echoed_tools(req), "tool_choice": req.tool_choice or "auto",
        "parallel_tool_calls": req.parallel_tool_calls, "temperature": req.temperature,
        "top_p": req.top_p, "max_output_tokens": req.max_output_tokens,
        "previous_response_id": req.previous_response_id, "store": req.store,
        "text": _echoed_text(req), "metadata": req.metadata or {},
        "usage": _usage(usage) if usage else None,
    }  # fmt: skip


def _echoed_tools(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The tools as the response repeats them: the fields a function tool has."""
    keys = ("type", "name", "description", "parameters", "strict")
    return [{k: t[k] for k in keys if k in t} for t in req.tools or []]


def _echoed_text(req: ResponsesRequest) -> dict[str, Any]:
    text = req.text.model_dump(exclude_none=True) if req.text else {}
    return {"format": {"type": "text"}, **text}


def _usage(chat: dict[str, Any]) -> dict[str, Any]:
    cached = (chat.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": chat["prompt_tokens"], "output_tokens": chat["completion_tokens"],
        "total_tokens": chat["total_tokens"], "input_tokens_details": {"cached_tokens": cached},
        "output_tokens_details": {"reasoning_tokens": 0},
    }  # fmt: skip


@dataclass(frozen=True, slots=True)
class _Asked:
    """What a response remembers of its request."""

    req: ResponsesRequest
    owner: str  # the API key's (middleware.owner_of)
    rid: str
    created: int
    messages: list[dict[str, Any]]  # the conversation, as chat messages


def _remember(
    state: ServingState, asked: _Asked, output: list[dict[str, Any]], response: dict[str, Any]
) -> None:
    """Store the response, and the conversation with its output (no instructions: each
    request gives its own) for a later previous_response_id."""
    req, messages = asked.req, asked.messages
    if not req.store:
        return
    said = [m for m in messages if not (m["role"] == "system" and m["content"] == req.instructions)]
    text = "".join(c["text"] for i in output if i["type"] == "message" for c in i["content"])
    calls = [{"id": i["call_id"], "type": "function",
              "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in output if i["type"] == "function_call"]  # fmt: skip
    reply: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        reply["tool_calls"] = calls
    state.responses.put(asked.rid, asked.owner, [*said, reply], response, _input_items(req.input))


@router.post("/v1/responses")
async def responses(req: ResponsesRequest, request: Request) -> Response:
    state: ServingState = request.app.state.serving
    owner = owner_of(request)
    state.check_model(req.model, owner)
    chat, messages = _chat_request(state, req, owner)
    run = await prepare(state, chat)
    prompt, params = run.request.prompt_ids, run.request.params
    admission = state.admit(1, len(prompt) + params.max_tokens)
    rid, created = _new("resp"), int(time.time())
    asked = _Asked(req, owner, rid, created, messages)
    if req.stream:
        events = _events(state, asked, run, admission.release)
        return StreamingResponse(
            events, media_type="text/event-stream", background=BackgroundTask(admission.arelease)
        )
    try:
        work = collect(state, rid, run.request)
        (choice,) = await until_disconnect(request, work)
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        admission.release()
    raise_if_failed([choice])
    reader = run.reader()
    output = _output(reader.message(choice.text))
    spent = usage(len(prompt), len(choice.token_ids), choice.cached)
    finish = reader.finish_reason(choice.finish_reason)
    done = _response(req, rid, created, state.served_name(req.model), output, spent, finish)
    _remember(state, asked, output, done)
    return JSONResponse(done)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> JSONResponse:
    """A stored response, as it was returned (a 404 where none is stored)."""
    found = request.app.state.serving.responses.response(response_id, owner_of(request))
    if found is None:
        raise _not_found(response_id)
    return JSONResponse(found)


@router.get("/v1/responses/{response_id}/input_items")
async def input_items(
    response_id: str,
    request: Request,
    limit: int = Query(default=20, ge=1, le=100),
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> JSONResponse:
    """A stored response's input items, a page at a time, as OpenAI lists them (newest
    first unless order is asc; after: the id the page starts after)."""
    items = request.app.state.serving.responses.inputs(response_id, owner_of(request))
    if items is None:
        raise _not_found(response_id)
    items = items[::-1] if order == "desc" else items
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise APIError(400, f"No input item with id '{after}' in response '{response_id}'",
                           param="after")  # fmt: skip
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return JSONResponse({
        "object": "list", "data": page, "has_more": len(items) > limit,
        "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None,
    })  # fmt: skip


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> JSONResponse:
    if not request.app.state.serving.responses.delete(response_id, owner_of(request)):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param="response_id",
                    code="not_found")  # fmt: skip


# ---- streaming -------------------------------------------------------------------------


async def _events(
    state: ServingState, asked: _Asked, run: ChatRun, release: Callable[[], None]
) -> AsyncIterator[bytes]:
    """The chat generation's deltas, read into thinking, text and tool calls, as the
    Responses API's events; an error after the 200 as an `error` event."""
    out, reader = _EventStream(), run.reader()
    req, model = asked.req, state.served_name(asked.req.model)
    shell = _response(req, asked.rid, asked.created, model, [], None, None)
    shell["status"] = "in_progress"
    yield out.event("response.created", response=shell)
    yield out.event("response.in_progress", response=shell)
    completion, cached, finish = 0, 0, None
    try:
        async for outs in generate(state, asked.rid, run.request):
            for o in outs:
                if o.finished and o.error:
                    raise APIError(500, o.error)
                completion, cached = completion + len(o.token_ids), o.num_cached_tokens
                finish = reader.finish_reason(finish_reason(o)) or finish
                for event in out.delta(reader.feed(o.text, o.finished)):
                    yield event
    except Exception as exc:  # the 200 is already sent: the error goes inside the stream
        error = exc.body()["error"] if isinstance(exc, APIError) else {"message": str(exc)}
        yield out.event("error", code=error.get("code"), message=error.get("message"), param=None)
        return
    finally:
        release()
    for event in out.done():
        yield event
    spent = usage(len(run.request.prompt_ids), completion, cached)
    done = _response(req, asked.rid, asked.created, model, out.output, spent, finish)
    _remember(state, asked, out.output, done)
    kind = "response.incomplete" if done["status"] == "incomplete" else "response.completed"
    yield out.event(kind, response=done)


class _EventStream:
    """A streamed response's output items as they grow, and the events that say so."""

    def __init__(self) -> None:
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.text: dict[str, Any] | None = None
        self.reasoning: dict[str, Any] | None = None
        self.calls: dict[int, dict[str, Any]] = {}  # the function_call items, by call index

    def event(self, kind: str, **fields: Any) -> bytes:
        self.seq += 1
        data = json.dumps({"type": kind, "sequence_number": self.seq - 1, **fields})
        return f"event: {kind}\ndata: {data}\n\n".encode()

    def delta(self, delta: dict[str, Any]) -> Iterator[bytes]:
        """The events of one chat delta: reasoning, then text, then tool calls."""
        if delta.get("reasoning_content"):
            yield from self._reasoning(delta["reasoning_content"])
        if delta.get("content"):
            yield from self._text(delta["content"])
        for call in delta.get("tool_calls") or []:  # a header, then fragments
            yield from self._call(call)

    def _reasoning(self, text: str) -> Iterator[bytes]:
        if self.reasoning is None:
            self.reasoning = _reasoning_item("")
            self.output.append(self.reasoning)
            yield self.event("response.output_item.added", output_index=len(self.output) - 1,
                             item=self.reasoning)  # fmt: skip
        self.reasoning["content"][0]["text"] += text
        yield self.event("response.reasoning_text.delta", item_id=self.reasoning["id"],
                         output_index=self.output.index(self.reasoning), content_index=0,
                         delta=text)  # fmt: skip

    def _text(self, text: str) -> Iterator[bytes]:
        if self.text is None:
            self.text = _message_item("", "in_progress")
            self.output.append(self.text)
            at = len(self.output) - 1
            yield self.event("response.output_item.added", output_index=at,
                             item={**self.text, "content": []})  # fmt: skip
            yield self.event("response.content_part.added", item_id=self.text["id"],
                             output_index=at, content_index=0,
                             part={"type": "output_text", "text": "", "annotations": []})  # fmt: skip
        self.text["content"][0]["text"] += text
        yield self.event("response.output_text.delta", item_id=self.text["id"],
                         output_index=self.output.index(self.text), content_index=0,
                         delta=text, logprobs=[])  # fmt: skip

    def _call(self, call: dict[str, Any]) -> Iterator[bytes]:
        fn = call["function"]
        if call["index"] not in self.calls:
            item = _call_item(call["id"], fn["name"], "", "in_progress")
            self.calls[call["index"]] = item
            self.output.append(item)
            yield self.event("response.output_item.added", output_index=len(self.output) - 1,
                             item=item)  # fmt: skip
        item = self.calls[call["index"]]
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            yield self.event("response.function_call_arguments.delta", item_id=item["id"],
                             output_index=self.output.index(item), delta=fn["arguments"])  # fmt: skip

    def done(self) -> Iterator[bytes]:
        """Each item's closing events: the calls, the reasoning, the text."""
        output = self.output
        for item in self.calls.values():
            at, item["status"] = output.index(item), "completed"
            yield self.event("response.function_call_arguments.done", item_id=item["id"],
                             output_index=at, arguments=item["arguments"], name=item["name"])  # fmt: skip
            yield self.event("response.output_item.done", output_index=at, item=item)
        if self.reasoning is not None:
            at, text = output.index(self.reasoning), self.reasoning["content"][0]["text"]
            yield self.event("response.reasoning_text.done", item_id=self.reasoning["id"],
                             output_index=at, content_index=0, text=text)  # fmt: skip
            yield self.event("response.output_item.done", output_index=at, item=self.reasoning)
        if self.text is not None:
            at, part = output.index(self.text), self.text["content"][0]
            self.text["status"] = "completed"
            yield self.event("response.output_text.done", item_id=self.text["id"],
                             output_index=at, content_index=0, text=part["text"], logprobs=[])  # fmt: skip
            yield self.event("response.content_part.done", item_id=self.text["id"],
                             output_index=at, content_index=0, part=part)  # fmt: skip
            yield self.event("response.output_item.done", output_index=at, item=self.text)
