"""What a step computes from prompt rows beside its samples: prompt tokens' logprobs (echo
with logprobs, vLLM's prompt_logprobs: the logits of a prompt chunk's rows, each scored
against the prompt token after it) and embedding requests' pooled final hidden states."""

from __future__ import annotations

import torch
from torch import Tensor

from service.engine.batch import ScheduledSeq
from service.engine.output import TokenLogprobs
from service.engine.request import Request

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
        # the tokens likelier than each target, counted as bytes (a bool sum widens to
        # int64 first, at twice the time)
        ranks = (lp > chosen).view(torch.uint8).sum(dim=1, dtype=torch.int32) + 1
        values, top_ids = lp.topk(top, dim=1) if top else (lp[:, :0], target[:, :0])
        entries = zip(
            targets[lo : lo + SLICE_ROWS],
            chosen[:, 0].tolist(),
            ranks.tolist(),
            top_ids.tolist(),
            values.tolist(),
            strict=True,
        )
        for token, logprob, rank, t_ids, t_values in entries:
            out.append(
                TokenLogprobs(token, logprob, tuple(zip(t_ids, t_values, strict=True)), rank)
            )
    return out


# (request, its first row in the step, the prompt tokens its rows score)
Scored = tuple[Request, int, list[int]]
# (request, its rows the pooling reads, whether the chunk ends its prompt)
Pooled = tuple[Request, range, bool]


def prompt_work(seqs: list[ScheduledSeq]) -> tuple[list[Scored], list[Pooled]]:
    """The step's rows whose prompt logprobs are wanted (their logits go after the
    sampled rows'), and its embedding requests' rows."""
    scored, pooled, row = [], [], 0
    for seq in seqs:
        if seq.request.params.pooling is not None:
            pooled.append(pool_rows(seq, row))
        if seq.request.scores_prompt:
            rows = prompt_rows(seq.request, seq.start, seq.num_new, row)
            if rows[2]:
                scored.append(rows)
        row += seq.num_new + len(seq.drafts)
    return scored, pooled


def prompt_rows(request: Request, start: int, num_new: int, row: int) -> Scored:
    """The rows of a chunk (its first at `row`, from position `start`) whose prompt
    logprobs are still wanted: each position p scores prompt token p + 1."""
    first = max(start, len(request.prompt_logprobs))
    stop = min(start + num_new, request.num_prompt - 1)
    targets = request.prompt_ids[first + 1 : stop + 1] if stop > first else []
    return request, row + first - start, targets


def score_prompts(logits: Tensor, scored: list[Scored]) -> None:
    """Each request's prompt logprobs of this chunk (logits: their rows, in order)."""
    at = 0
    for request, _, targets in scored:
        top = request.params.prompt_logprobs or 0
        request.prompt_logprobs += score(logits[at : at + len(targets)], targets, top)
        at += len(targets)


def pool_rows(seq: ScheduledSeq, row: int) -> Pooled:
    """An embedding request's rows of a chunk (its first at `row`) that its pooling
    reads: every row for a mean, the prompt's last for last-token pooling."""
    if seq.request.params.pooling == "mean":
        return seq.request, range(row, row + seq.num_new), seq.pools
    last = row + seq.num_new - 1
    return seq.request, range(last, last + 1) if seq.pools else range(0), seq.pools


def pool(hidden: Tensor, pooled: list[Pooled]) -> None:
    """Add each embedding request's rows of the step's final hidden states to its sum;
    a finished prompt's mean or last row, normalised, becomes its embedding (on the
    host)."""
    for request, rows, last in pooled:
        if rows:
            part = hidden[rows.start : rows.stop].float().sum(dim=0)
            request.pool_sum = part if request.pool_sum is None else request.pool_sum + part
        if last:
            mean = request.params.pooling == "mean"
            state = request.pool_sum / (request.num_prompt if mean else 1)
            request.embedding = torch.nn.functional.normalize(state, dim=0).tolist()
            request.pool_sum = None
