"""`kvserve serve --async-scheduling on` (the default on CUDA, forced here on the CPU): the
same answers over HTTP as the server that reads every step, with streams, n > 1, stop
strings, logprobs and penalties (which async scheduling keeps on the device) in one
batch; streams that leave mid-way free their blocks."""

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from tests.api.test_disconnect import aborted, stream
from tests.factories import Server, start_server


@pytest.fixture(scope="module")
def async_server(tmp_path_factory: pytest.TempPathFactory):
    srv = start_server(
        str(tmp_path_factory.mktemp("async")), "--max-num-seqs", "32", "--async-scheduling", "on"
    )
    yield srv
    srv.stop()


BODIES = [
    *({"prompt": f"Stream {i} tells a story", "max_tokens": 30 + i, "temperature": 0,
       "ignore_eos": True, "stream": True} for i in range(8)),
    {"prompt": "Two sampled answers", "max_tokens": 24, "temperature": 0.9, "seed": 11, "n": 2,
     "ignore_eos": True},
    {"prompt": "Stop somewhere", "max_tokens": 40, "temperature": 1.0, "seed": 5,
     "stop": ["a", "e", "i", "o", "u"]},
    {"prompt": "With logprobs", "max_tokens": 12, "temperature": 0, "logprobs": 2,
     "ignore_eos": True},
    {"prompt": "Penalised", "max_tokens": 20, "temperature": 0, "frequency_penalty": 1.5,
     "presence_penalty": 0.5, "repetition_penalty": 1.2, "logprobs": 1, "ignore_eos": True},
]  # fmt: skip


async def answer(client: httpx.AsyncClient, body: dict) -> list:
    """Every choice's text (and logprobs), streamed or not."""
    if not body.get("stream"):
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return [(c["text"], c["logprobs"], c["finish_reason"]) for c in r.json()["choices"]]
    text, reason = "", None
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text, reason = text + choice["text"], choice["finish_reason"] or reason
    return [(text, None, reason)]


def answers(server: Server) -> list:
    async def main() -> list:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            return await asyncio.gather(*(answer(client, b) for b in BODIES))

    return asyncio.run(main())


def test_async_server_answers_as_the_reading_one(server: Server, async_server: Server) -> None:
    card = httpx.get(async_server.url + "/v1/models/kvserve-demo-random", timeout=10).json()
    assert card["memory"]["async_scheduling"] is True
    plain = httpx.get(server.url + "/v1/models/kvserve-demo-random", timeout=10).json()
    assert plain["memory"]["async_scheduling"] is False  # the CPU's default
    got, want = answers(async_server), answers(server)
    assert got == want
    assert {reason for choices in got for _, _, reason in choices} == {"length", "stop"}
    assert "async scheduling on" in Path(async_server.log_path).read_text()


def test_async_server_frees_dropped_streams(async_server: Server) -> None:
    idle = async_server.wait_idle()["kv_cache"]["blocks_used"]
    aborts = aborted(async_server)
    prompts = [f"Request number {i} asks for a long answer" for i in range(12)]

    async def main() -> list:
        async with httpx.AsyncClient(base_url=async_server.url, timeout=120) as client:
            jobs = [
                stream(client, p, 80, drop_after=(3 + i if i % 2 else None))
                for i, p in enumerate(prompts)
            ]
            return await asyncio.gather(*jobs)

    results = asyncio.run(main())
    assert results[1::2] == [None] * 6 and all(results[::2])
    after = async_server.wait_idle()
    assert after["kv_cache"]["blocks_used"] == idle
    assert after["running"] == 0 and after["waiting"] == 0
    assert aborted(async_server) - aborts == 6
