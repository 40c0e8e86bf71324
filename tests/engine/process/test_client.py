"""The client of the engine core, over both transports (a thread of this process, a
process of its own): deltas stream, early exit aborts, failures stay local, a dead core
ends every stream."""

import asyncio
import dataclasses
import threading
import time

import pytest

from service.engine.process.client import EngineClient
from service.engine.process.streams import EngineDeadError, RequestFailed
from service.engine.request import ParamError, SamplingParams
from tests.engine.helpers import greedy
from tests.engine.process.cores import TRANSPORTS, client
from tests.factories import make_engine, small_model


@pytest.fixture(scope="module", params=TRANSPORTS)
def engine(request):
    eng = client(request.param)
    yield eng
    eng.shutdown()


async def collect(
    eng: EngineClient, rid: str, prompt: list[int], params: SamplingParams
) -> list[int]:
    tokens = []
    async for outs in eng.generate(rid, eng.validate(prompt, params)):
        for o in outs:
            tokens.extend(o.token_ids)
    return tokens


def settled(eng: EngineClient, timeout: float = 5.0) -> bool:
    """The core holds no request and no KV block, as its last snapshot says."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snap = eng.snapshot()
        if snap.running == snap.waiting == snap.kv_blocks_used == 0:
            return True
        time.sleep(0.01)
    return False


def test_concurrent_requests_stream_and_match_the_sync_engine(engine: EngineClient) -> None:
    prompts = {f"c{i}": [i + 1] * (3 + i) for i in range(8)}

    async def main() -> dict[str, list[int]]:
        results = await asyncio.gather(
            *(collect(engine, rid, p, greedy(12)) for rid, p in prompts.items())
        )
        return dict(zip(prompts, results))

    got = asyncio.run(main())
    sync = make_engine(small_model())
    for rid, p in prompts.items():
        sync.add_request(rid, p, greedy(12))
    ref: dict[str, list[int]] = {}
    while sync.has_unfinished():
        for o in sync.step():
            ref.setdefault(o.request_id, []).extend(o.token_ids)
    assert got == ref
    assert engine.healthy()


def test_leaving_early_aborts_and_frees_blocks(engine: EngineClient) -> None:
    async def main() -> None:
        seen = 0
        async for _ in engine.generate("early", engine.validate(list(range(40)), greedy(200))):
            seen += 1
            if seen == 3:
                break

    asyncio.run(main())
    assert settled(engine)


def test_a_request_is_checked_once_in_the_front_and_a_bad_one_never_sent(
    engine: EngineClient,
) -> None:
    """The front's check names the parameter at fault before anything is sent: the core
    never hears of the bad request, and what it queues is what a front checked."""
    before = engine.snapshot().prompt_tokens
    with pytest.raises(ParamError, match="outside the vocabulary") as caught:
        engine.validate([1, 10_000], greedy(3))
    assert caught.value.param == "prompt"
    assert len(asyncio.run(collect(engine, "ok", [1, 2, 3], greedy(10)))) == 10
    assert engine.snapshot().prompt_tokens == before + 3


def test_n_sequences_stream_to_the_request_that_asked(engine: EngineClient) -> None:
    """An n > 1 request's sequences reach its stream, beside a request whose own id has a
    dot."""

    async def main() -> tuple[list[list], list[int]]:
        async def choices() -> list[list]:
            got: list[list] = [[], [], []]
            async for outs in engine.generate("n3", engine.validate([7, 8, 9], greedy(5, n=3))):
                for o in outs:
                    got[o.index] += o.token_ids
            return got

        return await asyncio.gather(choices(), collect(engine, "n3.x", [7, 8], greedy(4)))

    got, lookalike = asyncio.run(main())
    assert [len(c) for c in got] == [5, 5, 5] and len(lookalike) == 4
    assert got[0] == got[1] == got[2]  # greedy: the same tokens each time
    assert settled(engine)


def test_a_stop_string_ends_the_request_in_the_front_and_the_core_counts_it(
    engine: EngineClient,
) -> None:
    """The text is made in the front, which finds the stop string and tells the core: the
    stream ends with the token that completed it, the core finishes the request as
    stopped with its output counted to there (what the metrics hear), and frees its
    blocks."""
    heard = []

    class Observer:
        def on_step(self, *_: object) -> None: ...
        def on_token_intervals(self, _: object) -> None: ...
        def on_finished(self, output) -> None:  # type: ignore[no-untyped-def]
            heard.append(output)

    async def text_of(rid: str, params: SamplingParams) -> tuple[str, list[int], list]:
        text, tokens, outs = "", [], []
        async for step in engine.generate(rid, engine.validate([9, 8, 7], params)):
            outs += step
            text += "".join(o.text for o in step)
            tokens += [t for o in step for t in o.token_ids]
        return text, tokens, outs

    free, free_tokens, _ = asyncio.run(text_of("free", greedy(40)))
    tok = engine.tokenizer
    k = len(tok.decode(free_tokens[:12]))
    stop = free[k : k + 3]
    k = free.find(stop)  # its first place
    kept = next(m for m in range(1, 41) if stop in tok.decode(free_tokens[:m]))
    before = dict(engine.snapshot().finished).get("stop", 0)
    engine.observer = Observer()
    try:
        text, tokens, outs = asyncio.run(text_of("stopped", greedy(40, stop=(stop,))))
        assert settled(engine)
        deadline = time.monotonic() + 5
        while not heard and time.monotonic() < deadline:  # told with the snapshot
            time.sleep(0.01)
    finally:
        engine.observer = None
    assert text == free[:k] and tokens == free_tokens[:kept] and kept < 40
    last = outs[-1]
    assert last.finished and last.finish_reason.value == "stop"
    assert last.num_output_tokens == kept
    assert dict(engine.snapshot().finished)["stop"] == before + 1
    (told,) = heard  # the core's own finish, for the metrics
    assert told.finish_reason.value == "stop" and told.num_output_tokens == kept


def test_other_threads_read_the_snapshot_sent_after_each_step(engine: EngineClient) -> None:
    """The metrics and /health read an immutable snapshot the core sends with every
    step, already current when a request's last delta arrives."""
    assert settled(engine)
    before = engine.snapshot()
    tokens = asyncio.run(collect(engine, "snap", [1, 2, 3], greedy(5)))
    after = engine.snapshot()
    assert len(tokens) == 5 and after is not before
    with pytest.raises(dataclasses.FrozenInstanceError):
        after.running = 1  # type: ignore[misc]
    assert after.generation_tokens == before.generation_tokens + 5
    assert after.prompt_tokens == before.prompt_tokens + 3
    assert dict(after.finished)["length"] == dict(before.finished).get("length", 0) + 1
    assert after.running == after.waiting == after.kv_blocks_used == 0


