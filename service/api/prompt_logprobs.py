"""Prompt tokens' logprobs in the two forms clients read: OpenAI's legacy `echo` with
`logprobs` on /v1/completions (the prompt's tokens before the completion's, the first
with none: what lm-evaluation-harness scores loglikelihoods from), and vLLM's
`prompt_logprobs` (a list with None first, then each token's entries by id).

A prompt's alternatives are many (up to the cap, check_size): the lists of them are
iterators, built as service/api/sse.py's json_in_turns encodes them, on the event loop
between other streams' turns."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from service.api.protocol import APIError
from service.api.serving import token_text
from service.api.state import ServingState
from service.engine.output import TokenLogprobs
from service.limits import MAX_PROMPT_LOGPROB_ENTRIES


def check_size(prompt_tokens: int, copies: int, alternatives: list[int], param: str) -> None:
    """A 400 naming `param` where the prompt logprobs a response would carry exceed the
    cap: `prompt_tokens` over all prompts, each scored `copies` times (its choices), once
    per form asked for with its `alternatives`."""
    entries = prompt_tokens * copies * sum(k + 1 for k in alternatives)
    if entries > MAX_PROMPT_LOGPROB_ENTRIES:
        raise APIError(
            400,
            f"{param}: the prompt logprobs asked for come to {entries:,} entries (prompt "
            f"tokens x (alternatives + 1), for every prompt and choice), above the cap of "
            f"{MAX_PROMPT_LOGPROB_ENTRIES:,}: ask for fewer alternatives, fewer prompts or "
            "fewer choices in one request",
            param=param,
        )


def echo_logprobs(
    state: ServingState, prompt_ids: list[int], entries: list[TokenLogprobs], top: int
) -> dict[str, Any]:
    """The prompt's part of a choice's `logprobs` (entries: SamplingParams.prompt_logprobs
    of it, computed with at least `top` alternatives), offsets from the text's start; its
    top_logprobs an iterator."""
    tokens, offsets, offset = [], [], 0
    for token in prompt_ids:
        text = token_text(state.tokenizer, token)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    # the first token has nothing before it to predict it
    return {
        "tokens": tokens,
        "token_logprobs": [None, *(e.logprob for e in entries[: len(prompt_ids) - 1])],
        "top_logprobs": _echo_tops(state, entries[: len(prompt_ids) - 1], top),
        "text_offset": offsets,
    }


def _echo_tops(
    state: ServingState, entries: list[TokenLogprobs], top: int
) -> Iterator[dict[str, float] | None]:
    yield None
    for e in entries:
        yield {token_text(state.tokenizer, t): v for t, v in e.top[:top]}


def vllm_prompt_logprobs(
    state: ServingState, entries: list[TokenLogprobs], top: int
) -> Iterator[dict[str, dict[str, Any]] | None]:
    """vLLM's form: per prompt token, None for the first, then {token id: {logprob,
    rank, decoded_token}} for the token itself and its `top` most likely alternatives."""
    yield None
    for e in entries:
        entry = {str(e.token_id): _entry(state, e.token_id, e.logprob, e.rank)}
        for rank, (token, value) in enumerate(e.top[:top], 1):
            entry.setdefault(str(token), _entry(state, token, value, rank))
        yield entry


def _entry(state: ServingState, token: int, logprob: float, rank: int | None) -> dict[str, Any]:
    return {"logprob": logprob, "rank": rank, "decoded_token": token_text(state.tokenizer, token)}
