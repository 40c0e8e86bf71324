"""Engine faults: non-finite logits fail one request only; a dead engine loop, or a killed
engine process (--engine-process on), turns /health 503 at once and ends the server with
a non-zero status; a killed front takes its engine process with it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.reliability.conftest import Row, engine_process, harness

pytestmark = pytest.mark.reliability  # make test-fast leaves these out

POISON, FATAL = 77777, 88888  # token ids the fault injection reacts to


async def complete(
    client: httpx.AsyncClient, prompt: list[int] | str, stream: bool, max_tokens: int = 40
) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if not stream:
        resp = await client.post("/v1/completions", json=body)
        return {"status": resp.status_code, "body": resp.json()}
    text, error = "", None
    async with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]
                else:
                    text += event["choices"][0]["text"]
    return {"status": resp.status_code, "text": text, "error": error}


def test_non_finite_logits_fail_only_that_request(tmp_path, row: Row, mode: str) -> None:
    """Non-finite logits in one request"""
    server = harness(tmp_path, fault=f"nan-token:{POISON}", mode=mode)
    try:
        prompts = [f"Healthy request {i} goes on" for i in range(8)]

        async def main() -> tuple[list[dict], list[dict], list[dict]]:
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
                busy = await asyncio.gather(
                    *(complete(client, p, stream=True) for p in prompts),
                    complete(client, [100, POISON, 200], stream=False),
                    complete(client, [300, POISON], stream=True),
                )
                quiet = [await complete(client, p, stream=True) for p in prompts]
                again = [await complete(client, [POISON], stream=False)]
                return list(busy), quiet, again

        busy, quiet, again = asyncio.run(main())
        health = server.wait_idle()
    finally:
        server.stop()
    healthy, bad_plain, bad_stream = busy[:8], busy[8], busy[9]
    row.load = "8 streaming requests with 2 poisoned ones (NaN embedding) in the same batch"
    row.add(
        f"poisoned: {bad_plain['status']} `{bad_plain['body']['error']['message']}`; "
        f"streamed: error event `{(bad_stream['error'] or {}).get('message')}`"
    )
    same = sum(a["text"] == b["text"] for a, b in zip(healthy, quiet))
    row.add(f"{same}/8 others complete, equal to a quiet run; /health {health['status']} after")
    assert bad_plain["status"] == 500 and "non-finite" in bad_plain["body"]["error"]["message"]
    assert bad_stream["error"] is not None and "non-finite" in bad_stream["error"]["message"]
    assert again[0]["status"] == 500  # and again, alone: the server is not wedged
    assert all(r["status"] == 200 and r["error"] is None and r["text"] for r in healthy), healthy
    assert same == 8
    assert health["status"] == "ok" and health["kv_cache"]["blocks_used"] == 0


async def health_turns(client: httpx.AsyncClient, t0: float) -> tuple[float | None, list[int]]:
    """Poll /health for up to 5 s from t0: when it stopped answering 200 (seconds after t0,
    None: it never did) and every status seen (0: the process had gone)."""
    statuses: list[int] = []
    while time.perf_counter() - t0 < 5:
        try:
            statuses.append((await client.get("/health", timeout=1)).status_code)
        except httpx.TransportError:
            statuses.append(0)
        if statuses[-1] != 200:
            return time.perf_counter() - t0, statuses
        await asyncio.sleep(0.02)
    return None, statuses


def test_engine_death_fails_health_and_exits_non_zero(tmp_path, row: Row, mode: str) -> None:
    """Engine loop dies"""
    server = harness(tmp_path, fault=f"die-on-token:{FATAL}", mode=mode)
    try:

        async def main() -> tuple[dict, float | None, list[int]]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                inflight = asyncio.ensure_future(complete(client, "A long answer", True, 3000))
                await asyncio.sleep(0.3)  # it is decoding
                t0 = time.perf_counter()
                trigger = asyncio.ensure_future(complete(client, [FATAL], stream=False))
                turned, statuses = await health_turns(client, t0)
                await asyncio.gather(trigger, return_exceptions=True)
                result = await inflight
                return result, turned, statuses

        inflight, turned, statuses = asyncio.run(main())
        code = server.proc.wait(30)
    finally:
        server.stop()
    with open(server.log_path) as f:
        log = f.read()
    row.load = "a request whose prompt kills the engine loop, while another streams"
    row.add(
        f"/health turned {statuses[-1]} {turned * 1000:.0f} ms after the fatal request"
        if turned is not None
        else "/health never turned"
    )
    row.add(
        f"the in-flight stream ended with an error event: "
        f"`{(inflight['error'] or {}).get('message', '')[:80]}`; process exit status {code}"
    )
    assert turned is not None and turned < 1.0 and statuses[-1] == 503
    assert inflight["error"] is not None
    assert code not in (0, None)
    assert "engine loop died" in log


ADD_BUG, UPDATE_BUG = 77771, 77772


def test_exceptions_inside_the_engine_fail_only_their_request(
    tmp_path, row: Row, mode: str
) -> None:
    """Engine exceptions in add, update and the metrics observer"""
    server = harness(
        tmp_path,
        fault=f"raise-in-add:{ADD_BUG},raise-in-update:{UPDATE_BUG},raise-in-observer:0",
        mode=mode,
    )
    try:
        prompts = [f"Healthy request {i} goes on" for i in range(8)]

        async def main() -> tuple[list[dict], list[dict], int]:
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
                busy = await asyncio.gather(
                    *(complete(client, p, stream=True) for p in prompts),
                    complete(client, [100, ADD_BUG, 200], stream=False),
                    complete(client, [300, ADD_BUG], stream=True),
                    complete(client, [100, UPDATE_BUG, 200], stream=False),
                    complete(client, [300, UPDATE_BUG], stream=True),
                )
                quiet = [await complete(client, p, stream=True) for p in prompts]
                metrics = (await client.get("/metrics")).status_code
                return list(busy), quiet, metrics

        busy, quiet, metrics = asyncio.run(main())
        health = server.wait_idle()
    finally:
        server.stop()
    with open(server.log_path) as f:
        log = f.read()
    healthy, faulty = busy[:8], busy[8:]
    row.load = (
        "8 streaming requests beside 4 that raise inside the engine (in add_request and while "
        "taking a token, plain and streamed); the metrics observer raises on every step"
    )
    row.add(
        "faulty: "
        + "; ".join(
            f"{r['status']} `{(r.get('body', {}).get('error') or r.get('error') or {}).get('message', '')[:60]}`"
            for r in faulty
        )
    )
    same = sum(a["text"] == b["text"] for a, b in zip(healthy, quiet))
    row.add(
        f"{same}/8 others complete, equal to a quiet run; /health {health['status']}, /metrics {metrics}"
    )
    assert all(r["status"] == 200 and r["error"] is None and r["text"] for r in healthy), healthy
    assert same == 8
    for r in (faulty[0], faulty[2]):  # plain: 500 in OpenAI's shape
        assert r["status"] == 500 and r["body"]["error"]["type"] == "server_error"
        assert "internal error: RuntimeError" in r["body"]["error"]["message"]
    for r in (faulty[1], faulty[3]):  # streamed: the error inside the stream
        assert r["error"] is not None and "internal error" in r["error"]["message"]
    assert health["status"] == "ok" and health["kv_cache"]["blocks_used"] == 0
    assert metrics == 200
    assert "failed to start" in log and "failed in the engine" in log  # with request ids
    assert "metrics observer failed" in log


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_engine_process_killed_fails_health_and_exits_non_zero(tmp_path, row: Row) -> None:
    """Engine process killed (kill -9)"""
    server = harness(tmp_path, mode="engine-process")
    try:
        engine = engine_process(server.proc.pid)

        async def main() -> tuple[dict, float | None, list[int]]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                inflight = asyncio.ensure_future(complete(client, "A long answer", True, 3000))
                await asyncio.sleep(0.5)  # it is decoding
                t0 = time.perf_counter()
                os.kill(engine, signal.SIGKILL)
                turned, statuses = await health_turns(client, t0)
                return await inflight, turned, statuses

        inflight, turned, statuses = asyncio.run(main())
        code = server.proc.wait(30)
    finally:
        server.stop()
    row.load = "kill -9 of the engine core process (--engine-process on) while a request streams"
    row.add(
        f"/health turned {statuses[-1]} {turned * 1000:.0f} ms after the kill"
        if turned is not None
        else "/health never turned"
    )
    row.add(
        f"the in-flight stream ended with an error event: "
        f"`{(inflight['error'] or {}).get('message', '')[:80]}`; server exit status {code}"
    )
    assert turned is not None and turned < 1.0 and statuses[-1] in (503, 0)
    assert inflight["error"] is not None and "engine" in inflight["error"]["message"]
    assert code not in (0, None)


def test_front_process_killed_takes_the_engine_process_with_it(tmp_path, row: Row) -> None:
    """Engine process outliving its front"""
    server = harness(tmp_path, mode="engine-process")
    try:
        engine = engine_process(server.proc.pid)
        assert alive(engine)
        t0 = time.perf_counter()
        server.proc.kill()  # kill -9 of the front: nothing tells the engine
        server.proc.wait(10)
        while alive(engine) and time.perf_counter() - t0 < 10:
            time.sleep(0.05)
        gone = time.perf_counter() - t0
    finally:
        server.stop()
    row.load = "kill -9 of the server's front process (--engine-process on)"
    row.add(f"the engine core process exited {gone * 1000:.0f} ms later, its memory freed")
    assert not alive(engine)
