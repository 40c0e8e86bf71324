"""ASGI middleware of the API: body limit (413), API keys (401), 503 while loading,
a request id (and, among several fronts, the front's index) on every response, one
structured log line per request, rejection counting."""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
import uuid
from typing import Any

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.metrics import REJECT_REASONS
from service.api.protocol import APIError
from service.config import Settings

log = logging.getLogger("kvserve.api")
OPEN_PATHS = ("/health", "/metrics", "/", "/favicon.ico")


def count_rejection(app_state: Any, err: APIError) -> None:
    serving = getattr(app_state, "serving", None)
    if serving is None or (err.status >= 500 and err.status != 503):
        return
    reason = (
        err.code
        if err.code == "context_length_exceeded"
        else REJECT_REASONS.get(err.status, str(err.status))
    )
    serving.metrics.on_rejected(reason)


class BodyLimit:
    """413 for a body over the limit, by Content-Length or as it streams in."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        too_large = APIError(413, f"request body exceeds {self.limit} bytes")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            count_rejection(scope["app"].state, too_large)
            return await _send_error(send, too_large)
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge
            return message

        try:
            await self.app(scope, limited, send)
        except _TooLarge:
            count_rejection(scope["app"].state, too_large)
            await _send_error(send, too_large)


class _TooLarge(Exception):
    pass


async def _send_error(send: Send, err: APIError) -> None:
    response = JSONResponse(err.body(), status_code=err.status, headers=err.headers)
    await response({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


class Gate:
    """Request id, API keys, 503 while loading, and one structured log line per request."""

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app, self.settings = app, settings
        # /metrics takes the API keys too where --metrics-auth asks for it
        self.open_paths = tuple(
            p for p in OPEN_PATHS if not (settings.metrics_auth and p == "/metrics")
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers") or []}
        request_id = headers.get("x-request-id") or uuid.uuid4().hex[:16]
        scope.setdefault("state", {})["request_id"] = request_id
        start, status = time.perf_counter(), 0

        async def tagged(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = message.setdefault("headers", [])
                headers.append((b"x-request-id", request_id.encode()))
                if (front := _front(app_state)) is not None:  # which of several answered
                    headers.append((b"x-kvserve-front", str(front).encode()))
            await send(message)

        path = scope["path"]
        app_state = scope["app"].state
        try:
            if path not in self.open_paths:
                scope["state"]["owner"] = _authorize(
                    self.settings, headers.get("authorization", "")
                )
            if path not in OPEN_PATHS and app_state.serving is None:
                failed = app_state.load_error is not None
                raise APIError(
                    503, "The model failed to load" if failed else "The model is still loading"
                )
        except APIError as exc:
            count_rejection(app_state, exc)
            await _send_error(tagged, exc)
        else:
            await self.app(scope, receive, tagged)
        if app_state.serving is not None:
            app_state.serving.metrics.on_http(path, status)
        log.info(
            "request",
            extra={
                "request_id": request_id,
                "method": scope["method"],
                "path": path,
                "status": status,
                "ms": round(1000 * (time.perf_counter() - start), 1),
            },
        )


def _front(app_state: Any) -> int | None:
    """This front's index where the server runs several (--api-server-count)."""
    serving = getattr(app_state, "serving", None)
    if serving is None or serving.fronts == 1:
        return None
    return serving.engine.front


def _authorize(settings: Settings, header: str) -> str:
    """Check the request's API key; what it makes is owned by the key's SHA-256 ("" when
    the server takes no keys: one owner for all)."""
    if not settings.api_keys:
        return ""
    token = _bearer(header)
    if not token:
        raise APIError(
            401, "Missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"
        )
    if not holds_key(header, (*settings.api_keys, *settings.admin_api_keys)):
        raise APIError(401, "Incorrect API key provided", code="invalid_api_key")
    return hashlib.sha256(token.encode()).hexdigest()


def _bearer(header: str) -> str:
    """The token of an 'Authorization: Bearer <token>' header ("" for none)."""
    scheme, _, token = header.partition(" ")
    return token if scheme.lower() == "bearer" else ""


def holds_key(header: str, keys: tuple[str, ...]) -> bool:
    """Whether an Authorization header carries one of `keys` (compared in constant time,
    every key compared)."""
    token = _bearer(header).encode()
    matches = [hmac.compare_digest(token, key.encode()) for key in keys]
    return bool(token) and any(matches)


def owner_of(request: Any) -> str:
    """Who owns what a request stores (Gate's _authorize)."""
    return request.scope.get("state", {}).get("owner", "")
