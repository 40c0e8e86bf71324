"""What the HTTP routes share: the engine, its tokenizer and template, the metrics, and
admission with backpressure (a waiting queue capped by count and by KV demand)."""

from __future__ import annotations

import functools
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from model.tokenizer import Tokenizer
from service.api.chat_template import ChatTemplate
from service.api.metrics import Metrics
from service.api.protocol import APIError
from service.api.reasoning import think_markers
from service.api.response_store import IN_MEMORY, ResponseStore
from service.api.tool_formats import ToolFormat, format_for
from service.config import Settings
from service.engine.process.client import EngineClient


async def _no_floors() -> dict[str, Any]:
    return {}


@dataclass
class ServingState:
    settings: Settings
    engine: EngineClient
    tokenizer: Tokenizer
    model_id: str
    template: ChatTemplate
    audit: dict[str, Any]
    metrics: Metrics
    # measures this machine's floors for the model (torch work: the engine runs it
    # between steps), and their first measurement
    measure_floors: Callable[[], Awaitable[dict[str, Any]]] = _no_floors
    floors: dict[str, Any] | None = None
    inflight: int = 0  # admitted sequences not yet finished
    inflight_tokens: int = 0  # their KV demand: prompt + max_tokens each
    draining: bool = False
    started: float = field(default_factory=time.time)
    # (when, KV tokens) of recently released admissions: how fast demand drains
    released: deque[tuple[float, int]] = field(default_factory=deque)

    def __post_init__(self) -> None:
        _ = self.tool_format  # a format the model cannot write is a start-up error

    @property
    def fronts(self) -> int:
        """Front processes sharing the engine (service/fronts.py): each admits its share
        of the engine's sequences, waiting queue and KV pool."""
        return self.settings.api_server_count

    @functools.cached_property
    def responses(self) -> ResponseStore:
        """The stored responses /v1/responses continues from: every front's (in the
        supervisor's folder) when this is one of several, else this process's."""
        s, attach = self.settings, self.engine.attach
        path = attach.responses if attach is not None else IN_MEMORY
        budget = int(s.responses_store_mib * (1 << 20))
        return ResponseStore(s.responses_store_size, s.responses_store_ttl, budget, path)

    @functools.cached_property
    def think_ids(self) -> tuple[int, int] | None:
        """The ids of a reasoning model's think markers (service/api/reasoning.py), where
        each is one token whose text the output keeps; None for other models."""
        return think_markers(self.tokenizer)

    @functools.cached_property
    def tool_format(self) -> ToolFormat:
        """How the model writes tool calls (service/api/tool_formats.py)."""
        setting = self.settings.tool_call_format
        return format_for(setting, self.template.source, self.tokenizer.special_ids)

    @property
    def harmony(self) -> bool:
        """Whether the model writes OpenAI's harmony (gpt-oss: channels for its thinking,
        answer and calls, service/api/harmony.py): its tool-call format says so."""
        return self.tool_format.name == "harmony"

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def adapters(self) -> tuple[str, ...]:
        """The LoRA adapters served beside the model (--lora-modules, and loaded since)."""
        return self.engine.adapters

    @functools.cached_property
    def key_models(self) -> dict[str, frozenset[str]]:
        """The models each limited API key may use, by its owner (--api-key-models)."""
        return self.settings.key_models

    def models_for(self, owner: str) -> tuple[str, ...]:
        """The model's id and the adapters' names that `owner`'s key may use."""
        names = (self.model_id, *self.adapters)
        allowed = self.key_models.get(owner)
        return names if allowed is None else tuple(n for n in names if n in allowed)

    def check_model(self, name: str | None, owner: str) -> str | None:
        """What a request's `model` runs: None for the server's model (also when not
        given), or the name of a LoRA adapter; a 404 for any other name, or for one the
        request's API key (its owner) may not use."""
        wanted, served = name or self.model_id, self.models_for(owner)
        if wanted not in served:
            listed = ", ".join(f"'{n}'" for n in served) or "none"
            why = (
                f"this server serves {listed}"
                if owner not in self.key_models
                else f"this API key may use {listed}"
            )
            raise APIError(
                404,
                f"The model '{wanted}' does not exist or is not yours to use: {why}",
                param="model",
                code="model_not_found",
            )
        return self.adapter_of(wanted)

    def priority_of(self, asked: int | None, owner: str) -> int:
        """A request's priority: what it asks for, else its API key's default (0 where
        --api-key-priority does not list the key); a 400 naming `priority` for one other
        than 0 under --scheduling-policy fcfs (vLLM's), or for one more urgent (lower)
        than the key's ceiling."""
        default, ceiling = self.settings.key_priority.get(owner, (0, None))
        if asked is None:
            return default
        if asked != 0 and self.settings.scheduling_policy != "priority":
            raise APIError(400, "priority: this server schedules first come, first served "
                           "(--scheduling-policy fcfs); leave it out or 0", param="priority")  # fmt: skip
        if ceiling is not None and asked < ceiling:
            raise APIError(400, f"priority: this API key may ask for {ceiling} at the most "
                           f"urgent (lower goes first), not {asked}", param="priority")  # fmt: skip
        return asked

    def adapter_of(self, name: str | None) -> str | None:
        """The LoRA adapter a checked `model` names (None: the server's model)."""
        return None if name is None or name == self.model_id else name

    def served_name(self, name: str | None) -> str:
        """The `model` a response names: the adapter a checked `model` names, else the
        server's model."""
        return self.adapter_of(name) or self.model_id

    def admit(self, n_seqs: int, kv_tokens: int = 0) -> Admission:
        """Take n sequences (needing up to kv_tokens of KV cache) in, or answer 503
        (draining) or 429: the waiting queue is full by count, or what is in flight
        would need more KV than the pool and a queue of the same proportion hold."""
        if self.draining:
            raise APIError(503, "The server is shutting down and accepts no new requests")
        if not self.engine.alive:
            raise APIError(503, "The engine is not running")
        settings, fronts = self.settings, self.fronts
        seqs, queue = math.ceil(settings.max_num_seqs / fronts), settings.max_queue // fronts
        waiting = max(0, self.inflight + n_seqs - seqs)
        if waiting > queue:
            raise APIError(
                429,
                f"The server is at capacity ({self.inflight} sequences in flight, "
                f"waiting queue cap {queue}); retry shortly",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        pool = int(self.audit.get("kv_pool_tokens", 0)) // fronts
        allowed = pool * (1 + settings.max_queue / settings.max_num_seqs)
        excess = self.inflight_tokens + kv_tokens - allowed
        if pool and self.inflight_tokens and excess > 0:
            raise APIError(
                429,
                f"The KV cache is oversubscribed ({self.inflight_tokens} tokens of prompt + "
                f"max_tokens in flight for a pool of {pool}); retry shortly",
                code="kv_cache_full",
                headers={"Retry-After": str(self._drain_seconds(excess))},
            )
        self.inflight += n_seqs
        self.inflight_tokens += kv_tokens
        return Admission(self, n_seqs, kv_tokens)

    def _drain_seconds(self, tokens: float, window: float = 30.0) -> int:
        """Seconds until `tokens` of demand drain at the rate admissions were released
        over the last `window` seconds (1 to 60; 1 when nothing finished lately)."""
        now = time.monotonic()
        while self.released and now - self.released[0][0] > window:
            self.released.popleft()
        rate = sum(t for _, t in self.released) / window
        return 1 if rate == 0 else max(1, min(60, math.ceil(tokens / rate)))


class Admission:
    """Releases its sequences exactly once, whichever way the request ends."""

    def __init__(self, state: ServingState, n: int, kv_tokens: int = 0) -> None:
        self.state, self.n, self.kv_tokens = state, n, kv_tokens

    def release(self) -> None:
        if self.n:
            self.state.inflight -= self.n
            self.state.inflight_tokens -= self.kv_tokens
            self.state.released.append((time.monotonic(), self.kv_tokens))
            self.n = 0

    async def arelease(self) -> None:
        """release() as a response's background task: Starlette runs a sync one in a worker
        thread, where `inflight -= n` would race the event loop's `+=`."""
        self.release()
