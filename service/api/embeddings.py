"""POST /v1/embeddings: each input's final hidden states pooled (--pooling: the last
token's or the mean) and normalised, through the engine as requests that sample nothing:
the inputs of a call and of concurrent calls share its steps."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from service.api.middleware import owner_of
from service.api.protocol import APIError, EmbeddingRequest
from service.api.serving import (
    ClientDisconnected,
    generate,
    new_id,
    prompt_ids,
    until_disconnect,
    validate_prompt,
)
from service.api.state import ServingState
from service.engine.core.checks import Checked
from service.engine.request import SamplingParams

router = APIRouter()


def _inputs(state: ServingState, req: EmbeddingRequest) -> list[list[int]]:
    """Runs in a worker thread: tokenizing a large body must not hold up the event loop."""
    inputs = prompt_ids(state, req.input, "input")
    if not all(inputs):
        raise APIError(400, "input: must not be empty", param="input")
    return inputs


async def _embed(state: ServingState, request_id: str, request: Checked) -> list[float]:
    embedding = None
    async for outs in generate(state, request_id, request):
        for out in outs:
            embedding = out.embedding if out.embedding is not None else embedding
    if embedding is None:
        raise APIError(500, f"request {request_id}: the engine returned no embedding")
    return embedding


def _encoded(values: list[float], encoding: str) -> list[float] | str:
    """OpenAI's base64: the little-endian float32 bytes."""
    if encoding == "float":
        return values
    return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode("ascii")


@router.post("/v1/embeddings")
async def embeddings(req: EmbeddingRequest, request: Request) -> Response:
    state: ServingState = request.app.state.serving
    lora = state.check_model(req.model, owner_of(request))
    size = int(state.audit.get("hidden_size", 0))
    if req.dimensions is not None and req.dimensions != size:
        raise APIError(
            400,
            f"dimensions: this model's embeddings have {size} (no shorter ones: it was not "
            "trained to truncate them)",
            param="dimensions",
        )
    inputs = await asyncio.to_thread(_inputs, state, req)
    params = SamplingParams(max_tokens=1, pooling=state.settings.pooling, lora=lora)
    checked = [await validate_prompt(state, ids, params) for ids in inputs]
    admission = state.admit(len(inputs), sum(len(ids) + 1 for ids in inputs))
    rid = new_id("embd")
    try:
        work = asyncio.gather(*(_embed(state, f"{rid}-{i}", c) for i, c in enumerate(checked)))
        vectors: list[list[float]] = await until_disconnect(request, work)
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        admission.release()
    tokens = sum(map(len, inputs))
    data: list[dict[str, Any]] = [
        {"object": "embedding", "index": i, "embedding": _encoded(v, req.encoding_format)}
        for i, v in enumerate(vectors)
    ]
    body = {
        "object": "list",
        "data": data,
        "model": state.served_name(lora),
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return JSONResponse(body)
