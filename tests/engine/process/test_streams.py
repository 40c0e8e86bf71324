"""A request's deltas: steps that queued while the caller was busy arrive as one delta,
joined without losing a token, a character, a logprob or an error."""

import asyncio
import time
from dataclasses import replace

import pytest

from service.engine.output import RequestOutput, TokenLogprobs
from service.engine.process.streams import by_request, deltas
from service.engine.request import FinishReason, SamplingParams
from tests.engine.helpers import greedy
from tests.engine.process.cores import TRANSPORTS, client


def out(token: int, index: int = 0, finished: bool = False, error: str | None = None):
    return RequestOutput(
        request_id="r" if index == 0 else f"r.{index}",
        index=index,
        token_ids=[token],
        text=f"<{token}>",
        logprobs=[TokenLogprobs(token, -0.5, ())],
        finished=finished,
        finish_reason=FinishReason.STOP if finished else None,
        num_output_tokens=token,
        error=error,
    )


def drain(items: list, n: int = 1) -> tuple[list[list[RequestOutput]], BaseException | None]:
    """Queue the items first, then read the deltas: the caller that fell behind."""

    async def main():
        queue: asyncio.Queue = asyncio.Queue()
        for item in items:
            queue.put_nowait(item)
        got = []
        try:
            async for outs in deltas(queue, n, lambda: None):
                got.append(outs)
        except Exception as exc:
            return got, exc
        return got, None

    return asyncio.run(main())


def test_steps_queued_while_the_caller_was_busy_arrive_as_one_delta() -> None:
    got, error = drain([[out(1)], [out(2)], [out(3, finished=True)]])
    assert error is None and len(got) == 1
    (joined,) = got[0]
    assert joined.token_ids == [1, 2, 3] and joined.text == "<1><2><3>"
    assert [lp.token_id for lp in joined.logprobs] == [1, 2, 3]
    assert joined.finished and joined.finish_reason == FinishReason.STOP
    assert joined.num_output_tokens == 3  # the counts are the latest step's


def test_each_sequence_of_an_n_request_is_joined_apart() -> None:
    got, _ = drain([[out(1, 0), out(10, 1)], [out(2, 0)], [out(3, 0, True), out(11, 1, True)]], 2)
    (outs,) = got
    assert [(o.index, o.token_ids, o.finished) for o in outs] == [
        (0, [1, 2, 3], True),
        (1, [10, 11], True),
    ]


def test_a_failed_output_stays_after_the_text_before_it() -> None:
    got, _ = drain([[out(1)], [out(2, finished=True, error="generation failed")]])
    (outs,) = got
    assert [(o.token_ids, o.error) for o in outs] == [([1], None), ([2], "generation failed")]


def test_an_error_queued_behind_outputs_is_raised_after_them() -> None:
    got, error = drain([[out(1)], [out(2)], RuntimeError("engine died")])
    assert [o.token_ids for outs in got for o in outs] == [[1, 2]]
    assert isinstance(error, RuntimeError) and str(error) == "engine died"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_slow_caller_gets_every_token_in_fewer_deltas_than_steps(transport: str) -> None:
    """Over a real core: a caller that sleeps between deltas reads the same tokens as one
    that keeps up, in fewer deltas."""
    engine = client(transport)

    async def read(rid: str, params: SamplingParams, pause: float) -> tuple[list[int], int]:
        tokens, count = [], 0
        async for outs in engine.generate(rid, [5, 6, 7], params):
            count += 1
            tokens += [t for o in outs for t in o.token_ids]
            time.sleep(pause)  # blocks the loop, as a busy front does
        return tokens, count

    try:
        fast, fast_count = asyncio.run(read("fast", greedy(24), 0.0))
        slow, slow_count = asyncio.run(read("slow", greedy(24), 0.05))
    finally:
        engine.shutdown()
    assert slow == fast and len(fast) == 24
    assert slow_count < fast_count


def test_a_steps_outputs_go_to_the_request_each_answers() -> None:
    """Grouped by the request each sequence answers (carried with it), not by the shape
    of its id: a request whose own id has a dot keeps its outputs."""
    dotted = replace(out(1), request_id="x.y")
    first, second = (replace(out(2, i), request_id=f"r.{i}", parent="r") for i in (0, 1))
    assert by_request([dotted, first, second]) == {"x.y": [dotted], "r": [first, second]}
