"""The async front: deltas stream, early exit aborts, failures stay local."""

import asyncio
import time

import pytest

from service.engine.async_engine import AsyncEngine
from service.engine.request import ParamError, SamplingParams
from service.engine.streams import EngineDeadError
from tests.engine.helpers import greedy
from tests.factories import make_engine, small_model

MODEL = small_model()


@pytest.fixture
def engine():
    eng = AsyncEngine(lambda: make_engine(MODEL))
    eng.start()
    yield eng
    eng.shutdown()


async def collect(
    eng: AsyncEngine, rid: str, prompt: list[int], params: SamplingParams
) -> list[int]:
    tokens = []
    async for outs in eng.generate(rid, prompt, params):
        for o in outs:
            tokens.extend(o.token_ids)
    return tokens


def test_concurrent_requests_stream_and_match_the_sync_engine(engine: AsyncEngine) -> None:
    prompts = {f"r{i}": [i + 1] * (3 + i) for i in range(8)}

    async def main() -> dict[str, list[int]]:
        results = await asyncio.gather(
            *(collect(engine, rid, p, greedy(12)) for rid, p in prompts.items())
        )
        return dict(zip(prompts, results))

    got = asyncio.run(main())
    sync = make_engine(MODEL)
    for rid, p in prompts.items():
        sync.add_request(rid, p, greedy(12))
    ref: dict[str, list[int]] = {}
    while sync.has_unfinished():
        for o in sync.step():
            ref.setdefault(o.request_id, []).extend(o.token_ids)
    assert got == ref
    assert engine.healthy()


def test_leaving_early_aborts_and_frees_blocks(engine: AsyncEngine) -> None:
    async def main() -> None:
        seen = 0
        async for _ in engine.generate("a", list(range(40)), greedy(200)):
            seen += 1
            if seen == 3:
                break
        deadline = time.monotonic() + 5
        while engine.engine.blocks.num_used and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert engine.engine.blocks.num_used == 0 and not engine.engine.requests


def test_invalid_request_fails_alone(engine: AsyncEngine) -> None:
    async def main() -> tuple:
        ok = asyncio.create_task(collect(engine, "ok", [1, 2, 3], greedy(10)))
        with pytest.raises(ParamError):
            await collect(engine, "bad", [1, 10_000], greedy(3))
        return await ok

    assert len(asyncio.run(main())) == 10


def test_dead_loop_reports_unhealthy() -> None:
    def build():
        engine = make_engine(MODEL)

        def boom() -> list:
            raise RuntimeError("simulated engine fault")

        engine.step = boom  # the loop itself dies at its next step
        return engine

    eng = AsyncEngine(build)
    eng.start()

    async def main() -> None:
        with pytest.raises(EngineDeadError, match="simulated engine fault"):
            await collect(eng, "x", [1, 2], greedy(3))

    asyncio.run(main())
    assert not eng.healthy() and isinstance(eng.error, RuntimeError)
    eng.shutdown()


def test_build_failure_is_raised_by_start() -> None:
    def build():
        raise ValueError("cannot load this model")

    eng = AsyncEngine(build)
    with pytest.raises(ValueError, match="cannot load"):
        eng.start()
    assert not eng.alive


def test_shutdown_ends_every_open_stream() -> None:
    """Streams still generating when the engine shuts down end with an error instead of
    waiting for ever."""
    eng = AsyncEngine(lambda: make_engine(MODEL))
    eng.start()

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


def test_a_request_sent_as_the_loop_dies_is_answered() -> None:
    """An add still queued when the loop dies gets the error too (the caller would
    otherwise wait for ever)."""
    eng = AsyncEngine(lambda: make_engine(MODEL))
    eng.start()
    drain = eng._drain_commands

    def dying() -> None:
        if not eng._commands.empty():
            raise RuntimeError("the loop dies with a command still queued")
        drain()

    eng._drain_commands = dying  # type: ignore[method-assign]

    async def main() -> None:
        await asyncio.wait_for(collect(eng, "late", [1, 2, 3], greedy(4)), 10)

    with pytest.raises(EngineDeadError):
        asyncio.run(main())
    eng.shutdown()


def test_a_bug_while_adding_fails_that_request_only(monkeypatch) -> None:
    eng = AsyncEngine(lambda: make_engine(MODEL))
    eng.start()
    add = eng.engine.add_request

    def failing(request_id, prompt_ids, params):  # type: ignore[no-untyped-def]
        ids = add(request_id, prompt_ids, params)
        if request_id == "bad":
            raise KeyError("a bug")
        return ids

    monkeypatch.setattr(eng.engine, "add_request", failing)
    from service.engine.streams import RequestFailed

    async def main() -> tuple[BaseException | list[int], list[int]]:
        bad, good = await asyncio.gather(
            collect(eng, "bad", [1, 2, 3], greedy(4, n=2)),
            collect(eng, "good", [4, 5, 6], greedy(4)),
            return_exceptions=True,
        )
        return bad, good

    try:
        bad, good = asyncio.run(main())
        assert isinstance(bad, RequestFailed) and len(good) == 4
        assert eng.alive and not eng.engine.requests  # the half-added siblings are gone
    finally:
        eng.shutdown()


def test_call_runs_on_the_engine_thread_between_steps(engine: AsyncEngine) -> None:
    """What the API needs done with torch (measuring this machine's floors) runs on the
    engine thread, while requests stream; an error reaches the caller alone."""
    import threading

    def where() -> str:
        return threading.current_thread().name

    def boom() -> None:
        raise RuntimeError("measurement failed")

    async def main() -> tuple[str, list[int]]:
        stream = asyncio.ensure_future(collect(engine, "r", [1, 2, 3], greedy(20)))
        name = await engine.call(where)
        with pytest.raises(RuntimeError, match="measurement failed"):
            await engine.call(boom)
        return name, await stream

    name, tokens = asyncio.run(main())
    assert name == "kvserve-engine" and len(tokens) == 20 and engine.healthy()
    engine.shutdown()

    async def after() -> None:
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(engine.call(where), 5)

    asyncio.run(after())


def test_other_threads_read_the_snapshot_published_after_each_step(engine: AsyncEngine) -> None:
    """The metrics and /health read an immutable snapshot the engine thread publishes
    after every step, already current when a request's last delta arrives."""
    import dataclasses

    before = engine.snapshot()
    tokens = asyncio.run(collect(engine, "s", [1, 2, 3], greedy(5)))
    after = engine.snapshot()
    assert len(tokens) == 5 and after is not before
    with pytest.raises(dataclasses.FrozenInstanceError):
        after.running = 1  # type: ignore[misc]
    assert after.generation_tokens == before.generation_tokens + 5
    assert after.prompt_tokens == before.prompt_tokens + 3
    assert dict(after.finished)["length"] == dict(before.finished).get("length", 0) + 1
    assert after.running == after.waiting == after.kv_blocks_used == 0
