"""A request's checks before it is queued: the prompt's ids, the context length, the
structured-output constraint and the KV pool's capacity. The engine runs them on add;
a front process runs them itself (service/engine/client.py), from the limits the engine
sends it, so that a bad request never crosses to the engine."""

from __future__ import annotations

from dataclasses import dataclass

from service.engine.request import ParamError, SamplingParams
from service.engine.structured import Grammars


class ContextLengthError(ParamError):
    """Prompt + max_tokens exceed the context (the API answers context_length_exceeded)."""


@dataclass(frozen=True, slots=True)
class Limits:
    vocab_size: int
    max_model_len: int
    num_blocks: int  # the KV pool
    block_size: int

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)


def check_request(
    prompt_ids: list[int], params: SamplingParams, limits: Limits, grammars: Grammars
) -> None:
    """Raise ParamError (a 400 naming the parameter) or ContextLengthError."""
    if not prompt_ids:
        raise ParamError("prompt", "must not be empty")
    vocab = limits.vocab_size
    bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ParamError("prompt", f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
    total = len(prompt_ids) + params.max_tokens
    if total > limits.max_model_len:
        raise ContextLengthError(
            "max_tokens" if len(prompt_ids) < limits.max_model_len else "prompt",
            f"this model's maximum context length is {limits.max_model_len} tokens; the "
            f"request has {len(prompt_ids)} prompt tokens and max_tokens "
            f"{params.max_tokens} ({total} in total)",
        )
    if params.constraint is not None:
        grammars.check(params.constraint)  # ConstraintError: a 400 naming the param
    if limits.blocks_for(total) > limits.num_blocks:
        capacity = limits.num_blocks * limits.block_size
        raise ContextLengthError(
            "max_tokens",
            f"prompt + max_tokens ({total}) exceed the KV cache capacity of {capacity} tokens",
        )
