"""Backpressure (429 + Retry-After) and graceful SIGTERM (503, finish, exit 0)."""

import asyncio
import json
import signal
import time

import httpx
import pytest

from tests.factories import ENGINE_MODES, start_server


def test_queue_cap_answers_429_and_admitted_requests_complete(tmp_path) -> None:
    server = start_server(str(tmp_path), "--max-num-seqs", "2", "--max-queue", "3")
    try:

        async def one(client: httpx.AsyncClient, i: int) -> httpx.Response:
            body = {
                "prompt": f"request {i}",
                "max_tokens": 40,
                "temperature": 0,
                "ignore_eos": True,
            }
            return await client.post("/v1/completions", json=body)

        async def main() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
                return await asyncio.gather(*(one(client, i) for i in range(12)))

        responses = asyncio.run(main())
        ok = [r for r in responses if r.status_code == 200]
        rejected = [r for r in responses if r.status_code == 429]
        assert len(ok) + len(rejected) == 12
        assert len(ok) == 5  # 2 running + 3 waiting
        for r in rejected:
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
        assert all(r.json()["usage"]["completion_tokens"] == 40 for r in ok)
        assert server.wait_idle()["kv_cache"]["blocks_used"] == 0
    finally:
        server.stop()


DRAIN_S = 30.0  # the server's --shutdown-timeout here


def stream_tokens(client: httpx.Client, max_tokens: int, on_event=lambda n: None) -> tuple:
    """A greedy stream of max_tokens: its tokens (usage), finish reason and last line;
    on_event(events so far) is called after each event."""
    body = {"prompt": "long", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    tokens, reason, last, events = 0, None, "", 0
    with client.stream("POST", "/v1/completions", json=body) as resp:
        for line in resp.iter_lines():
            last = line or last
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            elif event["choices"]:
                reason = event["choices"][0]["finish_reason"] or reason
                events += 1
                on_event(events)
    return tokens, reason, last


@pytest.mark.parametrize("mode", list(ENGINE_MODES))
def test_sigterm_drains_then_exits_zero(tmp_path, mode: str) -> None:
    """An in-flight stream finishes in full after SIGTERM while new requests get 503.
    Its length comes from this machine's measured pace, a quarter of the drain's time,
    so a loaded machine still drains it in time."""
    server = start_server(str(tmp_path), "--engine-process", ENGINE_MODES[mode],
                          "--shutdown-timeout", str(DRAIN_S))  # fmt: skip

    def terminate(events: int) -> None:
        if events != 2:
            return
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        late = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1},
                          timeout=10)  # fmt: skip
        assert late.status_code == 503
        assert httpx.get(server.url + "/health", timeout=10).status_code == 503

    with httpx.Client(base_url=server.url, timeout=60) as client:
        start = time.perf_counter()
        stream_tokens(client, 20)
        pace = (time.perf_counter() - start) / 20
        max_tokens = max(20, min(300, int(DRAIN_S / 4 / pace)))
        tokens, reason, last = stream_tokens(client, max_tokens, terminate)
    assert server.proc.wait(DRAIN_S + 10) == 0
    assert last == "data: [DONE]"
    assert (tokens, reason) == (max_tokens, "length")  # the in-flight stream finished in full


def test_bad_model_directory_exits_non_zero(tmp_path) -> None:
    server = start_server(str(tmp_path), "--model", str(tmp_path / "missing"), wait=False)
    assert server.proc.wait(60) != 0
    with open(server.log_path) as f:
        assert "model directory not found" in f.read()
