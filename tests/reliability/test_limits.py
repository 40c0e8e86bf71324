"""Requests at and over every per-request cap, beside a steady stream: the caps answer
400 naming the parameter, the heaviest accepted requests (300 logit_bias entries, 16 stop
strings of 512 characters, 256 stop token ids) run, and the stream's inter-token latency
with them is measured against the same stream alone."""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import sys
import time

import httpx
import pytest

from tests.reliability.conftest import Row, harness

pytestmark = pytest.mark.reliability  # make test-fast leaves these out

HEAVY = {
    "logit_bias": {str(i): 0.5 for i in range(300)},
    "stop": [f"{i:03d}" + "z" * 509 for i in range(16)],
    "stop_token_ids": list(range(90000, 90256)),
}
OVER = [
    {"logit_bias": {str(i): 0.5 for i in range(301)}},
    {"stop": [f"s{i}" for i in range(17)]},
    {"stop": "z" * 513},
    {"stop_token_ids": list(range(257))},
]


async def steady(client: httpx.AsyncClient, n: int) -> tuple[list[float], int]:
    """A streamed request's gaps between its events, in ms (an event carries every token
    ready when the front got to the stream: one, unless the front fell behind), and the
    tokens it carried (its usage)."""
    body = {"prompt": "A steady stream", "max_tokens": n, "temperature": 0, "ignore_eos": True}
    body["stream_options"] = {"include_usage": True}
    stamps, tokens = [], 0
    async with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as resp:
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            elif event["choices"][0]["text"]:
                stamps.append(time.perf_counter())
    return [1000 * (b - a) for a, b in itertools.pairwise(stamps)], tokens


def pct(gaps: list[float], q: float) -> float:
    return statistics.quantiles(gaps, n=100)[int(q) - 1]


def test_heavy_and_oversized_requests_beside_a_stream(tmp_path, row: Row, mode: str) -> None:
    """Oversized logit_bias / stop requests beside a stream"""
    server = harness(tmp_path, mode=mode)
    try:

        async def main() -> tuple[list[float], list[float], tuple, list[int], list[dict]]:
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
                await steady(client, 8)  # warm-up
                alone, _ = await steady(client, 120)
                body = {"prompt": "Heavy request", "max_tokens": 60, "temperature": 0.8}
                plain = [client.post("/v1/completions", json=body | {"seed": i}) for i in range(12)]
                (control, _), *_ = await asyncio.gather(steady(client, 120), *plain)
                heavy = [
                    client.post("/v1/completions", json=body | HEAVY | {"seed": i})
                    for i in range(12)
                ]
                over = [client.post("/v1/completions", json=body | extra) for extra in OVER * 5]
                beside, *answers = await asyncio.gather(steady(client, 120), *heavy, *over)
                codes = [r.status_code for r in answers]
                errors = [r.json()["error"] for r in answers[len(heavy) :]]
                return alone, control, beside, codes, errors

        alone, control, (beside, beside_tokens), codes, errors = asyncio.run(main())
        health = server.wait_idle()
    finally:
        server.stop()
    row.load = (
        "a 120-token stream: alone; beside 12 plain sampled requests; beside 12 requests at "
        "every cap (300 logit_bias entries, 16 x 512-character stops, 256 stop ids) and 20 "
        "over a cap"
    )
    row.add(
        f"stream inter-event p50 / p99: alone {pct(alone, 50):.1f} / {pct(alone, 99):.1f} ms; "
        f"beside plain requests {pct(control, 50):.1f} / {pct(control, 99):.1f} ms; "
        f"beside the capped ones {pct(beside, 50):.1f} / {pct(beside, 99):.1f} ms"
    )
    row.add(
        f"at the caps: {codes[:12].count(200)}/12 200; over a cap: "
        f"{codes[12:].count(400)}/20 400 naming {sorted({e['param'] for e in errors})}"
    )
    assert codes[:12] == [200] * 12
    assert codes[12:] == [400] * 20
    assert {e["param"] for e in errors} == {"logit_bias", "stop", "stop_token_ids"}
    assert beside_tokens == 120 and health["kv_cache"]["blocks_used"] == 0


