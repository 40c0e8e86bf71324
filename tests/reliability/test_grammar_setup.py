"""Grammar set-up beside a stream: requests whose regex is large (6,000 alternatives,
66k characters) arrive while another request streams. Their grammars compile and their
matchers are built off the engine's step (in a worker thread of the front, and with
--engine-process on of the engine process too; llguidance releases the GIL while it
works), so the neighbour's tokens keep coming; the table reports the neighbour's worst
gap with and without them, in both engine modes."""

from __future__ import annotations

import asyncio
import json
import random
import re
import string
import time

import httpx
import pytest

from tests.factories import ENGINE_MODES
from tests.reliability.conftest import Row, harness

pytestmark = pytest.mark.reliability  # make test-fast leaves these out

HEAVY, ALTERNATIVES = 4, 6000


def big_regex(rng: random.Random) -> tuple[str, list[str]]:
    words = ["".join(rng.choices(string.ascii_lowercase, k=10)) for _ in range(ALTERNATIVES)]
    return "(" + "|".join(words) + ")", words


async def neighbour(client: httpx.AsyncClient, gaps: list[tuple[float, float]]) -> int:
    """A greedy stream of 400 tokens; each event's arrival (time, gap since the last; an
    event carries every token that was ready when the front got to the stream); the
    tokens it carried in all (its usage)."""
    body = {"prompt": "The", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    body["stream_options"] = {"include_usage": True}
    tokens, last = 0, None
    async with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.monotonic()
            if last is not None:
                gaps.append((now, now - last))
            last = now
            if usage := json.loads(line[6:]).get("usage"):
                tokens = usage["completion_tokens"]
    return tokens


async def constrained(client: httpx.AsyncClient, regex: str) -> dict:
    body = {"prompt": "Say one word:", "max_tokens": 24, "temperature": 0.8, "seed": 1}
    resp = await client.post(
        "/v1/completions", json=body | {"structured_outputs": {"regex": regex}}
    )
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def worst(gaps: list[tuple[float, float]], start: float, end: float) -> float:
    return max((g for t, g in gaps if start <= t <= end), default=0.0)


@pytest.mark.parametrize("mode", list(ENGINE_MODES))
def test_grammar_setup_beside_a_stream(tmp_path, row: Row, mode: str) -> None:
    """Grammar set-up beside a stream"""
    rng = random.Random(0)
    regexes = [big_regex(rng) for _ in range(HEAVY)]
    server = harness(tmp_path, mode=mode)

    async def run() -> tuple[list, str, list[dict], float, float]:
        gaps: list[tuple[float, float]] = []
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            stream = asyncio.create_task(neighbour(client, gaps))
            while len(gaps) < 40:  # the neighbour is decoding steadily
                await asyncio.sleep(0.01)
            start = time.monotonic()
            answers = await asyncio.gather(*(constrained(client, r) for r, _ in regexes))
            end = time.monotonic()
            return gaps, await stream, answers, start, end

    try:
        gaps, tokens, answers, start, end = asyncio.run(run())
    finally:
        server.stop()
    before = worst(gaps, 0.0, start)
    during = worst(gaps, start, end)
    row.load = (
        f"one greedy stream of 400 tokens; while it decodes, {HEAVY} requests at once, each "
        f"with its own regex of {ALTERNATIVES:,} alternatives ({len(regexes[0][0]):,} "
        f"characters), {mode}"
    )
    row.add(
        f"the stream's worst gap between events: {1000 * before:.0f} ms before them, "
        f"{1000 * during:.0f} ms while they compiled and ran ({1000 * (end - start):.0f} ms)"
    )
    assert tokens == 400  # the stream ran to its end
    for (regex, words), answer in zip(regexes, answers, strict=True):
        assert answer["finish_reason"] == "stop" and answer["text"] in words
        assert re.fullmatch(regex, answer["text"])
