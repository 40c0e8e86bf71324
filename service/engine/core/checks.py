"""A request's checks before it is queued: the prompt's ids, the context length, the
structured-output constraint and the KV pool's capacity. They run once: in the front
(service/engine/process/client.py, with the limits the core sent it), or in
LLMEngine.add_request for an engine driven in its own process. What passes is `Checked`,
the only form in which a request reaches the engine's queue."""

from __future__ import annotations

from dataclasses import dataclass

from service.engine.request import ParamError, SamplingParams
from service.engine.sample.structured import Grammars


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


@dataclass(frozen=True, slots=True)
class Checked:
    """A request that passed check_request (made there alone)."""

    prompt_ids: list[int]
    params: SamplingParams
    # its constraint as the checked llguidance grammar: an engine in another process
    # takes it (Grammars.adopt) instead of validating it again
    grammar: str | None = None


def check_request(
    prompt_ids: list[int], params: SamplingParams, limits: Limits, grammars: Grammars
) -> Checked:
    """The request, checked; else ParamError (a 400 naming the parameter) or
    ContextLengthError."""
    if not prompt_ids:
        raise ParamError("prompt", "must not be empty")
    vocab = limits.vocab_size
    bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ParamError("prompt", f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
    pools = params.pooling is not None  # an embedding: its input's rows, no new token
    total = len(prompt_ids) + (0 if pools else params.max_tokens)
    if total > limits.max_model_len:
        raise _too_long(len(prompt_ids), params.max_tokens, pools, limits.max_model_len)
    grammar = None
    if params.constraint is not None:
        grammars.check(params.constraint)  # ConstraintError: a 400 naming the param
        grammar = grammars.compiled(params.constraint)
    if limits.blocks_for(total) > limits.num_blocks:
        capacity = limits.num_blocks * limits.block_size
        raise ContextLengthError(
            "input" if pools else "max_tokens",
            f"{total} tokens ({'the input' if pools else 'prompt + max_tokens'}) exceed the KV "
            f"cache capacity of {capacity} tokens",
        )
    return Checked(prompt_ids, params, grammar)


def _too_long(prompt: int, max_tokens: int, pools: bool, limit: int) -> ContextLengthError:
    said = f"this model's maximum context length is {limit} tokens"
    if pools:
        return ContextLengthError("input", f"{said}; the input has {prompt} tokens")
    total = prompt + max_tokens
    return ContextLengthError(
        "max_tokens" if prompt < limit else "prompt",
        f"{said}; the request has {prompt} prompt tokens and max_tokens {max_tokens} "
        f"({total} in total)",
    )