def test_floors_are_measured_by_the_core_while_requests_stream(engine: EngineClient) -> None:
    async def main() -> tuple[dict, list[int]]:
        stream = asyncio.ensure_future(collect(engine, "floors", [1, 2, 3], greedy(20)))
        return await engine.floors(), await stream

    floors, tokens = asyncio.run(main())
    assert floors == {} and len(tokens) == 20 and engine.healthy()


def test_the_observer_hears_every_step_and_a_failing_one_harms_nothing(
    engine: EngineClient,
) -> None:
    """The core's measurements reach the front's observer (the metrics); an observer that
    raises is logged and the streams go on."""
    heard: list[str] = []

    class Observer:
        def on_step(self, seconds: float, num_tokens: int, num_seqs: int) -> None:
            heard.append("step")
            raise RuntimeError("a broken observer")

        def on_token_intervals(self, seconds: list[float]) -> None:
            heard.append("intervals")

        def on_finished(self, output) -> None:  # type: ignore[no-untyped-def]
            heard.append("finished")

    engine.observer = Observer()
    try:
        tokens = asyncio.run(collect(engine, "observed", [4, 5, 6], greedy(6)))
    finally:
        engine.observer = None
    assert len(tokens) == 6 and engine.healthy()
    assert heard.count("step") >= 6 and heard.count("finished") == 1


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_dead_core_ends_its_streams_and_reports_unhealthy(transport: str) -> None:
    eng = client(transport, "dies-at-step")

    async def main() -> None:
        with pytest.raises(EngineDeadError, match="simulated engine fault"):
            await collect(eng, "x", [1, 2], greedy(3))
        with pytest.raises(EngineDeadError):  # and a request after it is refused at once
            await collect(eng, "y", [1, 2], greedy(3))

    asyncio.run(main())
    assert not eng.healthy() and isinstance(eng.error, EngineDeadError)
    eng.shutdown()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_failure_to_load_is_raised_by_start(transport: str) -> None:
    with pytest.raises(RuntimeError, match="cannot load this model"):
        client(transport, "fails-to-load")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_shutdown_ends_every_open_stream(transport: str) -> None:
    """Streams still generating when the engine shuts down end with an error instead of
    waiting for ever."""
    eng = client(transport)

    async def main() -> list[BaseException | list[int]]:
        long = [collect(eng, f"s{i}", [i + 1] * 5, greedy(400)) for i in range(3)]
        tasks = [asyncio.ensure_future(c) for c in long]
        await asyncio.sleep(0.05)
        await asyncio.to_thread(eng.shutdown)
        return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)

    results = asyncio.run(main())
    ended = [r for r in results if isinstance(r, EngineDeadError)]
    finished = [r for r in results if isinstance(r, list)]
    assert len(ended) + len(finished) == 3 and ended  # none hangs; the open ones got an error
    assert not eng.alive


