"""Request state and SamplingParams. A request stores counters; the rest is derived."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

from service.config import POOLING
from service.limits import (
    MAX_CACHE_SALT_CHARS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    PRIORITY_RANGE,
)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


PENDING = -2  # a sampled token still on the device (async scheduling): its value is unread
CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a request's output must match (structured outputs, service/engine/sample/structured.py).
    spec: the JSON Schema (JSON text), the regex, the choices (a JSON list of strings) or
    the grammar (Lark or GBNF); param: the API parameter it came from, named in errors;
    think: a reasoning model's output holds to it from its first token (""), after the
    think block the prompt left open ("open"), or after one it may open first ("maybe")."""

    kind: str
    spec: str
    param: str
    think: str = ""

    def __post_init__(self) -> None:
        _check(self.kind in CONSTRAINT_KINDS, self.param, f"unknown constraint {self.kind!r}")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N alternatives per generated token
    # top-N alternatives per prompt token, and each one's own logprob (echo with logprobs,
    # vLLM's prompt_logprobs); its prompt is computed, never read from the prefix cache
    prompt_logprobs: int | None = None
    # a reasoning model's think block: at most thinking_budget tokens, then its end marker
    # is forced; think_ids: its (start, end) marker ids; thinking_open: the prompt opened
    # the block (else it opens where the output starts with the start marker)
    thinking_budget: int | None = None
    think_ids: tuple[int, int] = (-1, -1)
    thinking_open: bool = False
    # an embedding request (/v1/embeddings): its prompt's final hidden states pooled and
    # normalised instead of any token sampled; "mean" computes every prompt token (no
    # prefix-cache hits), "last" reads the cache as any prompt
    pooling: str | None = None
    skip_special_tokens: bool = True
    cache_salt: str | None = None  # requests share cached prefix blocks only under one salt
    lora: str | None = None  # the LoRA adapter it runs under (its name); None: the base model
    # where it queues under --scheduling-policy priority: lower goes first, and is
    # preempted last (vLLM's); 0 under fcfs
    priority: int = 0
    constraint: Constraint | None = None  # structured output

    def __post_init__(self) -> None:
        """Raise ValueError naming the parameter (the API turns it into a 400)."""
        _check(self.max_tokens >= 1, "max_tokens", "must be at least 1")
        _check(
            math.isfinite(self.temperature) and self.temperature >= 0, "temperature", "must be >= 0"
        )
        _check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        _check(self.top_k >= -1, "top_k", "must be -1, 0 (off) or positive")
        _check(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]")
        _check(0 < self.repetition_penalty <= 10, "repetition_penalty", "must be in (0, 10]")
        _check(1 <= self.n <= MAX_N, "n", f"must be between 1 and {MAX_N}")
        _check(
            self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
            "logprobs",
            f"must be between 0 and {MAX_LOGPROBS}",
        )
        _check(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
            "prompt_logprobs",
            f"must be between 0 and {MAX_LOGPROBS}",
        )
        _check(
            self.thinking_budget is None or (self.thinking_budget >= 1 and self.think_ids[1] >= 0),
            "thinking_budget",
            "must be at least 1, for a model with think markers",
        )
        _check(self.pooling in (None, *POOLING), "pooling", f"must be one of {list(POOLING)}")
        low, high = PRIORITY_RANGE
        _check(low <= self.priority <= high, "priority", f"must be in [{low}, {high}]")
        _check(all(s for s in self.stop), "stop", "stop strings must not be empty")
        _check(len(self.stop) <= MAX_STOP, "stop", f"at most {MAX_STOP} stop strings")
        _check(
            all(len(s) <= MAX_STOP_CHARS for s in self.stop),
            "stop",
            f"a stop string has at most {MAX_STOP_CHARS} characters",
        )
        _check(
            len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
            "stop_token_ids",
            f"at most {MAX_STOP_TOKEN_IDS} ids",
        )
        _check(
            len(self.logit_bias) <= MAX_LOGIT_BIAS,
            "logit_bias",
            f"at most {MAX_LOGIT_BIAS} entries",
        )
        _check(
            self.cache_salt is None or 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS,
            "cache_salt",
            f"must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters",
        )
        for _, bias in self.logit_bias:
            _check(-100 <= bias <= 100, "logit_bias", "bias values must be in [-100, 100]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filters(self) -> bool:
        """top_k, top_p or min_p: a draw from part of the distribution."""
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0

    @property
    def reads_each_step(self) -> bool:
        """Sampling that follows a grammar, whose mask for the next step needs this step's
        token on the host, or a thinking budget, whose end marker is appended to the
        tokens read: async scheduling reads each step's tokens before scheduling the
        next while such a request runs. (Penalties and logprobs do not: the penalties
        count the token not read yet from the device, the logprobs come back with the
        ids.)"""
        return self.constraint is not None or self.thinking_budget is not None

    @property
    def needs_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)


