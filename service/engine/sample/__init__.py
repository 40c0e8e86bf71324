"""Choosing tokens: the batched sampler and its draws, logprobs, and structured outputs'
grammars and masks."""
