"""Every Prometheus metric kvserve exports, defined in one place (prefix kvserve_).

Histograms are fed as things happen: the engine thread reports steps, inter-token
intervals and finished requests (with the engine's own timestamps, so TTFT, queue,
prefill and decode times are exact per request) through the EngineObserver interface;
the HTTP layer reports requests and rejections. Gauges and the engine's counters come
from the EngineSnapshot the engine thread publishes after each step, read at scrape time.
Renaming a metric is a breaking change.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from service.engine.core.stats import EngineSnapshot
from service.engine.output import RequestOutput

# why a request is turned away, by its HTTP status (and a prompt too long for the context)
REJECT_REASONS = {
    400: "invalid_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    413: "too_large",
    429: "queue_full",
    503: "unavailable",
}
REJECTION_REASONS = (*REJECT_REASONS.values(), "context_length_exceeded")

MULTIPROCESS = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's switch to shared files

# from a millisecond to about five minutes: a CPU's seconds-long TTFT and a GPU's
# milliseconds both resolve.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.08,
    0.16,
    0.32,
    0.64,
    1.28,
    2.56,
    5.12,
    10.24,
    20.48,
    40.96,
    81.92,
    163.84,
    327.68,
)
# from a millisecond to about ten seconds, finer at the low end: per-token times.
TOKEN_BUCKETS = (
    0.001,
    0.002,
    0.004,
    0.006,
    0.008,
    0.01,
    0.015,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)
COUNT_BUCKETS = tuple(float(2**i) for i in range(16))  # 1 .. 32768 tokens

ROUTES = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/v1/responses",
        "/v1/embeddings",
        "/tokenize",
        "/detokenize",
        "/health",
        "/metrics",
        "/",
    }
)
TEMPLATED = ("/v1/models/", "/v1/responses/")  # a route per prefix: its "{id}"
SUBROUTE = "/input_items"  # the one route below an "{id}"


class Metrics:
    """Owns the registry; implements the engine's EngineObserver."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.registry = CollectorRegistry(auto_describe=True)
        r, m = self.registry, ["model"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, m, buckets=buckets, registry=r)

        self.ttft = hist(
            "kvserve_time_to_first_token_seconds", "Arrival to first output token.", LATENCY_BUCKETS
        )
        self.itl = hist(
            "kvserve_inter_token_latency_seconds",
            "Time between consecutive output tokens of a request.",
            TOKEN_BUCKETS,
        )
        self.tpot = hist(
            "kvserve_time_per_output_token_seconds",
            "Decode time divided by output tokens after the first, per request.",
            TOKEN_BUCKETS,
        )
        self.e2e = hist(
            "kvserve_e2e_request_latency_seconds",
            "Arrival to finish, per request.",
            LATENCY_BUCKETS,
        )
        self.queue = hist(
            "kvserve_request_queue_time_seconds", "Arrival to first scheduling.", LATENCY_BUCKETS
        )
        self.prefill = hist(
            "kvserve_request_prefill_time_seconds",
            "First scheduling to first output token.",
            LATENCY_BUCKETS,
        )
        self.decode = hist(
            "kvserve_request_decode_time_seconds", "First output token to finish.", LATENCY_BUCKETS
        )
        self.step = hist(
            "kvserve_engine_step_duration_seconds",
            "Duration of one engine step (schedule, forward, sample).",
            TOKEN_BUCKETS,
        )
        self.prompt_len = hist(
            "kvserve_request_prompt_tokens", "Prompt tokens per request.", COUNT_BUCKETS
        )
        self.output_len = hist(
            "kvserve_request_generation_tokens", "Generated tokens per request.", COUNT_BUCKETS
        )
        self.step_tokens = hist(
            "kvserve_engine_step_tokens", "Tokens computed per engine step.", COUNT_BUCKETS
        )
        self.rejected = Counter(
            "kvserve_requests_rejected_total",
            "Requests turned away before generation, by reason.",
            ["model", "reason"],
            registry=r,
        )
        for reason in REJECTION_REASONS:  # at 0 from the start: a panel or alert on one
            self.rejected.labels(model, reason)  # reads 0, not "no data"
        self.http = Counter(
            "kvserve_http_requests_total",
            "HTTP requests by route and status.",
            ["route", "status"],
            registry=r,
        )
        for name, h in (
            ("ttft", self.ttft),
            ("itl", self.itl),
            ("tpot", self.tpot),
            ("e2e", self.e2e),
            ("queue", self.queue),
            ("prefill", self.prefill),
            ("decode", self.decode),
            ("step", self.step),
            ("prompt", self.prompt_len),
            ("output", self.output_len),
            ("step_tokens", self.step_tokens),
        ):
            setattr(self, f"_{name}", h.labels(model))

    def attach_engine(
        self,
        snapshot: Callable[[], EngineSnapshot],
        info: dict[str, str],
        device_memory: Callable[[], tuple[int, int] | None],
    ) -> None:
        self.engine = _EngineCollector(self.model, snapshot, info, device_memory)
        self.registry.register(self.engine)

    def exposition(self) -> bytes:
        """What a scrape reads. With several front processes (the supervisor sets
        PROMETHEUS_MULTIPROC_DIR, service/fronts.py) each process's counters and
        histograms live in files there, the engine process's too: every front's scrape
        merges them all, and adds the engine's gauges from its own latest snapshot."""
        if MULTIPROCESS not in os.environ:
            return generate_latest(self.registry)
        merged = CollectorRegistry(auto_describe=True)
        MultiProcessCollector(merged)
        merged.register(self.engine)
        return generate_latest(merged)

    # ---- EngineObserver (called from the engine thread) -------------------------------

    def on_step(self, seconds: float, num_tokens: int, num_seqs: int) -> None:
        self._step.observe(seconds)
        self._step_tokens.observe(num_tokens)

    def on_token_intervals(self, seconds: list[float]) -> None:
        for s in seconds:
            self._itl.observe(s)

    def on_finished(self, out: RequestOutput) -> None:
        self._prompt.observe(out.num_prompt_tokens)
        self._output.observe(out.num_output_tokens)
        if out.finish_time is not None:
            self._e2e.observe(out.finish_time - out.arrival_time)
        if out.first_scheduled_time is not None:
            self._queue.observe(out.first_scheduled_time - out.arrival_time)
        if out.first_token_time is None or out.first_scheduled_time is None:
            return
        self._ttft.observe(out.first_token_time - out.arrival_time)
        self._prefill.observe(out.first_token_time - out.first_scheduled_time)
        if out.finish_time is not None:
            decode = out.finish_time - out.first_token_time
            self._decode.observe(decode)
            if out.num_output_tokens > 1:
                self._tpot.observe(decode / (out.num_output_tokens - 1))

    # ---- the HTTP layer ------------------------------------------------------------------

    def on_http(self, path: str, status: int) -> None:
        prefix = next((p for p in TEMPLATED if path.startswith(p)), None)
        route = path if path in ROUTES else prefix + "{id}" if prefix else "other"
        if prefix and path.endswith(SUBROUTE):
            route += SUBROUTE
        self.http.labels(route, str(status)).inc()

    def on_rejected(self, reason: str) -> None:
        self.rejected.labels(self.model, reason).inc()


