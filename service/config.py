"""One settings object: CLI flags over KVSERVE_* environment variables over defaults."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from service.limits import ADAPTER_NAME, MAX_ADAPTER_NAME_CHARS

GiB = 1 << 30
# On the CPU a 2048-token prefill step costs about 16 steps of 32 decodes, so 128 prompt
# tokens cost about one: a step that also decodes takes at most this many, and running
# streams wait about one more decode step for a new prompt instead of ~16
# (docs/decisions.md). On CUDA a prefill chunk is short next to a step's fixed cost and
# there is no cap.
CPU_MIXED_PREFILL_TOKENS = 128
# sequences a step may carry: a GPU is far from its compute bound at 64 decodes (vLLM
# defaults to 256); two CPU cores are not
CPU_MAX_NUM_SEQS, CUDA_MAX_NUM_SEQS = 64, 256
# the prefix cache's host tier on CUDA by default: llama.cpp's --cache-ram default, within
# a quarter of the RAM a machine has free (on the CPU the KV pool is that RAM already)
HOST_TIER_MAX_GIB = 8
ATTENTION_BACKENDS = ("auto", "cpu", "triton", "torch")
QUANTIZATIONS = ("auto", "none", "int8", "int4", "fp8")
SPECULATIVE_METHODS = ("none", "ngram", "draft")
ASYNC_SCHEDULING = ("auto", "on", "off")
SCHEDULING_POLICIES = ("fcfs", "priority")
ENGINE_PROCESS = ("auto", "on", "off")
TOOL_CALL_FORMATS = (
    "auto",
    "hermes",
    "llama3_json",
    "mistral",
    "harmony",
)  # service/api/tool_formats.py
POOLING = ("last", "mean")  # an embedding: the last token's final hidden state, or the mean


def quantization_conflict(quantization: str, backend: str, dtype: str, device: str) -> str | None:
    """Why `quantization` cannot run with this attention backend, dtype and device (None:
    it can). int8 weights run on the cpu backend's C kernels, with bfloat16 activations and
    KV cache; int4 there too, and on the torch and Triton backends (model/backends/int4.py:
    a CUDA GPU's W4A16 kernel) in any dtype; fp8 weights on a CUDA GPU's FP8 matmuls
    (model/backends/fp8.py), with bfloat16 activations. Checked on the settings, then on
    the device `auto` resolved to, before any weight is read."""
    if quantization in ("none", "auto"):  # auto falls back to none where its kinds cannot run
        return None
    if quantization == "fp8":
        if device not in ("auto", "cuda") or backend == "cpu":
            return (
                "quantization fp8 runs on a CUDA GPU's FP8 matmuls (compute capability 8.9 "
                "and up: Ada, Hopper, Blackwell), not on the CPU (use --quantization int8 "
                "there)"
            )
        if dtype in ("float32", "float16"):
            return (
                f"quantization fp8 computes in bfloat16, not {dtype} (use --dtype bfloat16 or auto)"
            )
        return None
    if quantization == "int4" and (
        backend in ("torch", "triton") or (backend != "cpu" and device != "cpu")
    ):
        return None  # the torch and Triton backends' int4; device auto: checked once resolved
    if backend in ("torch", "triton"):
        return (
            f"quantization {quantization} runs on the cpu backend's C kernels, not on the "
            f"{backend} backend (use --attention-backend cpu or auto)"
        )
    if dtype in ("float32", "float16"):
        return (
            f"quantization {quantization} computes with bfloat16 activations and KV cache, "
            f"not {dtype} (use --dtype bfloat16 or auto)"
        )
    if device not in ("auto", "cpu"):
        return (
            f"quantization {quantization} runs on the CPU's C kernels, not on {device} "
            "(use --device cpu)"
        )
    return None


# the settings checked on their own: positive, non-negative, one of their choices
POSITIVE = (
    "port",
    "block_size",
    "num_kv_blocks",
    "max_num_seqs",
    "api_server_count",
    "max_num_batched_tokens",
    "max_body_bytes",
    "tensor_parallel_size",
    "rank_timeout",
    "num_speculative_tokens",
    "speculative_max_batch",
    "responses_store_size",
    "responses_store_mib",
    "responses_store_ttl",
    "kv_disk_gib",
    "kv_cache_gib",
    "max_loras",
    "max_lora_rank",
)
NON_NEGATIVE = ("mixed_prefill_tokens", "max_queue", "speculative_min_speedup", "kv_host_gib")
CHOICES = {
    "attention_backend": ATTENTION_BACKENDS,
    "tool_call_format": TOOL_CALL_FORMATS,
    "pooling": POOLING,
    "quantization": QUANTIZATIONS,
    "speculative_method": SPECULATIVE_METHODS,
    "engine_process": ENGINE_PROCESS,
    "async_scheduling": ASYNC_SCHEDULING,
    "scheduling_policy": SCHEDULING_POLICIES,
    "log_level": ("debug", "info", "warning", "error"),
}


@dataclass(frozen=True, slots=True)
class Settings:
    model: str | None = field(
        default=None,
        metadata={
            "help": "a model directory, a GGUF file, a Hugging Face repo id, or one GGUF file of a "
            "repo (org/repo:QUANT or org/repo/file.gguf) (default: the random demo model)"
        },
    )
    revision: str | None = field(
        default=None, metadata={"help": "the Hub revision (branch, tag or commit) of --model"}
    )
    download_dir: str | None = field(
        default=None,
        metadata={"help": "Hugging Face cache directory for Hub models (default: HF_HOME's)"},
    )
    served_model_name: str | None = field(
        default=None, metadata={"help": "model id in the API (default: the directory name)"}
    )
    host: str = field(default="127.0.0.1", metadata={"help": "address to bind"})
    port: int = field(default=8000, metadata={"help": "port to bind"})
    device: str = field(default="auto", metadata={"help": "auto, cpu, cuda, cuda:N"})
    dtype: str = field(
        default="auto",
        metadata={
            "help": "auto (bf16 on CUDA, on CPUs with AVX2 or newer and with "
            "--quantization int8, int4 or fp8; else fp32), float32, bfloat16, float16"
        },
    )
    quantization: str = field(
        default="auto",
        metadata={
            "help": "auto: a checkpoint's integer weights (GGUF, AWQ, GPTQ, "
            "compressed-tensors) kept as integers on the cpu backend in bf16, 4-bit types "
            "as int4 and the others as int8g, float weights in the serving dtype; on the "
            "triton and torch backends its 4-bit types as int4; elsewhere, and for float "
            "checkpoints, none; none: every weight in the serving dtype; "
            "int8: linear weights in int8 with a scale per output feature, "
            "computed at load (the cpu backend; bf16 activations and KV cache); int4: "
            "linear weights in 4 bits, a float16 scale and minimum each 32 in features, "
            "computed at load (the cpu backend, bf16 activations and KV cache, the head "
            "and the weights llama.cpp's Q4_K_M gives more bits in int8g; a GPU's "
            "Triton W4A16 kernel, activations in the serving dtype); fp8: the "
            "decoder layers' linears in FP8 e4m3, a scale per output feature, activations "
            "quantized per token (CUDA, compute capability 8.9 and up)"
        },
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata={
            "help": "ranks the model is split over (one process each: NCCL on GPUs, gloo on "
            "the CPU); kvserve serve starts them, or torchrun does with RANK, WORLD_SIZE, "
            "MASTER_ADDR and MASTER_PORT"
        },
    )
    rank_timeout: float = field(
        default=60.0,
        metadata={
            "help": "seconds a tensor-parallel rank waits on another before the server "
            "fails (/health 503, non-zero exit) instead of hanging (joining at start-up "
            "waits at least 60)"
        },
    )
    kv_cache_gib: float = field(
        default=1.0, metadata={"help": "KV cache budget on the CPU, GiB (per rank)"}
    )
    kv_host_gib: float | None = field(
        default=None,
        metadata={
            "help": "the prefix cache's host tier, GiB (per rank): evicted cached blocks "
            "are copied there and back on a hit (default: 0 on the CPU; on CUDA "
            "a quarter of the available RAM, at most 8)"
        },
    )
    kv_disk_path: str | None = field(
        default=None,
        metadata={
            "help": "the prefix cache's disk tier: a folder for the blocks the host tier "
            "drops, read back on a hit, also after a restart (default: none)"
        },
    )
    kv_disk_gib: float = field(
        default=16.0, metadata={"help": "the disk tier's size limit, GiB (oldest files first)"}
    )
    kv_events_endpoint: str | None = field(
        default=None,
        metadata={
            "help": "publish the prefix cache's block stored/removed events on this ZMQ "
            "endpoint, in vLLM's format, e.g. tcp://127.0.0.1:5557; unauthenticated, with "
            "the prompts' token ids: bind an address only routers reach (default: none)"
        },
    )
    kv_events_replay_endpoint: str | None = field(
        default=None,
        metadata={
            "help": "a ZMQ endpoint that replays missed KV event batches, e.g. tcp://127.0.0.1:5558"
        },
    )
    kv_events_omit_token_ids: bool = field(
        default=False,
        metadata={
            "help": "KV events carry each block's hash but not its token ids (the prompts' "
            "text), for routers that need only the hashes"
        },
    )
    num_kv_blocks: int | None = field(
        default=None,
        metadata={"help": "KV blocks in the pool, overriding both budgets (default: from them)"},
    )
    gpu_memory_utilization: float = field(
        default=0.9,
        metadata={
            "help": "share of the GPU's total memory kvserve may use: weights, the measured "
            "peak of a worst-case step, and the KV cache in the rest"
        },
    )
    block_size: int = field(default=16, metadata={"help": "tokens per KV block"})
    responses_store_size: int = field(
        default=1000,
        metadata={
            "help": "/v1/responses: stored responses previous_response_id can continue "
            "from, in memory (the oldest evicted first)"
        },
    )
    responses_store_mib: float = field(
        default=256.0,
        metadata={
            "help": "/v1/responses: the stored responses' size limit, MiB of their JSON "
            "(the oldest evicted first)"
        },
    )
    responses_store_ttl: float = field(
        default=3600.0,
        metadata={"help": "/v1/responses: seconds a stored response can be continued from"},
    )
    pooling: str = field(
        default="last",
        metadata={
            "help": "/v1/embeddings: last (the last token's final hidden state: what "
            "decoder embedding models such as Qwen3-Embedding use) or mean, normalised"
        },
    )
    tool_call_format: str = field(
        default="auto",
        metadata={
            "help": "how the model writes tool calls: hermes (<tool_call> blocks: Qwen), "
            "llama3_json (Llama 3.x), mistral ([TOOL_CALLS]); auto reads the chat "
            "template's markers"
        },
    )
    attention_backend: str = field(
        default="auto",
        metadata={
            "help": "auto (triton on CUDA, the C kernels on the CPU), cpu, triton, torch "
            "(model/backends)"
        },
    )
    enforce_eager: bool = field(
        default=False, metadata={"help": "no CUDA graphs: run every step eagerly"}
    )
    expert_metrics: bool = field(
        default=False,
        metadata={
            "help": "a mixture of experts: count the tokens routed to each expert of each "
            "layer (kvserve_moe_expert_tokens_total, read once a second)"
        },
    )
    scheduling_policy: str = field(
        default="fcfs",
        metadata={
            "help": "which waiting request goes first and which running one is preempted "
            "first: fcfs (arrival), priority (each request's priority, lower first, then "
            "arrival; a waiting request may preempt running ones of a lower priority)"
        },
    )
    async_scheduling: str = field(
        default="auto",
        metadata={
            "help": "queue each step on the device before the previous step's tokens are "
            "read, so the host's scheduling and outputs run while the device computes: "
            "auto (on CUDA, without tensor parallelism or speculative decoding), on (also "
            "on the CPU, where nothing overlaps), off"
        },
    )
    engine_process: str = field(
        default="auto",
        metadata={
            "help": "run the engine core (schedule, forward, sample) in its own process, "
            "the HTTP server in this one: on, off (one process, the engine in a thread), "
            "auto (on with CUDA, off on the CPU: docs/operations.md has the measurements)"
        },
    )
    api_server_count: int = field(
        default=1,
        metadata={
            "help": "HTTP front processes sharing the port, each with its own event loop "
            "(tokenizing, detokenizing, SSE) in front of one engine process; more than 1 "
            "runs the engine in its own process"
        },
    )
    disable_prefix_caching: bool = field(
        default=False,
        metadata={"help": "no prefix cache: every prompt is computed in full"},
    )
    max_num_seqs: int | None = field(
        default=None,
        metadata={
            "help": f"sequences per engine step (default: {CPU_MAX_NUM_SEQS} on the CPU, "
            f"{CUDA_MAX_NUM_SEQS} on CUDA)"
        },
    )
    max_num_batched_tokens: int = field(default=2048, metadata={"help": "tokens per engine step"})
    mixed_prefill_tokens: int | None = field(
        default=None,
        metadata={
            "help": "prompt tokens at most in a step that also decodes, 0: no cap "
            f"(default: {CPU_MIXED_PREFILL_TOKENS} on the CPU, no cap on CUDA)"
        },
    )
    max_model_len: int | None = field(
        default=None, metadata={"help": "context length cap (default: the model's)"}
    )
    speculative_method: str = field(
        default="none",
        metadata={
            "help": "speculative decoding: none; ngram (drafts continue the last n-gram's "
            "earlier occurrence in the prompt or output); draft (a small model of the same "
            "tokenizer, --speculative-model, proposes them). Greedy output is the same as without; sampled output has the same "
            "distribution"
        },
    )
    speculative_model: str | None = field(
        default=None,
        metadata={"help": "the draft model's directory or Hub id (--speculative-method draft)"},
    )
    num_speculative_tokens: int = field(
        default=4, metadata={"help": "draft tokens a decoding sequence proposes per step"}
    )
    speculative_max_batch: int = field(
        default=4,
        metadata={
            "help": "speculate only while at most this many sequences decode (larger batches "
            "are compute-bound: verifying drafts there costs more than it saves)"
        },
    )
    speculative_min_speedup: float = field(
        default=1.0,
        metadata={
            "help": "speculate while decode steps with drafts measure at least this many "
            "times the tokens/s of steps without (else only a probe now and then); 0: always"
        },
    )
    enable_lora: bool = field(
        default=False,
        metadata={
            "help": "a bank for LoRA adapters loaded at run time (--lora-modules sets it up too)"
        },
    )
    lora_modules: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "LoRA adapters served beside the model, comma-separated name=path "
            "(a PEFT adapter folder); a request's model field names one"
        },
    )
    max_loras: int = field(
        default=4, metadata={"help": "LoRA adapters on the device at once (in slots)"}
    )
    max_lora_rank: int = field(
        default=16, metadata={"help": "the largest LoRA rank an adapter may have"}
    )
    disable_jump_forward: bool = field(
        default=False,
        metadata={
            "help": "structured outputs: sample every token, even where the grammar forces "
            "the text (by default forced tokens are appended without a step of their own)"
        },
    )
    max_queue: int = field(default=256, metadata={"help": "waiting requests before 429"})
    max_body_bytes: int = field(
        default=4 << 20, metadata={"help": "request body limit (413 above)"}
    )
    api_keys: tuple[str, ...] = field(
        default=(), metadata={"help": "comma-separated bearer keys (none: open)"}
    )
    admin_api_keys: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "comma-separated bearer keys that may also load and unload LoRA "
            "adapters at run time (/v1/load_lora_adapter; off without one)"
        },
    )
    api_key_models: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "limit API keys to models, comma-separated KEY=NAME|NAME (the served "
            "model's id, LoRA adapters' names); a key not listed may use every model"
        },
    )
    api_key_priority: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "a key's requests' priority under --scheduling-policy priority, "
            "comma-separated KEY=DEFAULT or KEY=DEFAULT:CEILING (the lowest, most urgent, "
            "a request of the key may ask for); a key not listed: 0, no ceiling"
        },
    )
    metrics_auth: bool = field(
        default=False,
        metadata={"help": "/metrics asks for an API key too (it is open by default)"},
    )
    cors_origins: tuple[str, ...] = field(
        default=(), metadata={"help": "comma-separated allowed origins"}
    )
    log_level: str = field(default="info", metadata={"help": "debug, info, warning, error"})
    shutdown_timeout: float = field(
        default=30.0, metadata={"help": "seconds to finish in-flight requests on SIGTERM"}
    )
    stuck_after: float = field(
        default=60.0, metadata={"help": "seconds without engine progress before /health is 503"}
    )

    def __post_init__(self) -> None:
        self._check_values()
        why = quantization_conflict(
            self.quantization, self.attention_backend, self.dtype, self.device
        )
        if why is not None:
            raise ValueError(why)
        self._check_processes()
        self._check_speculation()
        self._check_lora()
        self._check_keys()
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError(
                "kv_events_replay_endpoint replays kv_events_endpoint's events: set both"
            )

    def _check_values(self) -> None:
        """Each setting on its own: within its range, one of its choices."""
        for name in POSITIVE:
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        for name in NON_NEGATIVE:
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        for name, choices in CHOICES.items():
            value = getattr(self, name)
            if value not in choices:
                raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )

    def _check_processes(self) -> None:
        """The fronts, the engine's process and the ranks that go together."""
        if self.api_server_count > 1 and self.engine_process == "off":
            raise ValueError(
                "api_server_count: several front processes share one engine process; "
                "--engine-process off runs the engine in the front's own (use on or auto)"
            )
        if self.api_server_count > 1 and self.tensor_parallel_size > 1:
            raise ValueError(
                "api_server_count: several fronts run one rank's engine in its own "
                "process; with --tensor-parallel-size > 1 use one front"
            )
        if self.async_scheduling == "on" and (
            self.speculative_method != "none" or self.tensor_parallel_size > 1
        ):
            raise ValueError(
                "async_scheduling: on runs one rank without speculative decoding (drafts "
                "and other ranks need each step's tokens on the host); use auto or off"
            )

    def _check_speculation(self) -> None:
        if (self.speculative_method == "draft") != (self.speculative_model is not None):
            raise ValueError(
                "speculative_model: --speculative-method draft needs --speculative-model, "
                "and a speculative model needs --speculative-method draft"
            )
        if self.speculative_model is not None and self.tensor_parallel_size > 1:
            raise ValueError(
                "speculative_model: a draft model runs on one rank; with "
                "--tensor-parallel-size > 1 use --speculative-method ngram"
            )

    def _check_keys(self) -> None:
        """Each key limit names a key the server takes, and models or priorities (the
        keys are not repeated in the messages)."""
        for entry in self.api_key_models:
            key, _, models = entry.partition("=")
            if not key or not models:
                raise ValueError("api_key_models: an entry is not KEY=NAME|NAME")
            if key not in self.api_keys:
                raise ValueError("api_key_models: a key limited is not one of --api-keys")
        if self.api_key_priority and self.scheduling_policy != "priority":
            raise ValueError("api_key_priority: set --scheduling-policy priority to use it")
        for entry in self.api_key_priority:
            if entry.partition("=")[0] not in self.api_keys:
                raise ValueError("api_key_priority: a key given is not one of --api-keys")
        self.key_priority  # noqa: B018 (each entry parses, else ValueError)

    @property
    def key_priority(self) -> dict[str, tuple[int, int | None]]:
        """Each listed key's SHA-256 (a request's owner) -> its default priority and its
        ceiling (None: none)."""
        out = {}
        for entry in self.api_key_priority:
            key, _, value = entry.partition("=")
            default, _, ceiling = value.partition(":")
            try:
                pair = (int(default), int(ceiling) if ceiling else None)
            except ValueError:
                raise ValueError(
                    "api_key_priority: an entry is not KEY=DEFAULT or KEY=DEFAULT:CEILING "
                    "(integers)"
                ) from None
            if pair[1] is not None and pair[0] < pair[1]:
                raise ValueError(
                    "api_key_priority: a key's default is below its ceiling (lower is more urgent)"
                )
            out[hashlib.sha256(key.encode()).hexdigest()] = pair
        return out

    @property
    def key_models(self) -> dict[str, frozenset[str]]:
        """Each limited key's SHA-256 (what a request's owner is) -> the models it may use."""
        out = {}
        for entry in self.api_key_models:
            key, _, models = entry.partition("=")
            out[hashlib.sha256(key.encode()).hexdigest()] = frozenset(models.split("|"))
        return out

    def _check_lora(self) -> None:
        names = [entry.partition("=")[0] for entry in self.lora_modules]
        for entry, name in zip(self.lora_modules, names, strict=True):
            if not name or not entry.partition("=")[2]:
                raise ValueError(f"lora_modules: {entry!r} is not name=path")
            if len(name) > MAX_ADAPTER_NAME_CHARS or not re.match(ADAPTER_NAME, name):
                raise ValueError(
                    f"lora_modules: {name!r}: a name is letters, digits and ._:- (at most "
                    f"{MAX_ADAPTER_NAME_CHARS})"
                )
        if len(set(names)) < len(names):
            raise ValueError("lora_modules: two adapters have one name")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError(
                "enable_lora: LoRA adapters load at run time on one rank; with "
                "--tensor-parallel-size > 1 give them with --lora-modules"
            )

    @property
    def engine(self) -> EngineConfig:
        """What the engine reads of these settings, by section."""
        return EngineConfig(
            _section(self, LoadConfig),
            _section(self, CacheConfig),
            _section(self, SchedulerConfig),
            _section(self, ParallelConfig),
            _section(self, SpeculativeConfig),
            _section(self, LoraConfig),
        )

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)

    def to_env(self) -> dict[str, str | None]:
        """These settings as KVSERVE_* variables (None: unset it), which load_settings
        reads back to the same Settings: how `kvserve serve` hands them to its ranks."""
        env: dict[str, str | None] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, tuple):
                value = ",".join(value)
            elif isinstance(value, bool):
                value = "1" if value else "0"
            env["KVSERVE_" + f.name.upper()] = None if value is None else str(value)
        return env


