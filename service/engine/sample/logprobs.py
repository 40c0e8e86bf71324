"""Logprobs of the sampled rows that ask for them: kept as tensors on the device until the
step's tokens are read, then one TokenLogprobs per row."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from service.engine.output import TokenLogprobs


@dataclass(slots=True)
class LogprobRows:
    """The logprobs of the batch rows that ask for them, as tensors (on the device until
    read): rows, each one's count of top entries asked for, the chosen token's logprob
    (R,) and the most likely tokens' (R, K) values and ids, most likely first."""

    rows: list[int]
    counts: list[int]
    chosen: Tensor
    top_values: Tensor
    top_ids: Tensor

    def moved(self, move: Callable[[Tensor], Tensor]) -> LogprobRows:
        """The same rows with each tensor passed through move (a copy to the host)."""
        tensors = (move(self.chosen), move(self.top_values), move(self.top_ids))
        return LogprobRows(self.rows, self.counts, *tensors)

    def per_row(self, tokens: list[int]) -> list[TokenLogprobs | None]:
        """One entry per batch row (tokens: the rows' chosen ids, read): a row that asked
        and whose logits were finite gets its TokenLogprobs, the others None."""
        result: list[TokenLogprobs | None] = [None] * len(tokens)
        chosen, values, ids = self.chosen.tolist(), self.top_values.tolist(), self.top_ids.tolist()
        for j, i in enumerate(self.rows):
            if tokens[i] >= 0:
                n = self.counts[j]
                top = tuple(zip(ids[j][:n], values[j][:n], strict=True))
                result[i] = TokenLogprobs(tokens[i], chosen[j], top)
        return result


def token_logprobs(lp: LogprobRows | None, tokens: list[int]) -> list[TokenLogprobs | None]:
    return lp.per_row(tokens) if lp is not None else [None] * len(tokens)
