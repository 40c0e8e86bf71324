"""Overload: five times more concurrent requests than the waiting-queue cap."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.factories import ENGINE_MODES, Server
from tests.reliability.conftest import Row, harness

pytestmark = pytest.mark.reliability  # make test-fast leaves these out

MAX_SEQS, MAX_QUEUE = 4, 16
BURST = 5 * MAX_QUEUE


@pytest.fixture(scope="module", params=list(ENGINE_MODES))
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    srv = harness(
        tmp_path_factory.mktemp("overload"),
        "--max-num-seqs",
        str(MAX_SEQS),
        "--max-queue",
        str(MAX_QUEUE),
        mode=request.param,
    )
    srv.mode = request.param
    yield srv
    srv.stop()


def probe_latency(server: Server) -> tuple[float, str]:
    """Median of three lone 16-token requests, and their (greedy) text."""
    times, text = [], ""
    body = {"prompt": "A probe", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    for _ in range(3):
        t0 = time.perf_counter()
        resp = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        times.append(time.perf_counter() - t0)
        assert resp.status_code == 200, resp.text
        text = resp.json()["choices"][0]["text"]
    return statistics.median(times), text


def test_overload_sheds_excess_with_429(server: Server, row: Row) -> None:
    """Overload burst"""
    before_s, before_text = probe_latency(server)
    rss_before = httpx.get(server.url + "/debug/state", timeout=10).json()["rss_bytes"]
    samples: list[dict] = []

    async def burst() -> list[tuple[int, float, str | None]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            done = asyncio.Event()

            async def sample() -> None:
                while not done.is_set():
                    samples.append((await client.get("/debug/state")).json())
                    await asyncio.sleep(0.05)

            async def one(i: int) -> tuple[int, float, str | None]:
                body = {
                    "prompt": f"Request {i} of the burst",
                    "max_tokens": 32,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                resp = await client.post("/v1/completions", json=body)
                end = time.perf_counter()
                if resp.status_code == 429:
                    assert resp.headers["retry-after"] == "1"
                    assert resp.json()["error"]["code"] == "queue_full"
                    return 429, end, None
                assert resp.status_code == 200, resp.text
                return 200, end, resp.json()["choices"][0]["text"]

            sampler = asyncio.ensure_future(sample())
            start = time.perf_counter()
            results = await asyncio.gather(*(one(i) for i in range(BURST)))
            done.set()
            await sampler
            return [(s, end - start, text) for s, end, text in results]

    results = asyncio.run(burst())
    after = server.wait_idle(timeout=30)
    after_s, after_text = probe_latency(server)
    rss_after = httpx.get(server.url + "/debug/state", timeout=10).json()["rss_bytes"]

    ok = [r for r in results if r[0] == 200]
    shed = [r for r in results if r[0] == 429]
    first_ok = min(t for _, t, _ in ok)
    max_waiting = max(s["waiting"] for s in samples)
    max_rss = max(s["rss_bytes"] for s in samples)
    row.load = (
        f"{BURST} concurrent requests (32 tokens each) against --max-num-seqs {MAX_SEQS} "
        f"--max-queue {MAX_QUEUE}"
    )
    row.load += f", {server.mode}"
    row.add(
        f"{len(ok)} completed, {len(shed)} got 429 + Retry-After; slowest 429 after "
        f"{max(t for _, t, _ in shed) * 1000:.0f} ms, first completion after {first_ok * 1000:.0f} ms"
    )
    row.add(f"engine waiting queue peaked at {max_waiting} (cap {MAX_QUEUE})")
    row.add(
        f"RSS {rss_before / 2**20:.0f} MiB before, peak {max_rss / 2**20:.0f}, "
        f"after {rss_after / 2**20:.0f}"
    )
    row.add(
        f"lone 16-token request: {before_s * 1000:.0f} ms before, {after_s * 1000:.0f} ms after"
    )

    assert len(ok) + len(shed) == BURST
    assert len(ok) >= MAX_SEQS + MAX_QUEUE and len(shed) >= BURST - 2 * (MAX_SEQS + MAX_QUEUE)
    assert all(text for _, _, text in ok)
    # shedding is immediate: every 429 was answered before the first admitted request ended
    assert max(t for _, t, _ in shed) < first_ok
    assert max_waiting <= MAX_QUEUE
    assert after["kv_cache"]["blocks_used"] == 0 and after["waiting"] == 0
    assert after_text == before_text
    assert after_s < 2 * before_s + 0.1  # back to normal latency once the burst is over
