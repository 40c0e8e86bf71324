"""What crosses between the fronts and the engine core (core.py and client.py): typed
messages, passed as they are within a process and msgpack-encoded by msgspec between
processes (transport.py). A step's outputs for every request of a front travel to it as
one message, with the engine's snapshot; the observer's events go with one front's
message."""

from __future__ import annotations

from typing import Any

import msgspec

from service.engine.core.checks import Checked, Limits
from service.engine.core.stats import EngineSnapshot
from service.engine.output import RequestOutput
from service.engine.request import ParamError

# ---- front -> engine -------------------------------------------------------------------


class Add(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    request: Checked  # checked by the front
    front: int = 0  # the front process whose stream it is: its outputs go there


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_id: str


class Stopped(msgspec.Struct, tag=True, array_like=True):
    """A stop string, found by the front, ended this sequence with its `kept`-th output
    token (service/engine/text/)."""

    sequence_id: str
    kept: int


class Floors(msgspec.Struct, tag=True, array_like=True):
    """Measure this machine's floors for the model (torch work, between steps)."""

    front: int = 0  # who asked: the result goes there


class AdapterChange(msgspec.Struct, tag=True, array_like=True):
    """Load the LoRA adapter at `path` as `name` (path None: unload `name`); the answer,
    AdapterChanged under the same ticket, goes to `front`."""

    ticket: str
    name: str
    path: str | None = None
    front: int = 0


class FrontGone(msgspec.Struct, tag=True, array_like=True):
    """A front process died (from the supervisor, service/fronts.py): its requests are
    aborted, what was queued for it dropped, and a Ready waits for its replacement."""

    front: int


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    """Finish: the engine ends what is in flight with an error and exits."""


ToEngine = Add | Abort | Stopped | Floors | AdapterChange | FrontGone | Shutdown

# ---- engine -> front -------------------------------------------------------------------


class StepEvent(msgspec.Struct, tag=True, array_like=True):
    seconds: float
    num_tokens: int
    num_seqs: int


class Intervals(msgspec.Struct, tag=True, array_like=True):
    seconds: list[float]


class Finished(msgspec.Struct, tag=True, array_like=True):
    output: RequestOutput


Event = StepEvent | Intervals | Finished


class Ready(msgspec.Struct, tag=True, array_like=True):
    limits: Limits
    eos_ids: list[int]  # the tokenizer's, as the engine loaded it
    stop_ids: list[int]  # every id that ends a sequence (the tokenizer's and the config's)
    max_num_seqs: int
    model_id: str
    model_dir: str | None
    audit: dict[str, Any]
    info: dict[str, str]
    snapshot: EngineSnapshot


class Rejected(msgspec.Struct, array_like=True):
    """An add the engine could not take: why, and the parameter at fault where the
    request's parameters were (a 400), else a bug (the request fails alone)."""

    request_id: str
    why: str
    param: str | None = None

    @classmethod
    def of(cls, request_id: str, exc: Exception) -> Rejected:
        if isinstance(exc, ParamError):
            return cls(request_id, exc.message, exc.param)
        return cls(request_id, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)


class Step(msgspec.Struct, tag=True, array_like=True):
    outputs: list[RequestOutput]
    failed: list[Rejected]
    snapshot: EngineSnapshot
    events: list[Event]
    busy: bool
    device_memory: tuple[int, int] | None


class FloorsResult(msgspec.Struct, tag=True, array_like=True):
    floors: dict[str, Any] | None
    error: str | None = None


class Failed(msgspec.Struct, tag=True, array_like=True):
    """The engine could not start, or its loop died: why."""

    error: str


class AdapterChanged(msgspec.Struct, tag=True, array_like=True):
    """What an AdapterChange did: the adapters served after it, or why it failed
    (missing: there was no such adapter to unload)."""

    ticket: str
    adapters: tuple[str, ...]
    error: str | None = None
    missing: bool = False


FromEngine = Ready | Step | FloorsResult | AdapterChanged | Failed

encode = msgspec.msgpack.Encoder().encode
decode_to_engine = msgspec.msgpack.Decoder(ToEngine).decode
decode_from_engine = msgspec.msgpack.Decoder(FromEngine).decode
