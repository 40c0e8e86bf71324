"""Faults under `--api-server-count 2` (one engine process, two fronts on one port): the
engine killed ends every front's streams with an error and the server exits non-zero; a
front killed leaves the engine and the other front serving, its requests aborted in the
engine and the front replaced; SIGTERM drains every front, then stops the engine."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable

import httpx
import pytest

from tests.factories import Server, start_server
from tests.reliability.conftest import Row
from tests.reliability.test_faults import alive, health_turns

pytestmark = pytest.mark.reliability


def pids(server: Server) -> tuple[int, dict[int, int]]:
    """The engine's pid and each front's latest, from the supervisor's log."""
    engine, fronts = 0, {}
    with open(server.log_path) as log:
        for line in log:
            if not line.startswith("{"):
                continue
            entry = json.loads(line)
            if entry["msg"] == "engine process started":
                engine = entry["pid"]
            elif entry["msg"] == "front process started":
                fronts[entry["front"]] = entry["pid"]
    return engine, fronts


async def on_front(url: str, front: int, timeout: float) -> httpx.AsyncClient:
    """A fresh connection that the kernel gave to `front` (each new connection lands on
    a front by its addresses' hash: new ones until one lands there)."""
    for _ in range(200):
        client = httpx.AsyncClient(base_url=url, timeout=timeout)
        if (await client.get("/health")).json()["front"] == front:
            return client
        await client.aclose()
    raise AssertionError(f"no connection landed on front {front}")


async def stream_on(url: str, max_tokens: int, front: int) -> dict:
    """A stream through `front`, on a connection of its own."""
    client = await on_front(url, front, 120)
    try:
        body = {"prompt": "A long answer", "max_tokens": max_tokens, "ignore_eos": True}
        body["stream_options"] = {"include_usage": True}
        tokens, error = 0, None
        async with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if "error" in event:
                        error = event["error"]["message"]
                    elif event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
    finally:
        await client.aclose()
    return {"front": front, "tokens": tokens, "error": error}


async def eight_streams(url: str, max_tokens: int) -> list[asyncio.Future]:
    """Four streams through each front, returned once the engine runs all eight."""
    streams = [asyncio.ensure_future(stream_on(url, max_tokens, i % 2)) for i in range(8)]
    deadline = time.monotonic() + 60
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        while (await client.get("/health")).json()["running"] < 8:
            assert time.monotonic() < deadline, "the eight streams did not all start"
            await asyncio.sleep(0.05)
    return streams


def by_front(results: list[dict]) -> dict[int, list[dict]]:
    fronts: dict[int, list[dict]] = {}
    for r in results:
        fronts.setdefault(r["front"], []).append(r)
    return fronts


def streams_then(server: Server, max_tokens: int, act: Callable[[], object]) -> list:
    """8 streams through the fronts; once they decode, act(); what each came to (the
    exception where its connection was cut)."""

    async def main() -> list:
        streams = await eight_streams(server.url, max_tokens)
        act()
        return list(await asyncio.gather(*streams, return_exceptions=True))

    return asyncio.run(main())


def serve(tmp_path) -> Server:
    return start_server(str(tmp_path), "--api-server-count", "2").wait_fronts(2)


def test_engine_killed_under_two_fronts(tmp_path, row: Row) -> None:
    """Engine process killed under two fronts"""
    server = serve(tmp_path)
    try:
        engine, _ = pids(server)

        async def main() -> tuple[list[dict], list[tuple[float | None, list[int]]]]:
            streams = await eight_streams(server.url, 3000)
            clients = [await on_front(server.url, i, 10) for i in (0, 1)]
            t0 = time.perf_counter()
            os.kill(engine, signal.SIGKILL)
            turns = await asyncio.gather(*(health_turns(c, t0) for c in clients))
            for c in clients:
                await c.aclose()
            return list(await asyncio.gather(*streams)), list(turns)

        results, turns = asyncio.run(main())
        code = server.proc.wait(30)
    finally:
        server.stop()
    fronts = by_front(results)
    row.load = "kill -9 of the engine process while 8 requests stream through 2 fronts"
    row.add(
        "/health turned "
        + " and ".join(
            f"{statuses[-1]} on front {i} {turned * 1000:.0f} ms"
            if turned is not None
            else f"never on front {i}"
            for i, (turned, statuses) in enumerate(turns)
        )
        + " after the kill"
    )
    errors = sum(r["error"] is not None for r in results)
    row.add(
        f"{errors} of {len(results)} streams ({len(fronts[0])} in front 0, "
        f"{len(fronts[1])} in front 1) ended with an error event "
        f"(`{results[0]['error']}`); exit status {code}"
    )
    assert all(turned is not None and turned < 1.0 for turned, _ in turns)
    # the supervisor knows how the engine ended, and tells every front
    assert all(r["error"] and "killed by SIGKILL" in r["error"] for r in results)
    assert code not in (0, None)


def test_a_front_killed_leaves_the_engine_and_the_other_front_serving(tmp_path, row: Row) -> None:
    """A front process killed (two fronts)"""
    server = serve(tmp_path)
    try:
        engine, front_pids = pids(server)

        t0 = time.perf_counter()
        results = streams_then(server, 400, lambda: os.kill(front_pids[0], signal.SIGKILL))
        survived = [r for r in results if isinstance(r, dict)]
        idle = server.wait_idle(timeout=30)  # the killed front's requests were aborted
        back = None
        while back is None and time.perf_counter() - t0 < 60:
            with httpx.Client(base_url=server.url, timeout=10) as client:
                if client.get("/health").json().get("front") == 0:
                    back = time.perf_counter() - t0
            time.sleep(0.2)
        _, replaced = pids(server)
        engine_alive = alive(engine)
        code = server.stop()
    finally:
        server.stop()
    row.load = "kill -9 of one of 2 fronts while 8 requests stream through both"
    cut = len(results) - len(survived)
    row.add(
        f"front 1's {len(survived)} streams finished all 400 tokens; front 0's {cut} "
        f"connections dropped; the engine's KV back to {idle['kv_cache']['blocks_used']} blocks"
    )
    row.add(
        f"front 0 replaced (pid {front_pids[0]} -> {replaced[0]}), answering again after "
        f"{back:.1f} s; the engine process stayed up; SIGTERM then exit status {code}"
        if back is not None
        else "front 0 never answered again"
    )
    assert survived and cut, "the streams did not go through both fronts"
    assert all(r["front"] == 1 and r["tokens"] == 400 and not r["error"] for r in survived), (
        survived
    )
    assert idle["running"] == 0 and idle["kv_cache"]["blocks_used"] == 0
    assert back is not None and replaced[0] != front_pids[0]
    assert engine_alive and code == 0


def test_sigterm_drains_every_front_then_the_engine(tmp_path, row: Row) -> None:
    """SIGTERM drain through two fronts"""
    server = serve(tmp_path)
    try:
        engine, _ = pids(server)

        results = streams_then(server, 300, lambda: server.proc.send_signal(signal.SIGTERM))
        code = server.proc.wait(60)
        t0 = time.perf_counter()
        while alive(engine) and time.perf_counter() - t0 < 10:
            time.sleep(0.05)
    finally:
        server.stop()
    fronts = by_front(results)
    row.load = "SIGTERM to the server while 8 requests stream through 2 fronts"
    done = sum(r["tokens"] == 300 and not r["error"] for r in results)
    row.add(
        f"{done} of {len(results)} streams ({len(fronts[0])} / {len(fronts[1])} per front) "
        f"finished all 300 tokens; exit status {code}; the engine process gone"
    )
    assert done == len(results)
    assert code == 0 and not alive(engine)