class _EngineCollector(Collector):
    """Gauges and engine counters, read at scrape time from the engine's latest snapshot."""

    def __init__(
        self,
        model: str,
        snapshot: Callable[[], EngineSnapshot],
        info: dict[str, str],
        device_memory: Callable[[], tuple[int, int] | None],
    ) -> None:
        self.model, self.snapshot, self.info = model, snapshot, info
        self.device_memory = device_memory

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot()
        m = [self.model]
        yield from self._config(snap)
        yield from _gauges(m, snap)
        yield from _host_tier(m, snap)  # zeros without one, as the speculation's
        yield from _kv_events(m, snap)
        yield from _experts(m, snap)
        yield from _lora(m, snap)
        yield from _priorities(m, snap)
        memory = self.device_memory()
        if memory is not None:
            yield from _per_model(GaugeMetricFamily, m, (
                (f"kvserve_cuda_memory_{name}_bytes", f"CUDA memory {name} by PyTorch.", value)
                for name, value in zip(("allocated", "reserved"), memory, strict=True)
            ))  # fmt: skip
        yield from _counters(m, snap)

    def _config(self, snap: EngineSnapshot) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            "kvserve_model_info", "The served model (value 1).", labels=["model", *self.info]
        )
        info.add_metric([self.model, *self.info.values()], 1)
        yield info
        # the labels vLLM's cache_config_info has, which a routing gateway reads (the
        # Gateway API inference extension's --cache-info-metric): docs/operations.md
        config = GaugeMetricFamily(
            "kvserve_cache_config_info",
            "The KV cache's block size and pool blocks (value 1).",
            labels=["model", "block_size", "num_gpu_blocks"],
        )
        config.add_metric(
            [self.model, self.info.get("block_size", ""), str(snap.kv_blocks_total)], 1
        )
        yield config


