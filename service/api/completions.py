"""POST /v1/completions: a thin route over the serving logic."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from msgspec.structs import replace
from starlette.background import BackgroundTask

from service.api.middleware import owner_of
from service.api.prompt_logprobs import check_size, echo_logprobs, vllm_prompt_logprobs
from service.api.protocol import APIError, CompletionRequest
from service.api.serving import (
    Choice,
    ClientDisconnected,
    check_stream_options,
    collect,
    finish_reason,
    generate,
    new_id,
    prompt_ids,
    raise_if_failed,
    sampling_params,
    token_text,
    until_disconnect,
    validate_prompt,
)
from service.api.sse import encoded_in_turns, stream_chunks, usage
from service.api.state import ServingState
from service.engine.core.checks import Checked
from service.engine.output import RequestOutput, TokenLogprobs

router = APIRouter()


def _prompts(state: ServingState, req: CompletionRequest) -> list[list[int]]:
    """Runs in a worker thread: tokenizing a large body must not hold up the event loop."""
    return prompt_ids(state, req.prompt, "prompt")


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
    lora = state.check_model(req.model, owner_of(request))
    req.priority = state.priority_of(req.priority, owner_of(request))
    if req.suffix is not None:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(
            400, "best_of must equal n (other values are not supported)", param="best_of"
        )
    if req.max_tokens == 0 and not req.echo:
        raise APIError(
            400, "max_tokens 0 scores the prompt alone and needs echo true", param="max_tokens"
        )
    include_usage = check_stream_options(req)
    prompts = await asyncio.to_thread(_prompts, state, req)
    max_tokens = 16 if req.max_tokens is None else max(req.max_tokens, 1)  # 0: one, dropped
    params = sampling_params(req, max_tokens, req.logprobs, _scored(req), lora)
    checked = [await validate_prompt(state, ids, params) for ids in prompts]
    _check_scored_size(req, prompts)
    demand = sum(len(ids) + params.max_tokens for ids in prompts) * req.n
    admission = state.admit(len(prompts) * req.n, demand)
    rid, created = new_id("cmpl"), int(time.time())
    head = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": state.served_name(lora),
    }
    if req.stream:
        body = _stream(state, req, checked, head, include_usage, admission.release)
        return StreamingResponse(
            body, media_type="text/event-stream", background=BackgroundTask(admission.arelease)
        )
    try:
        work = asyncio.gather(*(collect(state, f"{rid}-{i}", c) for i, c in enumerate(checked)))
        results: list[list[Choice]] = await until_disconnect(request, work)
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        admission.release()
    for choices in results:
        raise_if_failed(choices)
    return await encoded_in_turns(_body(state, req, prompts, results, head))


def _body(
    state: ServingState,
    req: CompletionRequest,
    prompts: list[list[int]],
    results: list[list[Choice]],
    head: dict[str, Any],
) -> dict[str, Any]:
    """The whole response: each prompt's choices, with the echo and the logprobs asked
    for (a prompt's lists of them as iterators, encoded in turns)."""
    out_choices = []
    for i, (echo, choices) in enumerate(zip(_echoes(state, req, prompts), results, strict=True)):
        scored = choices[0].prompt_logprobs or []
        for j, c in enumerate(choices):
            if req.max_tokens == 0:
                c.text, c.token_ids, c.logprobs = "", [], []
            lp = None
            if req.logprobs is not None:
                lp = _logprobs(state, c.logprobs, len(echo))
                if req.echo:
                    head_lp = echo_logprobs(state, prompts[i], scored, req.logprobs)
                    lp = {k: itertools.chain(head_lp[k], v) for k, v in lp.items()}
            entry = {
                "index": i * req.n + j,
                "text": echo + c.text,
                "logprobs": lp,
                "finish_reason": c.finish_reason,
            }
            if req.prompt_logprobs is not None:
                entry["prompt_logprobs"] = vllm_prompt_logprobs(state, scored, req.prompt_logprobs)
            out_choices.append(entry)
    completion = sum(len(c.token_ids) for cs in results for c in cs)
    cached = sum(cs[0].cached for cs in results)
    return {
        **head,
        "choices": out_choices,
        "usage": usage(sum(map(len, prompts)), completion, cached),
    }


def _check_scored_size(req: CompletionRequest, prompts: list[list[int]]) -> None:
    """echo's and prompt_logprobs' entries for every prompt token, within the cap."""
    forms = {"logprobs": req.logprobs if req.echo else None,
             "prompt_logprobs": req.prompt_logprobs}  # fmt: skip
    asked = {k: v for k, v in forms.items() if v is not None}
    if asked:
        param = "prompt_logprobs" if "prompt_logprobs" in asked else "logprobs"
        check_size(sum(map(len, prompts)), req.n, list(asked.values()), param)


def _stream(
    state: ServingState,
    req: CompletionRequest,
    checked: list[Checked],
    head: dict[str, Any],
    include_usage: bool,
    release: Any,
) -> AsyncIterator[bytes]:
    rid, prompts = head["id"], [c.prompt_ids for c in checked]
    offsets: dict[int, int] = {}  # text sent so far per choice (logprobs' text_offset)
    echoes = _echoes(state, req, prompts)
    # the prompt's logprobs come with its first token: the echo then waits for them
    deferred = _scored(req) is not None
    opening = []
    if req.echo and not deferred:
        for i, text in enumerate(echoes):
            for j in range(req.n):
                offsets[i * req.n + j] = len(text)
                opening.append(
                    {"index": i * req.n + j, "text": text, "logprobs": None, "finish_reason": None}
                )
    scored: dict[int, list[TokenLogprobs]] = {}  # prompt -> its first choice's entries
    started: set[int] = set()  # choices whose echo and prompt logprobs went out

    def choice(i: int, out: RequestOutput) -> dict[str, Any] | None:
        index, reason = i * req.n + out.index, finish_reason(out)
        if req.max_tokens == 0:  # the prompt scored alone: its one token is not sent
            out = replace(out, text="", token_ids=[], logprobs=[])
        if out.prompt_logprobs is not None:
            scored[i] = out.prompt_logprobs
        head: dict[str, Any] = {}
        if deferred and index not in started and i in scored:
            started.add(index)
            head = _stream_head(state, req, echoes[i], prompts[i], scored[i])
            offsets[index] = len(head["text"])
        has_lp = req.logprobs is not None and (out.logprobs or "logprobs" in head)
        if not (out.text or head) and reason is None and not has_lp:
            return None  # empty deltas are skipped, unless they carry logprobs
        lp = None
        if req.logprobs is not None:
            lp = _logprobs(state, out.logprobs, offsets.get(index, 0))
            if "logprobs" in head:
                lp = {k: itertools.chain(head["logprobs"][k], v) for k, v in lp.items()}
        offsets[index] = offsets.get(index, 0) + len(out.text)
        text = head.get("text", "") + out.text
        entry = {"index": index, "text": text, "logprobs": lp, "finish_reason": reason}
        if "prompt_logprobs" in head:
            entry["prompt_logprobs"] = head["prompt_logprobs"]
        return entry

    streams = [generate(state, f"{rid}-{i}", c) for i, c in enumerate(checked)]
    prompt_tokens = sum(map(len, prompts))
    return stream_chunks(head, opening, streams, choice, prompt_tokens, include_usage, release)


def _scored(req: CompletionRequest) -> int | None:
    """The alternatives each prompt token's logprob comes with (None: not scored)."""
    wanted = [n for n in (req.logprobs if req.echo else None, req.prompt_logprobs) if n is not None]
    return max(wanted) if wanted else None


def _stream_head(
    state: ServingState,
    req: CompletionRequest,
    echo: str,
    prompt: list[int],
    scored: list[TokenLogprobs],
) -> dict[str, Any]:
    """What a streamed choice's first chunk carries before its first token: the echo and
    its logprobs, and vLLM's prompt_logprobs."""
    head: dict[str, Any] = {"text": echo}
    if req.echo and req.logprobs is not None:
        head["logprobs"] = echo_logprobs(state, prompt, scored, req.logprobs)
    if req.prompt_logprobs is not None:
        head["prompt_logprobs"] = vllm_prompt_logprobs(state, scored, req.prompt_logprobs)
    return head
