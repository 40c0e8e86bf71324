"""A single-sequence reference generator over the paged cache: the model's own check
(tests, the `kvserve generate` command). Serving goes through service.engine."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from model.backends.base import Backend
from model.kv_cache import PagedKVCache
from model.metadata import AttentionMetadata
from model.transformer import Transformer


@torch.no_grad()
def generate(
    model: Transformer,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    backend: Backend,
    temperature: float = 0.0,
    eos_ids: Sequence[int] = (),
    seed: int | None = None,
    block_size: int = 16,
) -> Iterator[int]:
    """Yield up to max_new_tokens ids: greedy at temperature 0, else sampled; `backend`
    runs the cache and attention (model/backends' select_backend gives one)."""
    if not prompt_ids:
        raise ValueError("prompt must contain at least one token")
    total = len(prompt_ids) + max_new_tokens
    if total > model.cfg.max_position:
        raise ValueError(
            f"prompt ({len(prompt_ids)}) + max_new_tokens ({max_new_tokens}) exceeds the "
            f"context length {model.cfg.max_position}"
        )
    n_blocks = -(-total // block_size)
    cache = PagedKVCache(model.cfg, n_blocks, block_size, model.dtype, model.device, backend)
    table = [list(range(n_blocks))]
    gen = torch.Generator(device=model.device)
    if seed is not None:
        gen.manual_seed(seed)
    tokens = torch.tensor(list(prompt_ids), dtype=torch.long, device=model.device)
    cached = 0
    for _ in range(max_new_tokens):
        meta = AttentionMetadata.paged(table, [cached], [tokens.shape[0]], block_size, model.device)
        last = torch.tensor([tokens.shape[0] - 1], device=model.device)
        logits = model(tokens, meta, cache, logits_indices=last)[0].float()  # (V,)
        cached += tokens.shape[0]
        if temperature <= 0:
            next_id = int(logits.argmax())
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            next_id = int(torch.multinomial(probs, 1, generator=gen))
        yield next_id
        if next_id in eos_ids:
            return
        tokens = torch.tensor([next_id], dtype=torch.long, device=model.device)