def test_a_request_sent_as_the_core_dies_is_answered() -> None:
    """An add still queued when the loop dies gets the error too (the caller would
    otherwise wait for ever)."""
    eng = client("thread")
    side = eng.link.side  # type: ignore[attr-defined]
    take = side.take

    def dying():  # type: ignore[no-untyped-def]
        for message in take():
            raise RuntimeError(f"the loop dies with {type(message).__name__} still queued")
        return
        yield

    side.take = dying

    async def main() -> None:
        await asyncio.wait_for(collect(eng, "late", [1, 2, 3], greedy(4)), 10)

    with pytest.raises(EngineDeadError, match="still queued"):
        asyncio.run(main())
    eng.shutdown()


def test_a_bug_while_adding_fails_that_request_only(monkeypatch) -> None:
    eng = client("thread")
    inner = eng.link.shared().engine
    add = inner.add

    def failing(request_id, request):  # type: ignore[no-untyped-def]
        ids = add(request_id, request)
        if request_id == "bad":
            raise KeyError("a bug")
        return ids

    monkeypatch.setattr(inner, "add", failing)

    async def main() -> tuple[BaseException | list[int], list[int]]:
        bad, good = await asyncio.gather(
            collect(eng, "bad", [1, 2, 3], greedy(4, n=2)),
            collect(eng, "good", [4, 5, 6], greedy(4)),
            return_exceptions=True,
        )
        return bad, good

    try:
        bad, good = asyncio.run(main())
        assert isinstance(bad, RequestFailed) and "KeyError" in str(bad) and len(good) == 4
        assert eng.alive and settled(eng) and not inner.requests  # half-added siblings gone
    finally:
        eng.shutdown()


def test_in_a_thread_every_torch_op_runs_on_the_core_thread() -> None:
    """The in-thread core builds and steps on its one thread (docs/decisions.md)."""
    eng = client("thread")
    inner = eng.link.shared().engine
    step, seen = inner.step, set()

    def recorded() -> list:
        seen.add(threading.current_thread().name)
        return step()

    inner.step = recorded  # type: ignore[method-assign]
    try:
        assert len(asyncio.run(collect(eng, "t", [1, 2, 3], greedy(4)))) == 4
    finally:
        eng.shutdown()
    assert seen == {"kvserve-engine"}