# ---- the sections the engine reads ----------------------------------------------------
# Each is a set of Settings' fields under their flags' names (tests/service/test_config.py
# checks that every setting is in exactly one section, the server's included).


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """What is loaded and how it computes."""

    model: str | None
    revision: str | None
    download_dir: str | None
    served_model_name: str | None
    device: str
    dtype: str
    quantization: str
    attention_backend: str
    enforce_eager: bool
    expert_metrics: bool


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The KV pool, the prefix cache and its tiers and events."""

    block_size: int
    num_kv_blocks: int | None
    kv_cache_gib: float
    gpu_memory_utilization: float
    disable_prefix_caching: bool
    kv_host_gib: float | None
    kv_disk_path: str | None
    kv_disk_gib: float
    kv_events_endpoint: str | None
    kv_events_replay_endpoint: str | None
    kv_events_omit_token_ids: bool

    @property
    def kv_cache_bytes(self) -> int:
        return int(self.kv_cache_gib * GiB)

    def host_tier_bytes(self, device_type: str, available: int, ranks: int = 1) -> int:
        """The host tier's budget on one of `ranks` ranks: kv_host_gib, or the device's
        default (available: the machine's available RAM)."""
        if self.kv_host_gib is not None:
            return int(self.kv_host_gib * GiB)
        if device_type != "cuda":  # the pool is in this RAM already: size it instead
            return 0
        return min(HOST_TIER_MAX_GIB * GiB, available // 4) // ranks


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """What a step holds and how steps follow each other."""

    max_num_seqs: int | None
    max_num_batched_tokens: int
    mixed_prefill_tokens: int | None
    max_model_len: int | None
    async_scheduling: str
    disable_jump_forward: bool
    scheduling_policy: str

    def seqs_per_step(self, device_type: str) -> int:
        """max_num_seqs, or the device's default."""
        if self.max_num_seqs is not None:
            return self.max_num_seqs
        return CUDA_MAX_NUM_SEQS if device_type == "cuda" else CPU_MAX_NUM_SEQS

    def mixed_prefill_cap(self, device_type: str) -> int | None:
        """The engine's cap on prompt tokens in a step with decodes (None: no cap)."""
        if self.mixed_prefill_tokens is None:
            return CPU_MIXED_PREFILL_TOKENS if device_type == "cpu" else None
        return self.mixed_prefill_tokens or None


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    tensor_parallel_size: int
    rank_timeout: float


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    speculative_method: str
    speculative_model: str | None
    num_speculative_tokens: int
    speculative_max_batch: int
    speculative_min_speedup: float


@dataclass(frozen=True, slots=True)
class LoraConfig:
    enable_lora: bool
    lora_modules: tuple[str, ...]
    max_loras: int
    max_lora_rank: int

    @property
    def modules(self) -> dict[str, str]:
        """name -> path of each adapter served from the start."""
        return dict(entry.split("=", 1) for entry in self.lora_modules)

    @property
    def enabled(self) -> bool:
        """Whether the engine keeps a bank of adapters."""
        return self.enable_lora or bool(self.lora_modules)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The sections the engine reads (the rest of Settings is the server's)."""

    load: LoadConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    speculative: SpeculativeConfig
    lora: LoraConfig

    def async_steps(self, device_type: str) -> bool:
        """Whether the engine queues a step before reading the last one's tokens."""
        if self.scheduler.async_scheduling == "auto":
            plain = (
                self.speculative.speculative_method == "none"
                and self.parallel.tensor_parallel_size == 1
            )
            return plain and device_type == "cuda"
        return self.scheduler.async_scheduling == "on"

    def host_tier_bytes(self, device_type: str, available: int) -> int:
        return self.cache.host_tier_bytes(
            device_type, available, self.parallel.tensor_parallel_size
        )


SECTIONS = (
    LoadConfig, CacheConfig, SchedulerConfig, ParallelConfig, SpeculativeConfig, LoraConfig,
)  # fmt: skip
# the server's own settings: the HTTP side, the fronts, the API's stores and formats
SERVER_SETTINGS = (
    "host", "port", "engine_process", "api_server_count", "responses_store_size",
    "responses_store_mib", "responses_store_ttl", "pooling", "tool_call_format",
    "max_queue", "max_body_bytes", "api_keys", "admin_api_keys", "api_key_models",
    "api_key_priority", "metrics_auth", "cors_origins", "log_level", "shutdown_timeout",
    "stuck_after",
)  # fmt: skip


def _section(settings: Settings, section: type[Any]) -> Any:
    return section(**{f.name: getattr(settings, f.name) for f in fields(section)})


def _parse(f: dataclasses.Field, raw: str) -> Any:
    kind = str(f.type)
    if "tuple" in kind:
        return tuple(s.strip() for s in raw.split(",") if s.strip())
    if kind.startswith("bool"):
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(raw)
    if kind.startswith("int"):
        return int(raw)
    if kind.startswith("float"):
        return float(raw)
    return raw


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for f in fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        env = "KVSERVE_" + f.name.upper()
        help_text = f"{f.metadata['help']} [{env}]"
        if str(f.type).startswith("bool"):  # a switch: --enforce-eager
            parser.add_argument(flag, dest=f.name, action="store_const", const=True, help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, default=None, help=help_text)


def load_settings(
    args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None
) -> Settings:
    """Flags win over KVSERVE_* variables, which win over the defaults. An empty value is
    no value, for every type: compose and Kubernetes pass an unset `${VAR:-}` as ""."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for f in fields(Settings):
        raw = getattr(args, f.name, None) if args is not None else None
        if raw is None or raw == "":
            raw = env.get("KVSERVE_" + f.name.upper())
        if raw is None or raw == "":
            continue
        try:
            values[f.name] = _parse(f, raw) if isinstance(raw, str) else raw
        except ValueError:
            raise ValueError(f"{f.name}: cannot parse {raw!r}") from None
    return Settings(**values)


def settings_from_argv(argv: Sequence[str]) -> Settings:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return load_settings(parser.parse_args(list(argv)))