def _per_model(
    family: type[GaugeMetricFamily] | type[CounterMetricFamily],
    m: list[str],
    rows: Iterable[tuple[str, str, float]],
) -> Iterator[Metric]:
    """A family of `family` for each (name, doc, value) row, labelled by the model."""
    for name, doc, value in rows:
        metric = family(name, doc, labels=["model"])
        metric.add_metric(m, value)
        yield metric


def _gauges(m: list[str], snap: EngineSnapshot) -> Iterator[Metric]:
    """The engine's requests and KV pool as its last step left them."""
    yield from _per_model(
        GaugeMetricFamily,
        m,
        (
            ("kvserve_requests_running", "Sequences being computed.", snap.running),
            ("kvserve_requests_waiting", "Sequences waiting to be scheduled.", snap.waiting),
            (
                "kvserve_kv_cache_capacity_blocks",
                "KV cache blocks in the pool.",
                snap.kv_blocks_total,
            ),
            (
                "kvserve_kv_cache_used_blocks",
                "KV cache blocks held by requests.",
                snap.kv_blocks_used,
            ),
            (
                "kvserve_kv_cache_capacity_bytes",
                "KV cache pool size in bytes.",
                snap.kv_bytes_total,
            ),
            ("kvserve_kv_cache_used_bytes", "KV cache bytes held by requests.", snap.kv_bytes_used),
            ("kvserve_kv_cache_usage_ratio", "Share of KV blocks in use (0-1).", snap.kv_usage),
        ),
    )


def _counters(m: list[str], stats: EngineSnapshot) -> Iterator[Metric]:
    """The engine's token, prefix-cache, preemption, speculation and finish counts."""
    yield from _per_model(
        CounterMetricFamily,
        m,
        (
            ("kvserve_prompt_tokens", "Prompt tokens received.", stats.prompt_tokens),
            ("kvserve_generation_tokens", "Tokens generated.", stats.generation_tokens),
            (
                "kvserve_prefix_cache_queried_tokens",
                "Prompt tokens looked up in the prefix cache.",
                stats.prefix_queried_tokens,
            ),
            (
                "kvserve_prefix_cache_hit_tokens",
                "Prompt tokens served by the prefix cache.",
                stats.prefix_hit_tokens,
            ),
            ("kvserve_preemptions", "Requests preempted to free KV blocks.", stats.preemptions),
            (
                "kvserve_spec_decode_draft_tokens",
                "Speculative draft tokens verified by the model.",
                stats.spec_draft_tokens,
            ),
            (
                "kvserve_spec_decode_accepted_tokens",
                "Speculative draft tokens accepted (each one a step saved).",
                stats.spec_accepted_tokens,
            ),
        ),
    )
    finished = CounterMetricFamily(
        "kvserve_requests_finished",
        "Finished sequences by finish reason.",
        labels=["model", "finish_reason"],
    )
    counts = dict(stats.finished)
    for reason in ("stop", "length", "abort", "error"):
        finished.add_metric([m[0], reason], counts.get(reason, 0))
    yield finished


def _host_tier(m: list[str], snap: EngineSnapshot) -> Iterator[Metric]:
    """The host tier's gauges (blocks and bytes held, of how many) and counters (blocks
    copied out, restored on a hit, dropped by the tier; seconds spent copying), and its
    disk tier's (files' blocks and bytes; blocks written, read back, found corrupt)."""
    each = snap.kv_host_block_bytes
    yield from _per_model(GaugeMetricFamily, m, (
        ("kvserve_kv_host_capacity_blocks", "Host tier blocks.", snap.kv_host_blocks_total),
        ("kvserve_kv_host_used_blocks", "Host tier blocks holding a cached block.",
         snap.kv_host_blocks_used),
        ("kvserve_kv_host_capacity_bytes", "Host tier size in bytes.",
         snap.kv_host_blocks_total * each),
        ("kvserve_kv_host_used_bytes", "Host tier bytes holding cached blocks.",
         snap.kv_host_blocks_used * each),
        ("kvserve_kv_disk_blocks", "Cached blocks in the disk tier's files.", snap.kv_disk_blocks),
        ("kvserve_kv_disk_bytes", "Bytes of the disk tier's files.", snap.kv_disk_bytes),
    ))  # fmt: skip
    yield from _per_model(CounterMetricFamily, m, (
        ("kvserve_kv_host_stored_blocks", "Cached blocks copied out of the KV pool to the "
         "host tier.", snap.kv_host_stored_blocks),
        ("kvserve_kv_host_restored_blocks", "Prefix-cache hits copied back from the host "
         "tier instead of recomputed.", snap.kv_host_restored_blocks),
        ("kvserve_kv_host_dropped_blocks", "Cached blocks the host tier evicted.",
         snap.kv_host_dropped_blocks),
        ("kvserve_kv_host_copy_seconds", "Host time spent on the copies of blocks out to and "
         "in from the host tier (on CUDA, queuing them on the step's stream).",
         snap.kv_host_copy_seconds),
        ("kvserve_kv_disk_written_blocks", "Blocks written to the disk tier.",
         snap.kv_disk_written_blocks),
        ("kvserve_kv_disk_read_blocks", "Prefix-cache hits read back from the disk tier.",
         snap.kv_disk_read_blocks),
        ("kvserve_kv_disk_corrupt_blocks", "Disk tier files that failed their checks "
         "(deleted, their blocks recomputed).", snap.kv_disk_corrupt_blocks),
    ))  # fmt: skip


