"""Per-request output: the deltas the engine core hands out, token ids and numbers (the
front makes their text: service/engine/text/)."""

from __future__ import annotations

import msgspec

from service.engine.request import FinishReason, Request

# A step hands out one output per running sequence: as msgspec structs they are made,
# encoded for a front process and decoded there in a fraction of a dataclass's time (as
# arrays, without field names). A prompt's logprobs are many entries: the garbage
# collector does not track them (gc=False: they hold numbers and tuples of numbers, so
# they are in no cycle).


class TokenLogprobs(msgspec.Struct, array_like=True, gc=False):
    token_id: int
    logprob: float
    # the N most likely tokens, most likely first: tuples of numbers, which the garbage
    # collector stops tracking (a collection walks each tracked object)
    top: tuple[tuple[int, float], ...]
    rank: int | None = None  # its place among the vocab's logprobs (1: the most likely)


class RequestOutput(msgspec.Struct, array_like=True):
    """What one step produced for one request: a delta, not the whole output so far."""

    request_id: str  # the sequence's (request.sequence_ids)
    index: int  # which of the request's n choices
    token_ids: list[int]
    logprobs: list[TokenLogprobs] = msgspec.field(default_factory=list)
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
    # the tokens' text: filled in by the front's output processor (service/engine/text/),
    # never by the core
    text: str = ""

    @property
    def asked_as(self) -> str:
        """The id of the client's request this output answers."""
        return self.parent or self.request_id


def make_output(
    request: Request, tokens: list[int], logprobs: list[TokenLogprobs]
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
