"""LoRA adapters loaded and unloaded at run time, with vLLM's routes and bodies:
POST /v1/load_lora_adapter {"lora_name", "lora_path"} and /v1/unload_lora_adapter
{"lora_name"}. A load reads a path on the server's machine, so the routes are for
operators: they take one of --admin-api-keys, and are off without one. An unloaded
adapter takes no new request; those already in flight under it finish first."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from service.api.middleware import holds_key
from service.api.protocol import APIError, LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from service.api.state import ServingState
from service.engine.process.client import AdapterChangeError

router = APIRouter()


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(req: LoadLoraAdapterRequest, request: Request) -> PlainTextResponse:
    state = _admitted(request)
    if req.lora_name == state.model_id:
        raise APIError(400, "lora_name: that is the served model's id", param="lora_name")
    await _change(state, req.lora_name, req.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(req: UnloadLoraAdapterRequest, request: Request) -> PlainTextResponse:
    state = _admitted(request)
    await _change(state, req.lora_name, None)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


def _admitted(request: Request) -> ServingState:
    """The serving state, for a request that carries one of --admin-api-keys."""
    state: ServingState = request.app.state.serving
    keys = state.settings.admin_api_keys
    if not keys:
        raise APIError(
            403, "loading LoRA adapters at run time is off: the server has no --admin-api-keys"
        )
    if not holds_key(request.headers.get("authorization", ""), keys):
        raise APIError(403, "loading and unloading LoRA adapters takes an admin API key")
    return state


async def _change(state: ServingState, name: str, path: str | None) -> None:
    try:
        await state.engine.change_adapter(name, path)
    except AdapterChangeError as exc:
        raise APIError(404 if exc.missing else 400, str(exc), param="lora_name") from None