def sequence_ids(request_id: str, n: int) -> list[str]:
    """The ids of a request's sequences: its own for one, `{id}.{i}` for n > 1. The one
    place they are made; what a sequence belongs to travels with it (Request.parent,
    RequestOutput.parent), never parsed back."""
    return [request_id] if n == 1 else [f"{request_id}.{i}" for i in range(n)]


class ParamError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param, self.message = param, message


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ParamError(param, message)


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float
    index: int = 0  # which of the n choices this sequence is
    # the id the client's request has, where this is one of its n > 1 sequences (which
    # have ids of their own: sequence_ids); None: the request is this sequence
    parent: str | None = None
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    # the windowed layers' pool (service/engine/kv/window_blocks.py): an entry per block of
    # block_table, its null block where the windows no longer see it
    window_table: list[int] = field(default_factory=list)
    num_cached_prompt: int = 0  # prompt tokens served by the prefix cache (first admission)
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    wait_for: Request | None = None  # an n>1 sibling waits for this one's prompt blocks
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    error: str | None = None
    guide: object | None = None  # its place in its constraint's grammar (structured.Guide)
    draft_ids: list[int] = field(default_factory=list)  # proposed next tokens (speculative)
    # sampled by a step whose ids are not read yet (async scheduling, engine.py): counted
    # in num_tokens, so the next step is scheduled before they are known
    num_pending: int = 0
    # prompt_logprobs: entry i for prompt token i + 1, given the tokens before it (the
    # first token has none); `prompt_logprobs_sent` once an output has carried them
    prompt_logprobs: list = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    # a thinking budget's (SamplingParams.thinking_budget): where in output_ids the think
    # block began (None: not open), and whether it has ended
    thinking_since: int | None = None
    thought: bool = False
    # pooling: the sum of its prompt rows' hidden states so far ("mean"), then its
    # embedding once the prompt is computed
    pool_sum: Any = None
    embedding: list[float] | None = None
    # its LoRA adapter's bank slot while it runs (-1: none held), and the adapter's
    # files' digest, which its prefix-cache keys start from ("": the base model)
    lora_slot: int = -1
    lora_key: str = ""

    @property
    def computes_prompt(self) -> bool:
        """Every prompt token's output is needed: no prefix-cache hits for it."""
        return self.scores_prompt or (
            self.params.pooling == "mean" and self.num_computed < len(self.prompt_ids)
        )

    @property
    def asked_as(self) -> str:
        """The id of the client's request this sequence answers."""
        return self.parent or self.request_id

    @property
    def scores_prompt(self) -> bool:
        """It still needs logprobs of prompt tokens (the first of n choices only: its
        siblings share them)."""
        return (
            self.params.prompt_logprobs is not None
            and self.index == 0
            and len(self.prompt_logprobs) < len(self.prompt_ids) - 1
        )

    @property
    def num_tokens(self) -> int:
        """Tokens the request holds, the pending ones included (what the scheduler sees)."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    @property
    def num_known(self) -> int:
        """Tokens whose ids the host has read: len(token_ids)."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_generated(self) -> int:
        """Output tokens sampled so far, the pending ones included."""
        return len(self.output_ids) + self.num_pending

    @property
    def last_is_pending(self) -> bool:
        """Its pending token will be its last (max_tokens): nothing to schedule after it."""
        return self.num_pending > 0 and self.num_generated >= self.params.max_tokens

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def tokens(self, start: int, stop: int) -> list[int]:
        """token_ids[start:stop] (0 <= start <= stop <= num_tokens) without building
        token_ids: a decode step reads one token of a context that may be thousands long.
        PENDING stands for a pending token's id."""
        p = len(self.prompt_ids)
        if stop <= p:
            return self.prompt_ids[start:stop]
        lo = max(start - p, 0)
        out = self.output_ids[lo : stop - p]
        if len(out) < stop - p - lo:  # the pending tokens' places
            out = out + [PENDING] * (stop - p - lo - len(out))
        return self.prompt_ids[start:] + out if start < p else out

    @property
    def remaining(self) -> int:
        """Tokens to compute before the next sample (prompt chunk(s), or 1 for a decode)."""
        return self.num_tokens - self.num_computed

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.num_prompt

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def ready(self) -> bool:
        """Schedulable: an n>1 sibling waits until the first one's prompt is cached (its
        prompt computed and its first token read: async scheduling registers the prompt's
        blocks then)."""
        w = self.wait_for
        if w is None or w.finished:
            return True
        return w.num_computed >= w.num_prompt and w.first_token_time is not None
