"""Speculative decoding: cheap proposals of a sequence's next tokens, verified by the model.

A decoding sequence that has drafts d1..dk computes its last token and the k drafts in one
forward (the scheduler gives it 1 + k slots) and the sampler chooses a token at every one
of those k + 1 positions exactly as it would without drafts: the greedy argmax, or a draw
from the row's distribution with its temperature, top_k, top_p, min_p and logit_bias.
Draft i is accepted while the token chosen at its position equals it; the first chosen
token that differs (or the one after the last draft) ends the step's tokens, so a step
gives 1 to k + 1 tokens and the K/V of every accepted one is already in the cache (the
slots of rejected drafts lie past the sequence's computed tokens and are overwritten).

Exact: greedy output is the non-speculative output token for token. A sampled position's
choice is a draw from the target distribution given the accepted tokens before it, and
the draft is kept when the draw equals it, which for a proposal of one token (a point
mass q) is standard rejection sampling: accepted with probability min(1, p(d)/q(d)) =
p(d), and otherwise a token from (p - q)+ normalised = p without d. Proposals are
deterministic here (n-gram lookup; the draft model's greedy choice), so the output has
the target distribution whatever they propose.

Requests that speculate: decoding, unconstrained, without presence/frequency/repetition
penalties (those depend on the tokens before each position), while at most
`speculative_max_batch` sequences decode (a large batch is compute-bound: verifying
drafts there costs more than it saves), and while speculating measures faster than not
(Speculator).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from service.engine.request import Request

if TYPE_CHECKING:
    from service.config import SpeculativeConfig
    from service.engine.exec.draft import DraftModel

# n-gram lookup: the longest suffix of 4 down to 2 tokens that occurred before
NGRAM_MAX, NGRAM_MIN = 4, 2
# steps between probes of the way not taken, and the moving average's weight of a new
# step (~10 steps of memory, against step times' noise: docs/decisions.md)
PROBE_EVERY, EMA_WEIGHT = 16, 0.1


def ngram_drafts(tokens: Sequence[int], k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the sequence's last
    NGRAM_MAX..NGRAM_MIN tokens (the longest that occurs); the continuation runs on into
    the drafts themselves, so a repeating span of period p < k still gives k."""
    ids = np.asarray(tokens, dtype=np.int64)
    size = len(ids)
    for n in range(min(NGRAM_MAX, size - 1), NGRAM_MIN - 1, -1):
        tail = ids[size - n :]
        starts = np.flatnonzero(ids[: size - n] == tail[0])  # occurrences ending before it
        for j in range(1, n):
            if not len(starts):
                break
            starts = starts[ids[starts + j] == tail[j]]
        if len(starts):
            source, seq = int(starts[-1]) + n, ids.tolist()
            drafts: list[int] = []
            for i in range(k):  # past the end, the drafts continue themselves
                j = source + i
                drafts.append(seq[j] if j < size else drafts[j - size])
            return drafts
    return []


def accepted_drafts(drafts: list[int], chosen: list[int]) -> int:
    """Drafts accepted: those before the first whose position chose another token."""
    n = 0
    while n < len(drafts) and chosen[n] == drafts[n]:
        n += 1
    return n


class Speculator:
    """Sets each running request's draft_ids before the scheduler runs (the one place the
    policy lives): which requests speculate, how many drafts, from where, and whether it
    pays. That last is measured, not assumed: the engine reports every step of decodes
    only, and the speculator keeps the tokens per second per sequence of steps with
    drafts and of steps without (moving averages). While speculating is slower than
    `speculative_min_speedup` times that (a draft model whose drafts are wrong; a device
    where k + 1 rows cost much more than one) it only tries again every PROBE_EVERY steps;
    while it pays, one step in PROBE_EVERY goes without drafts to keep the comparison
    current."""

    def __init__(
        self, config: SpeculativeConfig, max_model_len: int, draft: DraftModel | None
    ) -> None:
        self.method = config.speculative_method
        self.k = config.num_speculative_tokens
        self.max_batch = config.speculative_max_batch
        self.min_speedup = config.speculative_min_speedup
        self.max_model_len = max_model_len
        self.draft = draft
        self.rates: dict[bool, float | None] = {True: None, False: None}  # with drafts or not
        self.steps = 0

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    def propose(self, running: Sequence[Request]) -> None:
        for r in running:
            r.draft_ids = []
        if not self.enabled:
            return
        decoding = [r for r in running if r.remaining == 1]
        if not decoding or len(decoding) > self.max_batch or not self._pays():
            return
        chosen = [(r, k) for r in decoding if (k := self._budget(r)) > 0]
        if self.method == "ngram":
            for r, k in chosen:
                r.draft_ids = ngram_drafts(r.token_ids, k)
        elif chosen and self.draft is not None:
            requests = [r for r, _ in chosen]
            for r, drafts in zip(
                requests, self.draft.propose(requests, [k for _, k in chosen]), strict=True
            ):
                r.draft_ids = drafts

    def observe(self, drafted: bool, tokens: int, seqs: int, seconds: float) -> None:
        """A step of `seqs` decodes only (with drafts or not) gave `tokens` in `seconds`."""
        if not self.enabled or seqs > self.max_batch or seconds <= 0:
            return
        rate, old = tokens / seqs / seconds, self.rates[drafted]
        self.rates[drafted] = rate if old is None else old + EMA_WEIGHT * (rate - old)

    def _pays(self) -> bool:
        """Whether this step speculates: first one without drafts (the baseline), then
        with; afterwards as measured, with a probe of the other way every PROBE_EVERY."""
        if not self.min_speedup:  # always
            return True
        self.steps += 1
        with_drafts, without = self.rates[True], self.rates[False]
        if without is None:
            return False
        probe = self.steps % PROBE_EVERY == 0
        if with_drafts is None or with_drafts >= self.min_speedup * without:
            return not probe
        return probe

    def _budget(self, r: Request) -> int:
        """Drafts request r may verify: every accepted one and the step's own token must
        fit in its max_tokens and the context; none under a grammar or penalties."""
        p = r.params
        if r.guide is not None or p.needs_penalties:
            return 0
        left = min(p.max_tokens - len(r.output_ids), self.max_model_len - r.num_tokens) - 1
        return max(0, min(self.k, left))
