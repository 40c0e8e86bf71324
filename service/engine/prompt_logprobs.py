"""Logprobs of prompt tokens (echo with logprobs, vLLM's prompt_logprobs): the logits of a
prompt chunk's rows, each scored against the prompt token after it."""

from __future__ import annotations

import torch
from torch import Tensor

from service.engine.output import TokenLogprobs

# rows scored at once: a slice's fp32 log-softmax is rows x vocab floats
SLICE_ROWS = 256


def score(logits: Tensor, targets: list[int], top: int) -> list[TokenLogprobs]:
    """logits (R, V) of R positions, targets: the token after each; -> each target's
    logprob and rank, with the `top` most likely tokens' logprobs, most likely first."""
    out: list[TokenLogprobs] = []
    ids = torch.tensor(targets, device=logits.device)
    for lo in range(0, len(targets), SLICE_ROWS):
        lp = torch.log_softmax(logits[lo : lo + SLICE_ROWS].float(), dim=-1)
        target = ids[lo : lo + SLICE_ROWS, None]
        chosen = lp.gather(1, target)
        ranks = (lp > chosen).sum(dim=1) + 1
        values, top_ids = lp.topk(top, dim=1) if top else (lp[:, :0], target[:, :0])
        rows = zip(
            targets[lo : lo + SLICE_ROWS],
            chosen[:, 0].tolist(),
            ranks.tolist(),
            top_ids.tolist(),
            values.tolist(),
            strict=True,
        )
        for token, logprob, rank, t_ids, t_values in rows:
            out.append(TokenLogprobs(token, logprob, list(zip(t_ids, t_values, strict=True)), rank))
    return out
