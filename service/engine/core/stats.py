"""What the engine counts and reports: its counters, the snapshot other threads read, and
the observer it tells about each step (service.api.metrics implements it)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # the fronts read snapshots without torch's import
    from torch import Tensor

from service.engine.output import RequestOutput


class EngineObserver(Protocol):
    """Receives measurements from the engine thread (service.api.metrics implements it)."""

    def on_step(self, seconds: float, num_tokens: int, num_seqs: int) -> None: ...
    def on_token_intervals(self, seconds: list[float]) -> None: ...
    def on_finished(self, output: RequestOutput) -> None: ...


@dataclass(slots=True)
class EngineStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    preemptions: int = 0
    spec_draft_tokens: int = 0  # speculative decoding: drafts verified ...
    spec_accepted_tokens: int = 0  # ... and accepted
    host_copy_seconds: float = 0.0  # the host tier's copies, out and in
    finished: Counter[str] = field(default_factory=Counter)

    def snapshot(
        self,
        running: int,
        waiting: int,
        blocks_used: int,
        blocks_total: int,
        block_bytes: int,
        window_bytes: tuple[int, int] = (0, 0),
    ) -> EngineSnapshot:
        """These counters with the engine's gauges, frozen. window_bytes: the bytes used
        and held of the windowed layers' own pool, in the KV bytes (not the blocks)."""
        return EngineSnapshot(
            running=running,
            waiting=waiting,
            kv_blocks_total=blocks_total,
            kv_blocks_used=blocks_used,
            kv_bytes_total=blocks_total * block_bytes + window_bytes[1],
            kv_bytes_used=blocks_used * block_bytes + window_bytes[0],
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            prefix_queried_tokens=self.prefix_queried_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens,
            preemptions=self.preemptions,
            spec_draft_tokens=self.spec_draft_tokens,
            spec_accepted_tokens=self.spec_accepted_tokens,
            finished=tuple(sorted(self.finished.items())),
        )


EXPERT_READ_S = 1.0  # how often the experts' counters are read (a device read on CUDA)


class ExpertLoad:
    """The tokens a mixture's layers routed to each expert (model/moe.py's counters, on
    the model's device), read at most once every EXPERT_READ_S: what each step's
    snapshot carries, without a device read each step."""

    def __init__(self, counters: Sequence[tuple[int, Tensor]], clock: Callable[[], float]):
        self.counters, self.clock = counters, clock
        self.read_at = -math.inf
        self.value: tuple[tuple[int, tuple[int, ...]], ...] = ()

    def sample(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
        if self.counters and self.clock() - self.read_at >= EXPERT_READ_S:
            self.value = tuple((layer, tuple(c.tolist())) for layer, c in self.counters)
            self.read_at = self.clock()
        return self.value


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """The engine's gauges and counters at one moment, built on the engine thread: what
    other threads (the metrics, /health) read instead of the live objects."""

    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_bytes_total: int
    kv_bytes_used: int
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    preemptions: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    finished: tuple[tuple[str, int], ...] = ()  # (finish reason, requests)
    # the prefix cache's host tier (service/engine/kv/host_tier.py): 0 without one
    kv_host_blocks_total: int = 0
    kv_host_blocks_used: int = 0
    kv_host_block_bytes: int = 0
    kv_host_stored_blocks: int = 0  # copied out of the device pool
    kv_host_restored_blocks: int = 0  # copied back in: prefix hits it saved
    kv_host_dropped_blocks: int = 0  # evicted from the tier itself
    kv_host_copy_seconds: float = 0.0
    # its disk tier (service/engine/kv/disk_tier.py)
    kv_disk_blocks: int = 0
    kv_disk_bytes: int = 0
    kv_disk_written_blocks: int = 0
    kv_disk_read_blocks: int = 0  # read back for a hit
    kv_disk_corrupt_blocks: int = 0  # files that failed their checks (recomputed)
    # KV events' replay socket (service/engine/kv/kv_events.py): None without one
    kv_events_replay_up: bool | None = None
    kv_events_malformed: int = 0  # replay requests dropped as malformed
    # a mixture of experts' (layer, tokens routed to each expert), where --expert-metrics
    # counts them (ExpertLoad's latest reading)
    expert_tokens: tuple[tuple[int, tuple[int, ...]], ...] = ()
    # LoRA adapters (service/engine/core/adapter_slots.py): those served, the adapters of
    # the running and the waiting requests, the requests each has taken, the bank's
    # slots and the adapters put into them (evictions: in place of another)
    lora_adapters: tuple[str, ...] = ()
    lora_running: tuple[str, ...] = ()
    lora_waiting: tuple[str, ...] = ()
    lora_requests: tuple[tuple[str, int], ...] = ()
    max_loras: int = 0
    lora_loads: int = 0
    lora_evictions: int = 0
    # under --scheduling-policy priority: (priority, waiting, running) requests
    priorities: tuple[tuple[int, int, int], ...] = ()

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0