def test_tokenizing_runs_off_the_event_loop(tmp_path) -> None:
    """With the tokenizer refusing to run on the event loop's thread, every route that
    tokenizes (a prompt, chat messages through the template, /tokenize) still answers."""
    server = harness(tmp_path, fault="encode-off-loop:0")  # the front's, in either
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            text = {"prompt": "tokenize me " * 2000, "max_tokens": 2}
            assert c.post("/v1/completions", json=text).status_code == 200
            chat = {"messages": [{"role": "user", "content": "hi " * 2000}], "max_tokens": 2}
            assert c.post("/v1/chat/completions", json=chat).status_code == 200
            assert c.post("/tokenize", json={"prompt": "hello"}).json()["count"] >= 1
    finally:
        server.stop()


SCORED = {"max_tokens": 1, "echo": True, "logprobs": 20, "prompt_logprobs": 20}
PROMPT_IDS = [[(7 * p + 13 * i) % 5000 + 300 for i in range(1900)] for p in range(7)]
CHAT_OVER = {"messages": [{"role": "user", "content": "word " * 3000}], "max_tokens": 1,
             "prompt_logprobs": 20, "n": 8}  # fmt: skip
# the heavy requests from a process of their own: reading 25 MB bodies on the loop that
# times the stream would show the client's stalls, not the server's
# (nor parsing them beside it: their bodies are kept in files, read once it is over)
HEAVY_CLIENT = """
import concurrent.futures, json, sys, httpx
print("ready", flush=True)  # its start-up done, not beside the stream
url, folder, bodies = sys.argv[1], sys.argv[2], json.loads(sys.stdin.readline())
def post(i):
    r = httpx.post(url + bodies[i][0], json=bodies[i][1], timeout=300)
    open(f"{folder}/answer-{i}.json", "wb").write(r.content)
    return r.status_code
with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
    print(json.dumps(list(pool.map(post, range(len(bodies))))))
"""


def test_prompt_logprobs_at_their_size_cap_beside_a_stream(tmp_path, row: Row, mode: str) -> None:
    """Prompt logprobs at their size cap beside a stream"""
    server = harness(tmp_path, mode=mode)
    bodies = [["/v1/completions", SCORED | {"prompt": PROMPT_IDS[:6]}]] * 3 + [
        ["/v1/completions", SCORED | {"prompt": PROMPT_IDS}],
        ["/v1/chat/completions", CHAT_OVER],
    ]
    try:

        async def main() -> tuple[list[float], list[float], bytes]:
            async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
                await steady(client, 8)  # warm-up
                alone, _ = await steady(client, 200)
                heavy = await asyncio.create_subprocess_exec(
                    sys.executable, "-c", HEAVY_CLIENT, server.url, str(tmp_path),
                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                )  # fmt: skip
                assert await heavy.stdout.readline() == b"ready\n"
                send = heavy.communicate(json.dumps(bodies).encode() + b"\n")
                (beside, _), (out, _) = await asyncio.gather(steady(client, 800), send)
                return alone, beside, out

        alone, beside, out = asyncio.run(main())
        health = server.wait_idle()
    finally:
        server.stop()
    codes = json.loads(out)
    raw = [(tmp_path / f"answer-{i}.json").read_bytes() for i in range(len(bodies))]
    sizes = [len(r) for r in raw[:3]]
    answers = [json.loads(r) for r in raw]
    params = sorted({body["error"]["param"] for body in answers[3:]})
    row.load = (
        "an 800-token stream (outlasting them) beside 3 requests at the cap (6 prompts of "
        "1,900 tokens with echo, logprobs 20 and prompt_logprobs 20: 478,800 entries each) "
        "and 2 over it (7 prompts; a chat prompt scored 20 deep for n=8), sent by another "
        "process"
    )
    row.add(
        f"the stream's worst gap between events: {max(alone):.0f} ms alone, {max(beside):.0f} "
        f"ms beside them (target under 100); p99 {pct(alone, 99):.0f} / {pct(beside, 99):.0f} ms"
    )
    row.add(
        f"at the cap: {codes[:3]}, bodies of {min(sizes) / 1e6:.1f}-{max(sizes) / 1e6:.1f} MB; "
        f"over it: {codes[3:]} naming {params}"
    )
    assert codes == [200] * 3 + [400] * 2 and params == ["prompt_logprobs"]
    assert all(len(c["prompt_logprobs"]) == 1900 for a in answers[:3] for c in a["choices"])
    assert health["kv_cache"]["blocks_used"] == 0
