"""The async front: deltas stream, early exit aborts, failures stay local."""

import asyncio
import time

import pytest

from service.engine.async_engine import AsyncEngine, EngineDeadError
from service.engine.request import ParamError, SamplingParams
from tests.engine.helpers import greedy, make_engine, small_model

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
