"""Clients that leave mid-stream free their KV blocks; the others finish intact."""

import asyncio
import contextlib
import json

import httpx

from tests.factories import Server


async def stream(
    client: httpx.AsyncClient, prompt: str, max_tokens: int, drop_after: int | None
) -> str | None:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    text, seen = "", 0
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            seen += 1
            text += json.loads(line[6:])["choices"][0]["text"]
            if drop_after is not None and seen >= drop_after:
                return None  # leaving the block closes the connection mid-stream
    return text


def aborted(server: Server) -> float:
    """kvserve_requests_finished_total{finish_reason="abort"} from /metrics."""
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("kvserve_requests_finished_total{") and 'finish_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no abort counter in /metrics")


def test_dropped_streams_release_blocks(server: Server) -> None:
    idle = server.wait_idle()["kv_cache"]["blocks_used"]
    aborts = aborted(server)
    prompts = [f"Request number {i} asks for a long answer" for i in range(20)]

    async def main() -> tuple[list, list]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            jobs = [
                stream(client, p, 120, drop_after=(3 + i if i % 2 else None))
                for i, p in enumerate(prompts)
            ]
            results = await asyncio.gather(*jobs)
            # the survivors, each alone on a quiet server, give the same greedy text
            alone = [await stream(client, p, 120, None) for p in prompts[::2]]
            return results, alone

    results, alone = asyncio.run(main())
    assert [r for r in results[1::2]] == [None] * 10
    assert results[::2] == alone
    assert all(len(t) > 0 for t in alone)
    after = server.wait_idle()
    assert after["kv_cache"]["blocks_used"] == idle
    assert after["running"] == 0 and after["waiting"] == 0
    assert aborted(server) - aborts == 10  # each dropped stream was aborted, not finished


def test_non_streaming_disconnect_aborts(server: Server) -> None:
    """The request is aborted when its client leaves: the abort counter moves and the
    blocks are back within a couple of seconds, long before 3,000 tokens could finish."""
    idle = server.wait_idle()["kv_cache"]["blocks_used"]
    aborts = aborted(server)
    body = {"prompt": "Take your time", "max_tokens": 3000, "temperature": 0, "ignore_eos": True}
    with contextlib.suppress(httpx.ReadTimeout):  # the client gives up; the server must abort
        httpx.post(server.url + "/v1/completions", json=body, timeout=1.0)
    after = server.wait_idle(timeout=2)
    assert after["kv_cache"]["blocks_used"] == idle and after["running"] == 0
    assert aborted(server) - aborts == 1
