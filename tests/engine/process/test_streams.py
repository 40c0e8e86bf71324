"""A request's deltas: steps that queued while the caller was busy arrive as one delta,
joined without losing a token, a character, a logprob or an error; their text made in
the front, cut at a stop string, whose end the core is told."""

import asyncio
import time
from dataclasses import dataclass, field

import pytest
from msgspec.structs import replace

from model.tokenizer import Tokenizer
from service.engine.output import RequestOutput, TokenLogprobs
from service.engine.process.streams import by_request, deltas
from service.engine.request import FinishReason, SamplingParams
from service.engine.text.processor import RequestText, Stop
from tests.engine.helpers import greedy
from tests.engine.process.cores import TRANSPORTS, client

TOKENIZER = Tokenizer.default()
WORDS = TOKENIZER.encode(" one two three four five six")


def out(token: int, index: int = 0, finished: bool = False, error: str | None = None, count=0):
    return RequestOutput(
        request_id="r" if index == 0 else f"r.{index}",
        index=index,
        token_ids=[token],
        logprobs=[TokenLogprobs(token, -0.5, ())],
        finished=finished,
        finish_reason=FinishReason.STOP if finished else None,
        num_output_tokens=count or token,
        error=error,
    )


@dataclass
class Ended:
    """How the stream ended, as the client is told (streams.Ends)."""

    stops: list[Stop] = field(default_factory=list)
    how: str = ""

    def stop(self, stop: Stop) -> None:
        self.stops.append(stop)

    def abort(self) -> None:
        self.how = "abort"

    def close(self) -> None:
        self.how = "close"


def drain(
    items: list, n: int = 1, stop: tuple[str, ...] = (), ended: Ended | None = None
) -> tuple[list[list[RequestOutput]], BaseException | None]:
    """Queue the items first, then read the deltas: the caller that fell behind."""

    async def main():
        queue: asyncio.Queue = asyncio.Queue()
        for item in items:
            queue.put_nowait(item)
        got = []
        text = RequestText(TOKENIZER, SamplingParams(n=n, stop=stop))
        try:
            async for outs in deltas(queue, text, ended or Ended()):
                got.append(outs)
        except Exception as exc:
            return got, exc
        return got, None

    return asyncio.run(main())


def test_steps_queued_while_the_caller_was_busy_arrive_as_one_delta() -> None:
    got, error = drain([[out(1)], [out(2)], [out(3, finished=True)]])
    assert error is None and len(got) == 1
    (joined,) = got[0]
    assert joined.token_ids == [1, 2, 3] and joined.text == TOKENIZER.decode([1, 2, 3])
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


def test_a_stop_string_cuts_the_output_and_the_core_is_told_where() -> None:
    """The stop string spans two tokens of one step: the output ends with the token that
    completed it, counted to there; what the core ran past it is never handed on; the
    stream closes (no abort: it ended). A core that had finished the sequence itself by
    then is told nothing."""
    first, second, third, fourth = WORDS[:4]
    stop = TOKENIZER.decode([second])[-2:] + TOKENIZER.decode([third])[:2]
    ended = Ended()
    steps = [[out(first, count=1)], [out(second, count=2), out(third, count=3)]]
    got, error = drain([*steps, [out(fourth, count=4)]], stop=(stop,), ended=ended)
    (outs,) = got
    (cut,) = outs
    assert error is None and cut.token_ids == [first, second, third]
    text = TOKENIZER.decode([first, second, third])
    assert cut.text == text[: text.find(stop)]
    assert cut.finished and cut.finish_reason == FinishReason.STOP and cut.num_output_tokens == 3
    assert ended.stops == [Stop("r", 3)] and ended.how == "close"
    ended = Ended()
    got, _ = drain([*steps, [out(fourth, finished=True, count=4)]], stop=(stop,), ended=ended)
    assert got[0][0].num_output_tokens == 3 and ended.stops == [] and ended.how == "close"


def test_a_stream_left_before_its_end_aborts() -> None:
    ended = Ended()
    _, error = drain([[out(1)], RuntimeError("gone")], ended=ended)
    assert isinstance(error, RuntimeError) and ended.how == "abort" and ended.stops == []


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_slow_caller_gets_every_token_in_fewer_deltas_than_steps(transport: str) -> None:
    """Over a real core: a caller that sleeps between deltas reads the same tokens as one
    that keeps up, in fewer deltas than the 24 steps made them (each step's tokens wait
    for it together). Whether the one that keeps up gets a delta a step depends on the
    machine's load, so only the slow one's count is checked."""
    engine = client(transport)

    async def read(rid: str, params: SamplingParams, pause: float) -> tuple[list[int], int]:
        tokens, count = [], 0
        async for outs in engine.generate(rid, engine.validate([5, 6, 7], params)):
            count += 1
            tokens += [t for o in outs for t in o.token_ids]
            time.sleep(pause)  # blocks the loop, as a busy front does
        return tokens, count

    try:
        fast, _ = asyncio.run(read("fast", greedy(24), 0.0))
        slow, slow_count = asyncio.run(read("slow", greedy(24), 0.2))
    finally:
        engine.shutdown()
    assert slow == fast and len(fast) == 24
    assert slow_count < len(slow)


def test_a_steps_outputs_go_to_the_request_each_answers() -> None:
    """Grouped by the request each sequence answers (carried with it), not by the shape
    of its id: a request whose own id has a dot keeps its outputs."""
    dotted = replace(out(1), request_id="x.y")
    first, second = (replace(out(2, i), request_id=f"r.{i}", parent="r") for i in (0, 1))
    assert by_request([dotted, first, second]) == {"x.y": [dotted], "r": [first, second]}
