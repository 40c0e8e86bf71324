"""How the rows of constrained requests choose their tokens (structured outputs).

A step's rows are sampled together first, without the grammars. A constrained row keeps
its choice when its grammar allows the token. Otherwise, in order of cost:

1. more choices from the same distribution (a plain row: no top_k/top_p/min_p, bias,
   penalties or logprobs): the next most likely tokens of a greedy row, further draws of
   a sampled one, from the CDF its first draw built (`CANDIDATES` of them); the first
   the grammar allows is the choice;
2. the row's mask (service/engine/sample/structured.py): a plain row whose grammar allows at
   most `SPARSE` tokens chooses among those alone, reading their logits only;
3. any other row is sampled again over its whole vocabulary with the mask applied (after
   bias and penalties, before the filters, as in vLLM).

Each is exact: the greedy choice is the most likely allowed token, and a draw kept only
when allowed, else drawn again, is a draw from the distribution restricted to the
allowed tokens (rejection sampling). A model that follows the format takes the first
choice almost always; a random one (the demo model) is this scheme's worst case, and
where the grammar forces the text the engine appends it without sampling at all
(jump-forward, service/engine/core/engine.py).

On a GPU the forward runs asynchronously and the host would wait for it: in that time
the host computes the masks of as many constrained rows as it can, in row order, and
those rows are sampled under their masks in the step's one pass (the steps above are
for the rest). On the CPU the forward has every core: a mask computed beside it would
only slow it down, so masks wait for the choices.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from service.engine.request import Request, SamplingParams
from service.engine.sample.draws import invert
from service.engine.sample.sampler import Sampler, SampleResult
from service.engine.sample.structured import Masks

# further choices a rejected plain row tries before its mask: checking a token is far
# cheaper than computing a mask over the vocabulary (docs/decisions.md)
CANDIDATES = 8
# a mask allowing at most this many tokens: the choice reads those tokens' logits alone
# (the grammar's structure: a quote, a comma, a digit) instead of the whole vocabulary
SPARSE = 4096


def _plain(p: SamplingParams) -> bool:
    """A row whose distribution is its logits' softmax at its temperature alone."""
    return not (p.filters or p.logit_bias or p.needs_penalties or p.logprobs is not None)


