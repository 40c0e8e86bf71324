"""POST /v1/completions: a thin route over the serving logic."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from service.api.protocol import APIError, CompletionRequest
from service.api.serving import (
    Choice,
    ClientDisconnected,
    check_stream_options,
    collect,
    finish_reason,
    generate,
    new_id,
    raise_if_failed,
    sampling_params,
    token_text,
    until_disconnect,
    validate_prompt,
)
from service.api.sse import stream_chunks, usage
from service.api.state import ServingState
from service.engine.output import RequestOutput, TokenLogprobs
from service.engine.request import EMPTY_PROMPT
from service.limits import MAX_PROMPTS

router = APIRouter()


def _prompts(state: ServingState, req: CompletionRequest) -> list[list[int]]:
    """Runs in a worker thread: tokenizing a large body must not hold up the event loop."""
    p = req.prompt
    if isinstance(p, str):
        return [state.tokenizer.encode(p)]
    if not p:
        raise APIError(400, EMPTY_PROMPT, param="prompt")
    if not isinstance(p[0], int) and len(p) > MAX_PROMPTS:
        raise APIError(400, f"at most {MAX_PROMPTS} prompts in one request", param="prompt")
    if all(isinstance(x, str) for x in p):
        return [state.tokenizer.encode(x) for x in p]  # type: ignore[arg-type]
    if all(isinstance(x, int) for x in p):
        return [list(p)]  # type: ignore[arg-type]
    if all(isinstance(x, list) for x in p):
        return [list(x) for x in p]  # type: ignore[arg-type]
    raise APIError(400, "prompt must be a string, a list of strings, or token ids", param="prompt")


def _echoes(state: ServingState, req: CompletionRequest, prompts: list[list[int]]) -> list[str]:
    """The text echo=true puts before each prompt's completion: the prompt as written
    (not a decode of its ids, which would add the BOS and lose how the text was
    spelled), or for prompts given as ids their decode."""
    if not req.echo:
        return [""] * len(prompts)
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        return list(p)  # type: ignore[arg-type]
    return [state.tokenizer.decode(ids) for ids in prompts]


def _logprobs(state: ServingState, lps: list[TokenLogprobs], offset: int) -> dict[str, Any]:
    tokens, values, tops, offsets = [], [], [], []
    for lp in lps:
        text = token_text(state.tokenizer, lp.token_id)
        tokens.append(text)
        values.append(lp.logprob)
        tops.append({token_text(state.tokenizer, t): v for t, v in lp.top})
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request) -> Response:
    state: ServingState = request.app.state.serving
    state.check_model(req.model)
    if req.suffix is not None:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(
            400, "best_of must equal n (other values are not supported)", param="best_of"
        )
    if req.echo and req.logprobs is not None:
        raise APIError(400, "echo together with logprobs is not supported", param="echo")
    include_usage = check_stream_options(req)
    prompts = await asyncio.to_thread(_prompts, state, req)
    params = sampling_params(req, req.max_tokens or 16, req.logprobs)
    for ids in prompts:
        await validate_prompt(state, ids, params)
    demand = sum(len(ids) + params.max_tokens for ids in prompts) * req.n
    admission = state.admit(len(prompts) * req.n, demand)
    rid, created = new_id("cmpl"), int(time.time())
    head = {"id": rid, "object": "text_completion", "created": created, "model": state.model_id}
    if req.stream:
        body = _stream(state, req, prompts, params, head, include_usage, admission.release)
        return StreamingResponse(
            body, media_type="text/event-stream", background=BackgroundTask(admission.arelease)
        )
    try:
        work = asyncio.gather(
            *(collect(state, f"{rid}-{i}", ids, params) for i, ids in enumerate(prompts))
        )
        results: list[list[Choice]] = await until_disconnect(request, work)
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        admission.release()
    for choices in results:
        raise_if_failed(choices)
    out_choices = []
    for i, (echo, choices) in enumerate(zip(_echoes(state, req, prompts), results, strict=True)):
        for j, c in enumerate(choices):
            lp = _logprobs(state, c.logprobs, len(echo)) if req.logprobs is not None else None
            out_choices.append(
                {
                    "index": i * req.n + j,
                    "text": echo + c.text,
                    "logprobs": lp,
                    "finish_reason": c.finish_reason,
                }
            )
    completion = sum(len(c.token_ids) for cs in results for c in cs)
    cached = sum(cs[0].cached for cs in results)
    body = {
        **head,
        "choices": out_choices,
        "usage": usage(sum(map(len, prompts)), completion, cached),
    }
    return JSONResponse(body)


def _stream(
    state: ServingState,
    req: CompletionRequest,
    prompts: list[list[int]],
    params: Any,
    head: dict[str, Any],
    include_usage: bool,
    release: Any,
) -> AsyncIterator[bytes]:
    rid = head["id"]
    offsets: dict[int, int] = {}  # text sent so far per choice (logprobs' text_offset)
    opening = []
    if req.echo:
        for i, text in enumerate(_echoes(state, req, prompts)):
            for j in range(req.n):
                offsets[i * req.n + j] = len(text)
                opening.append(
                    {"index": i * req.n + j, "text": text, "logprobs": None, "finish_reason": None}
                )

    def choice(i: int, out: RequestOutput) -> dict[str, Any] | None:
        index, reason = i * req.n + out.index, finish_reason(out)
        if not out.text and reason is None and not (req.logprobs is not None and out.logprobs):
            return None  # empty deltas are skipped, unless they carry logprobs
        lp = None
        if req.logprobs is not None:
            lp = _logprobs(state, out.logprobs, offsets.get(index, 0))
        offsets[index] = offsets.get(index, 0) + len(out.text)
        return {"index": index, "text": out.text, "logprobs": lp, "finish_reason": reason}

    streams = [generate(state, f"{rid}-{i}", ids, params) for i, ids in enumerate(prompts)]
    prompt_tokens = sum(map(len, prompts))
    return stream_chunks(head, opening, streams, choice, prompt_tokens, include_usage, release)
