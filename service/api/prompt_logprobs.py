"""Prompt tokens' logprobs in the two forms clients read: OpenAI's legacy `echo` with
`logprobs` on /v1/completions (the prompt's tokens before the completion's, the first
with none: what lm-evaluation-harness scores loglikelihoods from), and vLLM's
`prompt_logprobs` (a list with None first, then each token's entries by id)."""

from __future__ import annotations

from typing import Any

from service.api.serving import token_text
from service.api.state import ServingState
from service.engine.output import TokenLogprobs


def echo_logprobs(
    state: ServingState, prompt_ids: list[int], entries: list[TokenLogprobs], top: int
) -> dict[str, Any]:
    """The prompt's part of a choice's `logprobs` (entries: SamplingParams.prompt_logprobs
    of it, computed with at least `top` alternatives), offsets from the text's start."""
    tokens, values, tops, offsets, offset = [], [], [], [], 0
    for i, token in enumerate(prompt_ids):
        text = token_text(state.tokenizer, token)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if i == 0:  # nothing before it to predict it
            values.append(None)
            tops.append(None)
            continue
        e = entries[i - 1]
        values.append(e.logprob)
        tops.append({token_text(state.tokenizer, t): v for t, v in e.top[:top]})
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def vllm_prompt_logprobs(
    state: ServingState, entries: list[TokenLogprobs], top: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's form: per prompt token, None for the first, then {token id: {logprob,
    rank, decoded_token}} for the token itself and its `top` most likely alternatives."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for e in entries:
        entry = {str(e.token_id): _entry(state, e.token_id, e.logprob, e.rank)}
        for rank, (token, value) in enumerate(e.top[:top], 1):
            entry.setdefault(str(token), _entry(state, token, value, rank))
        out.append(entry)
    return out


def _entry(state: ServingState, token: int, logprob: float, rank: int | None) -> dict[str, Any]:
    return {"logprob": logprob, "rank": rank, "decoded_token": token_text(state.tokenizer, token)}
