"""Disconnect storm: 300 streams at concurrency 32, a third dropped at random moments."""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from tests.factories import ENGINE_MODES, Server
from tests.reliability.conftest import Row, harness

pytestmark = pytest.mark.reliability  # make test-fast leaves these out

REQUESTS, CONCURRENCY, MAX_TOKENS = 300, 32, 24
DROPS = ["keep", "during-prefill", "before-first-token", "mid-stream"]


@pytest.fixture(scope="module", params=list(ENGINE_MODES))
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    # a small step budget spreads the longer prompts' prefill over several steps
    srv = harness(
        tmp_path_factory.mktemp("storm"),
        "--max-num-seqs",
        "32",
        "--max-num-batched-tokens",
        "256",
        mode=request.param,
    )
    srv.mode = request.param
    yield srv
    srv.stop()


def finished_by_reason(server: Server) -> Counter[str]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    found = re.findall(
        r'^kvserve_requests_finished_total\{.*?finish_reason="(\w+)".*?\} (\S+)$', text, re.M
    )
    return Counter({reason: int(float(v)) for reason, v in found})


async def one(
    client: httpx.AsyncClient, prompt: list[int], plan: tuple[str, float]
) -> tuple[str, str | None]:
    """Stream one completion; drop it as `plan` says. Returns (what happened, text)."""
    mode, at = plan
    body = {
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }

    async def read() -> tuple[str, str | None]:
        text, events = "", 0
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200, await resp.aread()
            if mode == "before-first-token":
                return mode, None  # headers are in; no token read yet
            async for line in resp.aiter_lines():
                if line == "data: [DONE]":
                    return "completed", text
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    text += chunk["choices"][0]["text"]
                    events += 1
                    if mode == "mid-stream" and events >= at:
                        return mode, None
        return "truncated", text

    if mode == "during-prefill":  # cancel after a random delay, usually before any token
        try:
            return await asyncio.wait_for(read(), timeout=at)
        except TimeoutError:
            return mode, None
    return await read()


def test_disconnect_storm_leaks_nothing(server: Server, row: Row) -> None:
    """Disconnect storm"""
    rng = random.Random(1234)
    prompts = [
        [rng.randrange(1000, 100000) for _ in range(rng.choice([8, 40, 150, 400]))]
        for _ in range(REQUESTS)
    ]
    plans: list[tuple[str, float]] = []
    for _ in range(REQUESTS):
        kind = rng.choices(DROPS, weights=[6, 1, 1, 1])[0]  # a third dropped, three ways
        at = rng.uniform(0.005, 0.08) if kind == "during-prefill" else rng.randrange(1, MAX_TOKENS)
        plans.append((kind, at))
    idle = server.wait_idle()["kv_cache"]["blocks_used"]
    aborts_before = finished_by_reason(server)["abort"]

    async def storm() -> list[tuple[str, str | None]]:
        sem = asyncio.Semaphore(CONCURRENCY)
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:

            async def guarded(i: int) -> tuple[str, str | None]:
                async with sem:
                    return await one(client, prompts[i], plans[i])

            return await asyncio.gather(*(guarded(i) for i in range(REQUESTS)))

    async def quiet(indices: list[int]) -> list[str]:
        sem = asyncio.Semaphore(CONCURRENCY)
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:

            async def plain(i: int) -> str:
                async with sem:
                    body = {
                        "prompt": prompts[i],
                        "max_tokens": MAX_TOKENS,
                        "temperature": 0,
                        "ignore_eos": True,
                    }
                    resp = await client.post("/v1/completions", json=body)
                    assert resp.status_code == 200, resp.text
                    return resp.json()["choices"][0]["text"]

            return await asyncio.gather(*(plain(i) for i in indices))

    results = asyncio.run(storm())
    after = server.wait_idle(timeout=30)
    state = httpx.get(server.url + "/debug/state", timeout=10).json()
    aborted = finished_by_reason(server)["abort"] - aborts_before
    outcomes = Counter(kind for kind, _ in results)
    completed = [i for i, (kind, _) in enumerate(results) if kind == "completed"]
    again = asyncio.run(quiet(completed))
    same = sum(results[i][1] == text for i, text in zip(completed, again))

    dropped = REQUESTS - outcomes["completed"]
    row.load = f"{REQUESTS} streaming requests (8–400 prompt tokens, {MAX_TOKENS} out), concurrency {CONCURRENCY}"
    row.load += f", {server.mode}"
    row.add(
        "dropped "
        + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items()) if k != "completed")
        + f" ({dropped} in all); the server counted {aborted} aborts"
    )
    row.add(
        f"after: KV blocks used {after['kv_cache']['blocks_used']} (idle {idle}), "
        f"running {after['running']}, waiting {after['waiting']}, "
        f"engine requests {state['engine_requests']}"
    )
    row.add(f"{same}/{len(completed)} completed outputs equal a quiet run's (greedy)")

    assert outcomes["truncated"] == 0
    planned = Counter(kind for kind, _ in plans)
    assert 80 <= REQUESTS - planned["keep"] <= 130  # about a third, by plan
    # every planned drop happened, except "during prefill" ones that finished in time
    assert planned["before-first-token"] + planned["mid-stream"] <= dropped
    assert dropped <= REQUESTS - planned["keep"]
    assert after["kv_cache"]["blocks_used"] == idle
    assert (after["running"], after["waiting"]) == (0, 0)
    assert (state["engine_requests"], state["engine_streams"], state["inflight"]) == (0, 0, 0)
    assert same == len(completed)
    # every dropped request that reached the engine was aborted there, none finished unseen
    assert aborted <= dropped