class StructuredSampler:
    def __init__(self, sampler: Sampler, masks: Masks) -> None:
        self.sampler, self.masks = sampler, masks

    def sample(
        self,
        logits: Tensor,
        requests: list[Request],
        gens: list[torch.Generator | None],
        guided: list[int],
        busy: Callable[[], bool] | None = None,
    ) -> SampleResult:
        """The step's choices (as Sampler.sample); guided: the rows with a grammar. busy:
        whether the device is still computing the logits (a GPU's forward runs
        asynchronously): until it is done, rows' masks are computed in the meantime and
        applied in the step's one pass. None: the logits are ready (the CPU's forward
        has every core, so a mask computed beside it would only slow it down)."""
        early = self._masks_while(busy, requests, guided) if busy is not None else {}
        mask = None
        if early:
            words = np.stack(list(early.values()))
            mask = ([guided[j] for j in early], self.masks.dense(words, logits.device))
        # the logits as the model gave them: the sampler edits fp32 logits in place
        before = logits.clone() if logits.dtype == torch.float32 else logits
        result = self.sampler.sample(logits, requests, gens, mask)
        guided_late = [(j, i) for j, i in enumerate(guided) if j not in early]
        redo = [
            j
            for j, i in guided_late
            if requests[i].params.filters or not requests[i].guide.allows(result.token_ids[i])
        ]
        if not redo:
            return result
        plain = [j for j in redo if _plain(requests[guided[j]].params)]
        found = self._candidates(before, result.cdf, requests, gens, guided, plain)
        for j, token in found.items():
            result.token_ids[guided[j]] = token
        redo = [j for j in redo if j not in found]
        if not redo:
            return result
        masks = self.masks
        words = masks.compute([requests[guided[j]].guide for j in redo])  # packed (R, W)
        counts = masks.counts(words)
        # an empty mask (a grammar in error) takes the dense path: the request fails alone
        sparse = [k for k, j in enumerate(redo) if 0 < counts[k] <= SPARSE and j in plain]
        if sparse:
            chosen = self._choose_among(before, words[sparse], [redo[k] for k in sparse],
                                        requests, gens, guided)  # fmt: skip
            for k, token in zip(sparse, chosen, strict=True):
                result.token_ids[guided[redo[k]]] = token
        dense = [k for k in range(len(redo)) if k not in sparse]
        if dense:
            rows = [guided[redo[k]] for k in dense]
            allowed = masks.dense(words[dense], logits.device)
            again = self.sampler.sample(
                before[self.sampler.index(rows)],
                [requests[i] for i in rows],
                [gens[i] for i in rows],
                (list(range(len(rows))), allowed),
            )
            for k, i in enumerate(rows):
                result.token_ids[i], result.logprobs[i] = again.token_ids[k], again.logprobs[k]
        return result

    def _masks_while(
        self, busy: Callable[[], bool], requests: list[Request], guided: list[int]
    ) -> dict[int, np.ndarray]:
        """{j: packed mask} of the rows whose masks were computed before the device
        finished the forward (host time that would otherwise wait on it), in row order.
        Not seeded rows: their tokens depend on their seed and position alone, never on
        how soon a forward finished."""
        early: dict[int, np.ndarray] = {}
        for j, i in enumerate(guided):
            if requests[i].params.seed is not None:
                continue
            if not busy():
                break
            early[j] = self.masks.compute([requests[i].guide])[0]
        return early

    def _candidates(
        self,
        before: Tensor,
        cdf: Tensor | None,
        requests: list[Request],
        gens: list[torch.Generator | None],
        guided: list[int],
        plain: list[int],
    ) -> dict[int, int]:
        """{j: token} for the plain rejected rows that find an allowed token among their
        next CANDIDATES choices: a greedy row's most likely tokens in order, a sampled
        row's further draws from its first draw's CDF."""
        choices: dict[int, list[int]] = {}
        greedy = [j for j in plain if requests[guided[j]].params.greedy]
        drawn = [j for j in plain if not requests[guided[j]].params.greedy]
        if greedy:
            # from the most likely: the first pass's argmax may be any of tied tokens
            k = min(CANDIDATES + 1, before.shape[1])
            best = before[self.sampler.index([guided[j] for j in greedy])].topk(k, dim=-1)
            best = best.indices
            choices.update(zip(greedy, best.tolist(), strict=True))
        if drawn and cdf is not None:
            # every row of the CDF is searched (a few numbers each): no copy of the rows
            u = torch.zeros(cdf.shape[0], CANDIDATES, device=cdf.device)
            rows = self.sampler.index([guided[j] for j in drawn])
            u[rows] = self.sampler.uniform([gens[guided[j]] for j in drawn], CANDIDATES)
            picks = invert(cdf, u)[rows]
            choices.update(zip(drawn, picks.tolist(), strict=True))
        found = {}
        for j, tokens in choices.items():
            allows = requests[guided[j]].guide.allows
            token = next((t for t in tokens if allows(t)), None)
            if token is not None:
                found[j] = token
        return found

    def _choose_among(
        self,
        before: Tensor,
        words: np.ndarray,
        js: list[int],
        requests: list[Request],
        gens: list[torch.Generator | None],
        guided: list[int],
    ) -> list[int]:
        """Plain rows' choices among the tokens their masks allow (words: packed, one row
        each), reading those tokens' logits alone: the most likely, or a draw from their
        softmax at the row's temperature. The rows' token lists as one padded batch."""
        row, ids = Masks.pairs(words)
        counts = np.bincount(row, minlength=len(js))
        col = np.arange(len(row)) - np.repeat(np.cumsum(counts) - counts, counts)
        device = before.device
        r, c = torch.from_numpy(row).to(device), torch.from_numpy(col).to(device)
        tokens = torch.from_numpy(ids).to(device)
        x = torch.full((len(js), int(counts.max())), float("-inf"), device=device)
        x[r, c] = before[self.sampler.index([guided[j] for j in js])[r], tokens].float()
        token_at = torch.zeros(x.shape, dtype=torch.long, device=device)
        token_at[r, c] = tokens
        params = [requests[guided[j]].params for j in js]
        if all(p.greedy for p in params):
            pos = x.argmax(dim=1, keepdim=True)
        else:
            temps = self.sampler.column(
                [p.temperature if p.temperature > 0 else 1.0 for p in params]
            )
            cdf = torch.softmax(x / temps, dim=1).cumsum_(dim=1)
            pos = invert(cdf, self.sampler.uniform([gens[guided[j]] for j in js], 1))
            if any(p.greedy for p in params):
                greedy = self.sampler.tensor([p.greedy for p in params], torch.bool)
                pos = torch.where(greedy.unsqueeze(1), x.argmax(dim=1, keepdim=True), pos)
        return token_at.gather(1, pos).squeeze(1).tolist()
