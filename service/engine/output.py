"""Per-request output: incremental text, stop strings, and the deltas handed out."""

from __future__ import annotations

from dataclasses import dataclass, field

from model.tokenizer import Tokenizer
from service.engine.request import FinishReason, Request


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    # the N most likely tokens, most likely first: tuples of numbers, which the garbage
    # collector stops tracking (a prompt's entries are many, and a collection walks each
    # tracked object)
    top: tuple[tuple[int, float], ...]
    rank: int | None = None  # its place among the vocab's logprobs (1: the most likely)


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request: a delta, not the whole output so far."""

    request_id: str  # the sequence's (request.sequence_ids)
    index: int  # which of the request's n choices
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # the first output of a request that asked for prompt_logprobs: one per prompt token
    # after the first (SamplingParams.prompt_logprobs)
    prompt_logprobs: list[TokenLogprobs] | None = None
    embedding: list[float] | None = None  # an embedding request's (SamplingParams.pooling)
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    # engine clock (time.monotonic) at arrival, first scheduling, first token and finish
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    parent: str | None = None  # the client's request id, for one of n > 1 sequences

    @property
    def asked_as(self) -> str:
        """The id of the client's request this output answers."""
        return self.parent or self.request_id


class TextState:
    """Detokenizes a request's output and watches for stop strings, which may span
    tokens. Text that could be the start of a stop string is held back until it is not;
    a matched stop string and everything after it is never emitted."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...], skip_special: bool) -> None:
        self.detok = tokenizer.detokenizer(skip_special=skip_special)
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # everything decoded so far (up to a stop match)
        self.emitted = 0
        self.stopped = False

    def push(self, token_id: int) -> bool:
        """Add a token; True when a stop string has matched."""
        before = len(self.text)
        self.text += self.detok.push([token_id])
        if not self.stop:
            return False
        start = max(0, before - self.hold)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
        return self.stopped

    def take(self, final: bool) -> str:
        """The text that can be emitted now (all of it when the request is finishing)."""
        if final:
            if not self.stopped:
                self.text += self.detok.flush()
            end = len(self.text)
        else:
            end = max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta


def make_output(
    request: Request, tokens: list[int], text: str, logprobs: list[TokenLogprobs]
) -> RequestOutput:
    prompt_logprobs = None
    wanted = request.params.prompt_logprobs is not None and request.index == 0
    # with the first token: the prompt is scored by then
    if wanted and tokens and not request.prompt_logprobs_sent and not request.scores_prompt:
        prompt_logprobs, request.prompt_logprobs_sent = request.prompt_logprobs, True
    return RequestOutput(
        request_id=request.request_id,
        index=request.index,
        token_ids=tokens,
        text=text,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        embedding=request.embedding,
        finished=request.finished,
        finish_reason=request.finish_reason,
        num_prompt_tokens=request.num_prompt,
        num_output_tokens=len(request.output_ids),
        num_cached_tokens=request.num_cached_prompt,
        error=request.error,
        arrival_time=request.arrival_time,
        first_scheduled_time=request.first_scheduled_time,
        first_token_time=request.first_token_time,
        finish_time=request.finish_time,
        parent=request.parent,
    )
