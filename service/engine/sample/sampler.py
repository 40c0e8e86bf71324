"""Batched sampling with per-request parameters.

Order of operations (as in vLLM): logit_bias, then penalties (repetition on prompt and
output tokens; presence/frequency on output tokens, OpenAI's definition), then the
structured-output masks (tokens a constrained request's grammar forbids), then greedy
argmax, or temperature, top_k, top_p, min_p and a draw. A draw inverts the row's CDF at
one uniform number from the request's own generator (seeded requests), so the same seed
gives the same tokens whatever else is in the batch; one number per row, not one per
vocabulary entry (an Exp(1) noise race costs far more on the CPU: docs/decisions.md).
Logprobs are those of the model's raw distribution (log_softmax of the logits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from model.backends.base import Backend, flag_non_finite, mark_non_finite
from model.backends.reference import REFERENCE
from service.engine.output import TokenLogprobs
from service.engine.request import Request, SamplingParams
from service.engine.sample.draws import invert, top_p_filter
from service.engine.sample.logprobs import LogprobRows, token_logprobs


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    # a draw's distributions (B, V): each row's unnormalised CDF (its last column the
    # row's mass), for further draws from the same distribution; None when no row drew
    cdf: Tensor | None = None


class Sampler:
    """Every per-request value reaches the device as a non-blocking copy from pinned
    memory (on CUDA), so sampling never waits for the GPU until the sampled ids are read
    back: one device -> host transfer a step, plus the logprobs when a request asks."""

    def __init__(self, vocab_size: int, device: torch.device, backend: Backend = REFERENCE) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.greedy = backend.greedy
        self.default_generator = torch.Generator(device=device)
        self.default_generator.seed()
        self._pin = device.type == "cuda"

    def tensor(self, values: Sequence, dtype: torch.dtype = torch.float32) -> Tensor:
        """Values on the sampler's device (a non-blocking copy from pinned memory on CUDA)."""
        t = torch.tensor(values, dtype=dtype, pin_memory=self._pin)
        return t.to(self.device, non_blocking=True)

    def column(self, values: Sequence[float]) -> Tensor:
        return self.tensor(values).unsqueeze(1)  # (B, 1)

    def sample(
        self,
        logits: Tensor,
        requests: Sequence[Request],
        generators: Sequence[torch.Generator | None],
        mask: tuple[list[int], Tensor] | None = None,
    ) -> SampleResult:
        """logits: (B, V) in the model's dtype, one row per request; fp32 logits are
        consumed (edited in place: a step's logits are read once), others are read into
        an fp32 copy that the sampler edits. mask: the rows that
        are constrained (structured outputs) and, for each, the tokens it may take (R, V)
        bool; applied after bias and penalties, before the choice."""
        if mask is None and all(_plain(r.params) for r in requests):
            # the backend's argmax: no fp32 copy of the logits
            return SampleResult(self.greedy(logits), [None] * len(requests))
        tokens, peak, raw, cdf = self._choose(logits, requests, generators, mask)
        token_list = flag_non_finite(tokens, peak)
        lp = self._logprob_rows(raw, requests, tokens)
        return SampleResult(token_list, token_logprobs(lp, token_list), cdf)

    def pick(
        self,
        logits: Tensor,
        requests: Sequence[Request],
        generators: Sequence[torch.Generator | None],
        pending: Tensor | None = None,
    ) -> tuple[Tensor, LogprobRows | None]:
        """sample()'s choice left on the device (async scheduling reads it a step later):
        the ids (B,), NON_FINITE in a row whose logits are not finite, and the logprobs of
        the rows that ask for them. pending: each row's token not read yet (B,), -1 for
        none, which the penalties count as output (the host's output_ids lack it). For
        requests without grammars, whose masks need the tokens on the host."""
        if all(_plain(r.params) for r in requests):
            best = logits.max(dim=-1)
            return mark_non_finite(best.indices, best.values), None
        tokens, peak, raw, _ = self._choose(logits, requests, generators, None, pending)
        return mark_non_finite(tokens, peak), self._logprob_rows(raw, requests, tokens)

    def _choose(
        self,
        logits: Tensor,
        requests: Sequence[Request],
        generators: Sequence[torch.Generator | None],
        mask: tuple[list[int], Tensor] | None,
        pending: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """On the device: the chosen ids (B,), each row's peak logit (non-finite: the model
        failed), the raw fp32 logits the logprobs read and the draw's CDFs (or None)."""
        params = [r.params for r in requests]
        logits = logits.float()
        peak = logits.amax(dim=-1)  # of the model's logits: non-finite means it failed
        keep_raw = any(p.logprobs is not None for p in params)  # logprobs: of the raw logits
        raw = logits.clone() if keep_raw and (mask is not None or self._edits(params)) else logits
        if any(p.logit_bias for p in params):
            logits = self._apply_bias(logits, requests)
        if any(p.needs_penalties for p in params):
            logits = self._apply_penalties(logits, requests, pending)
        if mask is not None:
            rows, allowed = mask
            if len(rows) == len(requests):  # every row constrained: in place, no gather
                logits.masked_fill_(~allowed, float("-inf"))
            else:
                idx = self.tensor(rows, torch.long)
                logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
        greedy = [p.greedy for p in params]
        # the draw may edit the fp32 copy in place unless the logprobs still read it
        mine = not keep_raw or raw is not logits
        cdf = None
        if all(greedy):
            tokens = logits.max(dim=-1).indices  # (B,); as fast as argmax on the CPU
        elif not any(greedy):  # no argmax: it costs as much as the draw's softmax
            tokens, cdf = self._draw(logits, requests, generators, mine)
        else:
            best = logits.max(dim=-1).indices
            drawn, cdf = self._draw(logits, requests, generators, mine)
            tokens = torch.where(self.tensor(greedy, torch.bool), best, drawn)
        return tokens, peak, raw, cdf

    def index(self, rows: Sequence[int]) -> Tensor:
        """Row numbers as an index tensor on the sampler's device."""
        return self.tensor(rows, torch.long)

    @staticmethod
    def _edits(params: Sequence[SamplingParams]) -> bool:
        """Whether bias or penalties will change the logits in place."""
        return any(p.logit_bias or p.needs_penalties for p in params)

    def _apply_bias(self, logits: Tensor, requests: Sequence[Request]) -> Tensor:
        """Every request's bias entries as one scatter-add."""
        rows, cols, values = [], [], []
        for i, r in enumerate(requests):
            for token, bias in r.params.logit_bias:
                if 0 <= token < logits.shape[1]:
                    rows.append(i)
                    cols.append(token)
                    values.append(bias)
        if rows:
            index = (self.tensor(rows, torch.long), self.tensor(cols, torch.long))
            logits.index_put_(index, self.tensor(values), accumulate=True)
        return logits

    def _apply_penalties(
        self, logits: Tensor, requests: Sequence[Request], pending: Tensor | None = None
    ) -> Tensor:
        rows = [i for i, r in enumerate(requests) if r.params.needs_penalties]
        idx = self.tensor(rows, torch.long)
        sub = logits[idx]  # (P, V)
        v = sub.shape[1]
        out_ids = self._padded([requests[i].output_ids for i in rows], v)  # (P, W)
        if pending is not None:  # the unread tokens, a column more (none: the pad)
            last = pending[idx]
            out_ids = torch.cat([out_ids, torch.where(last < 0, v, last).unsqueeze(1)], dim=1)
        counts = torch.zeros(len(rows), v + 1, device=logits.device)
        counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=counts.dtype))
        counts = counts[:, :v]  # (P, V) occurrences in the output
        seen = counts > 0
        rep = [requests[i].params.repetition_penalty for i in rows]
        if any(r != 1 for r in rep):
            prompt_ids = self._padded([requests[i].prompt_ids for i in rows], v)
            prompt_seen = torch.zeros(len(rows), v + 1, dtype=torch.bool, device=logits.device)
            prompt_seen.scatter_(1, prompt_ids, True)
            any_seen = seen | prompt_seen[:, :v]
            rp = self.column(rep)
            # a penalty near 0 (any > 0 is valid) divides past float32's range: held at its
            # largest float, so that the draw's x - max stays a number (an infinity made
            # the row's CDF NaN and drew a token a structured-output mask forbids)
            boosted = (sub / rp).clamp_(max=torch.finfo(sub.dtype).max)
            sub = torch.where(any_seen, torch.where(sub > 0, boosted, sub * rp), sub)
        freq = self.column([requests[i].params.frequency_penalty for i in rows])
        pres = self.column([requests[i].params.presence_penalty for i in rows])
        sub = sub - freq * counts - pres * seen.float()
        logits[idx] = sub
        return logits

    def _padded(self, lists: Sequence[Sequence[int]], pad: int) -> Tensor:
        """Token id lists as one (len(lists), longest) tensor, padded (and ids outside
        0..pad clamped) to `pad`, a column that is dropped after the scatter."""
        width = max(1, max(len(ids) for ids in lists))
        flat = [min(max(t, 0), pad) for ids in lists for t in (*ids, *[pad] * (width - len(ids)))]
        return self.tensor(flat, torch.long).view(len(lists), width)

    def _draw(
        self,
        logits: Tensor,
        requests: Sequence[Request],
        generators: Sequence[torch.Generator | None],
        inplace: bool,
    ) -> tuple[Tensor, Tensor]:
        """The drawn ids (B,) and the rows' CDFs (B, V). inplace: logits (fp32) may be
        overwritten. One (B, V) buffer, edited in place:
        x - max, over the temperature, top_k, exp (unnormalised probabilities: the draw
        scales u by each row's mass), the CDF. On the CPU each pass over the logits costs,
        and a new buffer as much again (its pages are touched the first time)."""
        params = [r.params for r in requests]
        peak = logits.amax(dim=-1, keepdim=True)
        scaled = logits.sub_(peak) if inplace else logits - peak
        temps = [p.temperature if p.temperature > 0 else 1.0 for p in params]
        if any(t != 1.0 for t in temps):
            scaled.div_(self.column(temps))
        top_k = [p.top_k if p.top_k > 0 else 0 for p in params]
        below_k = None
        if any(top_k):
            k_max = min(max(top_k), scaled.shape[1])
            kth_vals = scaled.topk(k_max, dim=-1).values  # (B, k_max)
            ks = self.tensor([min(k, k_max) if k else k_max for k in top_k], torch.long)
            kth = kth_vals.gather(1, (ks - 1).unsqueeze(1))
            if not all(top_k):  # rows without top_k keep every token
                active = self.tensor([k > 0 for k in top_k], torch.bool).unsqueeze(1)
                kth = kth.masked_fill(~active, float("-inf"))
            below_k = scaled < kth
        probs = scaled.exp_()  # (B, V), each row's largest 1
        if below_k is not None:  # zeroed after exp: exp of -inf is the slower exp
            probs.masked_fill_(below_k, 0.0)
        if any(p.top_p < 1 for p in params):
            top_p = self.column([p.top_p for p in params])
            probs = top_p_filter(probs / probs.sum(dim=-1, keepdim=True), top_p)
        if any(p.min_p > 0 for p in params):  # relative to the row's largest: no normalising
            min_p = self.column([p.min_p for p in params])
            probs.masked_fill_(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        cdf = probs.cumsum_(dim=-1)  # zero-probability tokens add no step
        return invert(cdf, self.uniform(generators, 1)).squeeze(1), cdf

    def uniform(self, generators: Sequence[torch.Generator | None], n: int) -> Tensor:
        """(len(generators), n) uniform numbers, each seeded row's from its own generator
        (its tokens depend on its seed and position alone), the others' from one call of
        the shared generator."""
        u = torch.rand(len(generators), n, generator=self.default_generator, device=self.device)
        for k, g in enumerate(generators):
            if g is not None:
                u[k] = torch.rand(n, generator=g, device=self.device)
        return u

    def _logprob_rows(
        self, raw: Tensor, requests: Sequence[Request], tokens: Tensor
    ) -> LogprobRows | None:
        """On the device, for the rows that ask: the log_softmax of the raw logits at the
        chosen ids (B,) and its top entries (a row whose logits were not finite reads
        NaN here; LogprobRows.per_row leaves it out)."""
        rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        if not rows:
            return None
        idx = self.tensor(rows, torch.long)
        lp = torch.log_softmax(raw[idx], dim=-1)  # (R, V)
        chosen = lp.gather(1, tokens[idx].unsqueeze(1)).squeeze(1)
        counts = [requests[i].params.logprobs or 0 for i in rows]
        top_values, top_ids = lp.topk(max(*counts, 1), dim=-1)
        return LogprobRows(rows, counts, chosen, top_values, top_ids)


def _plain(p: SamplingParams) -> bool:
    """Greedy with nothing to apply first and nothing to report: the argmax alone."""
    return p.greedy and not p.logit_bias and not p.needs_penalties and p.logprobs is None
