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


async def stream_on(url: str, max_tokens: int) -> dict:
    """A stream on a fresh connection, and which front it is in (asked on the same
    connection first)."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        front = (await client.get("/health")).json()["front"]
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
        return {"front": front, "tokens": tokens, "error": error}


async def pinned(url: str) -> list[httpx.AsyncClient]:
    """A kept-alive connection to front 0 and one to front 1."""
    found: dict[int, httpx.AsyncClient] = {}
    for _ in range(10):
        clients = [httpx.AsyncClient(base_url=url, timeout=10) for _ in range(8)]
        answers = await asyncio.gather(*(c.get("/health") for c in clients))
        for client, answer in zip(clients, answers, strict=True):
            front = answer.json()["front"]
            if front in found:
                await client.aclose()
            else:
                found[front] = client
        if len(found) == 2:
            return [found[0], found[1]]
    raise AssertionError(f"every connection went to one front: {list(found)}")


def on_both(results: list[dict]) -> dict[int, list[dict]]:
    fronts: dict[int, list[dict]] = {}
    for r in results:
        fronts.setdefault(r["front"], []).append(r)
    assert sorted(fronts) == [0, 1], f"every stream went to one front: {list(fronts)}"
    return fronts


def streams_then(server: Server, max_tokens: int, act: Callable[[], object]) -> list:
    """8 streams through the fronts; once they decode, act(); what each came to (the
    exception where its connection was cut)."""

    async def main() -> list:
        streams = [asyncio.ensure_future(stream_on(server.url, max_tokens)) for _ in range(8)]
        await asyncio.sleep(1.0)
        act()
        return list(await asyncio.gather(*streams, return_exceptions=True))

    return asyncio.run(main())


def serve(tmp_path) -> Server:
    return start_server(str(tmp_path), "--api-server-count", "2")


def test_engine_killed_under_two_fronts(tmp_path, row: Row) -> None:
    """Engine process killed under two fronts"""
    server = serve(tmp_path)
    try:
        engine, _ = pids(server)

        async def main() -> tuple[list[dict], list[tuple[float | None, list[int]]]]:
            streams = [asyncio.ensure_future(stream_on(server.url, 3000)) for _ in range(8)]
            clients = await pinned(server.url)  # one connection to each front
            await asyncio.sleep(1.0)  # all decoding
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
    fronts = on_both(results)
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
        f"{len(fronts[1])} in front 1) ended with an error event; exit status {code}"
    )
    assert all(turned is not None and turned < 1.0 for turned, _ in turns)
    assert all(r["error"] and "engine" in r["error"] for r in results)
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
    fronts = on_both(results)
    row.load = "SIGTERM to the server while 8 requests stream through 2 fronts"
    done = sum(r["tokens"] == 300 and not r["error"] for r in results)
    row.add(
        f"{done} of {len(results)} streams ({len(fronts[0])} / {len(fronts[1])} per front) "
        f"finished all 300 tokens; exit status {code}; the engine process gone"
    )
    assert done == len(results)
    assert code == 0 and not alive(engine)
