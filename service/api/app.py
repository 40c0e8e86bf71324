"""create_app(settings): the FastAPI app; the lifespan loads the model and runs the engine."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.api import adapters, chat, completions, embeddings, responses
from service.api.chat_template import ChatTemplate
from service.api.metrics import Metrics
from service.api.middleware import BodyLimit, Gate, count_rejection, owner_of
from service.api.protocol import APIError, DetokenizeRequest, TokenizeRequest
from service.api.serving import GenerationFailed, encode_messages
from service.api.state import ServingState
from service.config import Settings
from service.engine.process.attach import Attach
from service.engine.process.client import EngineClient

log = logging.getLogger("kvserve.api")
STATIC = Path(__file__).with_name("static")


def build_state(settings: Settings, attach: Attach | None = None) -> ServingState:
    """Start the engine core and assemble the serving state. Blocking. The core runs in a
    thread of this process or in a process of its own, or (attach) is the one the
    supervisor of --api-server-count fronts started (service/build.py: engine_link)."""
    from service.build import engine_link

    client = EngineClient(engine_link(settings, attach), stuck_after_s=settings.stuck_after)
    ready = client.start()
    metrics = Metrics(ready.model_id)
    client.observer = metrics
    metrics.attach_engine(client.snapshot, ready.info, client.device_memory)
    model_dir = Path(ready.model_dir) if ready.model_dir else None
    return ServingState(
        settings=settings.replace(max_num_seqs=ready.max_num_seqs),
        engine=client,
        tokenizer=client.tokenizer,
        model_id=ready.model_id,
        template=ChatTemplate.for_model(model_dir),
        audit=ready.audit,
        metrics=metrics,
        measure_floors=client.floors,
    )


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict"})


def _type_tag(part: object) -> bool:
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or "-" in part)


def create_app(
    settings: Settings, state_factory: Callable[[Settings], ServingState] = build_state
) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.serving = None
        app.state.load_error = None

        async def load_and_watch() -> None:
            try:
                serving = await asyncio.to_thread(state_factory, settings)
                # What loading made (the model's modules, the tokenizer's and the grammar
                # engine's tables) lives as long as the process: out of the collector's
                # sight, a full collection, which holds the GIL and so every stream, scans
                # only what serving made since (docs/decisions.md)
                gc.collect()
                gc.freeze()
                app.state.serving = serving
                log.info("model loaded", extra={"model": app.state.serving.model_id})
            except Exception as exc:  # /health says "failed"; the process exits non-zero
                log.error("model failed to load: %s", exc)
                app.state.load_error = exc
                _stop(app)
                return
            while app.state.serving.engine.alive:  # a dead engine loop ends the process
                await asyncio.sleep(0.25)
            log.error("engine loop died: %r", app.state.serving.engine.error)
            _stop(app)

        watcher = asyncio.ensure_future(load_and_watch())
        yield
        watcher.cancel()
        if app.state.serving is not None:
            app.state.serving.engine.shutdown()

    app = FastAPI(title="kvserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    _install_errors(app)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.cors_origins),
            allow_methods=["*"],
            allow_headers=["*"],
        )

    app.add_middleware(Gate, settings=settings)
    app.include_router(completions.router)
    app.include_router(chat.router)
    app.include_router(embeddings.router)
    app.include_router(responses.router)
    app.include_router(adapters.router)
    app.include_router(routes)
    return app


def _stop(app: FastAPI) -> None:
    """Ask the hosting server (service.server) to exit; it then exits non-zero."""
    stop = getattr(app.state, "stop_server", None)
    if stop is not None:
        stop()


def _install_errors(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        count_rejection(request.app.state, exc)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        first = exc.errors()[0] if exc.errors() else {}
        in_body = first.get("loc", ("body",))[0] == "body"  # else a query parameter's
        if in_body and kind != "application/json":  # a form, text or no content type
            err = APIError(
                415,
                f"Content-Type must be application/json, got {kind or 'none'!r}",
                code="unsupported_media_type",
            )
            count_rejection(request.app.state, err)
            return JSONResponse(err.body(), status_code=415)
        if first.get("type") == "json_invalid":  # its loc is a character offset: no param
            where = first.get("loc", ("body", "?"))[-1]
            message = f"Invalid JSON in the request body at character {where}"
            param = None
        else:
            # pydantic names the union member it tried ("str", "list[int]", ...): not a param
            loc = [str(p) for p in first.get("loc", ())[1:] if not _type_tag(p)]
            param = ".".join(loc) or None
            message = first.get("msg", "invalid request")
            message = f"{param}: {message}" if param else f"Invalid request body: {message}"
        err = APIError(400, message, param=param)
        count_rejection(request.app.state, err)
        return JSONResponse(err.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        message, code = str(exc.detail), None
        if status == 404:
            message, code = "Not found", "not_found"
        elif status == 405:
            headers = {k.lower(): v for k, v in (exc.headers or {}).items()}
            allowed = headers.get("allow", "")
            message = f"{request.method} is not allowed on {request.url.path}; use {allowed}"
            code = "method_not_allowed"
        err = APIError(status, message, code=code, headers=dict(exc.headers or {}))
        return JSONResponse(err.body(), status_code=status, headers=err.headers)

    @app.exception_handler(GenerationFailed)
    async def failed(_: Request, exc: GenerationFailed) -> JSONResponse:
        return JSONResponse(APIError(500, str(exc)).body(), status_code=500)


def _serving(request: Request) -> ServingState:
    state = request.app.state.serving
    if state is None:
        raise APIError(503, "The model is still loading")
    return state


# the routes beside the API's own (completions, chat, embeddings, responses)
routes = APIRouter()


@routes.get("/health")
async def health(request: Request) -> JSONResponse:
    state: ServingState | None = request.app.state.serving
    if state is None:
        status = "failed" if request.app.state.load_error is not None else "loading"
        return JSONResponse({"status": status}, status_code=503)
    ok, body = _health(state)
    return JSONResponse(body, status_code=200 if ok else 503)


def _health(state: ServingState) -> tuple[bool, dict[str, Any]]:
    """Whether the server is healthy, and what /health says of it."""
    snap = state.engine.snapshot()
    replay_down = snap.kv_events_replay_up is False  # a KV events reader gets no replay
    ok = state.engine.healthy() and not state.draining and not replay_down
    status = "draining" if state.draining else ("ok" if ok else "unhealthy")
    body: dict[str, Any] = {
        "status": status,
        "model": state.model_id,
        "running": snap.running,
        "waiting": snap.waiting,
        "kv_cache": {
            "blocks_total": snap.kv_blocks_total,
            "blocks_used": snap.kv_blocks_used,
            "bytes_total": snap.kv_bytes_total,
            "bytes_used": snap.kv_bytes_used,
            "usage": snap.kv_usage,
        },
    }
    if replay_down:
        body["kv_events"] = "the replay socket's thread has failed"
    if state.fronts > 1:  # which of --api-server-count answered
        body["front"] = state.engine.front
    return ok, body


def _model_card(state: ServingState, detail: bool, adapter: str | None = None) -> dict[str, Any]:
    """The model's card, or a LoRA adapter's (its parent the model, as vLLM lists them)."""
    card: dict[str, Any] = {
        "id": adapter or state.model_id,
        "object": "model",
        "created": int(state.started),
        "owned_by": "kvserve",
        "max_model_len": state.max_model_len,
        "parent": state.model_id if adapter else None,
    }
    if detail and adapter is None:  # the family and its variations, then the memory audit
        memory = dict(state.audit)
        card["architecture"] = memory.pop("architecture")
        card["features"] = memory.pop("features")
        card["memory"] = memory
    return card


@routes.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    state = _serving(request)  # the models the request's API key may use
    names = state.models_for(owner_of(request))
    cards = [_model_card(state, False, state.adapter_of(name)) for name in names]
    return JSONResponse({"object": "list", "data": cards})


@routes.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> JSONResponse:
    state = _serving(request)
    adapter = state.check_model(model_id, owner_of(request))
    if adapter is not None:
        return JSONResponse(_model_card(state, True, adapter))
    card = _model_card(state, True)
    if state.floors is None:  # measured on the engine thread, once
        state.floors = await state.measure_floors()
    card["memory"] = {**card["memory"], "floors": state.floors}
    return JSONResponse(card)


@routes.post("/tokenize")
async def tokenize(req: TokenizeRequest, request: Request) -> JSONResponse:
    state = _serving(request)
    state.check_model(req.model, owner_of(request))
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of prompt or messages", param="prompt")
    if req.prompt is not None:  # off the event loop, as the generation routes do
        add_bos = None if req.add_special_tokens else False
        tokens = await asyncio.to_thread(state.tokenizer.encode, req.prompt, add_bos=add_bos)
    else:
        tokens = await asyncio.to_thread(
            encode_messages, state, req.messages or [], add_generation_prompt=True
        )
    return JSONResponse(
        {"tokens": tokens, "count": len(tokens), "max_model_len": state.max_model_len}
    )


@routes.post("/detokenize")
async def detokenize(req: DetokenizeRequest, request: Request) -> JSONResponse:
    state = _serving(request)
    state.check_model(req.model, owner_of(request))
    bad = next((t for t in req.tokens if not state.tokenizer.valid_id(t)), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is not in the vocabulary", param="tokens")
    return JSONResponse({"prompt": state.tokenizer.decode(req.tokens)})


@routes.get("/metrics")
async def metrics(request: Request) -> Response:
    state = _serving(request)
    return Response(state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


@routes.get("/")
async def index() -> FileResponse:
    return FileResponse(STATIC / "index.html", media_type="text/html")


@routes.get("/favicon.ico", include_in_schema=False)
async def favicon() -> FileResponse:
    return FileResponse(STATIC / "favicon.svg", media_type="image/svg+xml")