def _experts(m: list[str], snap: EngineSnapshot) -> Iterator[Metric]:
    """A mixture of experts' load balance, where --expert-metrics counts it: the tokens
    each layer routed to each expert (read once a second: service/engine/core/stats.py)."""
    if not snap.expert_tokens:
        return
    tokens = CounterMetricFamily(
        "kvserve_moe_expert_tokens",
        "Tokens routed to each expert of each mixture-of-experts layer.",
        labels=["model", "layer", "expert"],
    )
    for layer, counts in snap.expert_tokens:
        for expert, n in enumerate(counts):
            tokens.add_metric([m[0], str(layer), str(expert)], n)
    yield tokens


def _lora(m: list[str], snap: EngineSnapshot) -> Iterator[Metric]:
    """LoRA adapters, where the engine keeps a bank of them: the adapters of the running
    and the waiting requests, with the labels vLLM's lora_requests_info has (what routing
    gateways read for adapter affinity; the value is the time, as vLLM's), the requests
    each adapter has taken, and the adapters put into the bank's slots."""
    if not snap.max_loras:
        return
    info = GaugeMetricFamily(
        "kvserve_lora_requests_info",
        "The LoRA adapters of the running and the waiting requests (value: the time).",
        labels=["model", "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
    )
    running, waiting = ",".join(snap.lora_running), ",".join(snap.lora_waiting)
    info.add_metric([m[0], str(snap.max_loras), running, waiting], time.time())
    yield info
    requests = CounterMetricFamily(
        "kvserve_lora_requests", "Requests each LoRA adapter has taken.",
        labels=["model", "adapter"],
    )  # fmt: skip
    for name, n in snap.lora_requests:
        requests.add_metric([m[0], name], n)
    yield requests
    yield from _per_model(CounterMetricFamily, m, (
        ("kvserve_lora_loads", "LoRA adapters put into a slot of the device's bank.",
         snap.lora_loads),
        ("kvserve_lora_evictions", "... in place of another adapter (--max-loras were in "
         "use).", snap.lora_evictions),
    ))  # fmt: skip


def _priorities(m: list[str], snap: EngineSnapshot) -> Iterator[Metric]:
    """Under --scheduling-policy priority: the waiting and the running requests of each
    priority that has any."""
    if not snap.priorities:
        return
    gauge = GaugeMetricFamily(
        "kvserve_requests_by_priority", "Requests waiting and running, by priority.",
        labels=["model", "priority", "state"],
    )  # fmt: skip
    for priority, waiting, running in snap.priorities:
        gauge.add_metric([m[0], str(priority), "waiting"], waiting)
        gauge.add_metric([m[0], str(priority), "running"], running)
    yield gauge


def _kv_events(m: list[str], snap: EngineSnapshot) -> Iterator[Metric]:
    """Whether the KV events replay socket's thread has failed (0 while it answers, and
    without one), and the malformed requests it dropped."""
    failed = GaugeMetricFamily("kvserve_kv_events_replay_failed", "1 when the KV events "
                               "replay socket's thread has failed, else 0.", labels=["model"])  # fmt: skip
    failed.add_metric(m, float(snap.kv_events_replay_up is False))
    yield failed
    bad = CounterMetricFamily("kvserve_kv_events_replay_malformed", "KV events replay "
                              "requests dropped as malformed.", labels=["model"])  # fmt: skip
    bad.add_metric(m, snap.kv_events_malformed)
    yield bad
