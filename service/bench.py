"""The serving benchmark's client: an async HTTP client that streams completions from a
running kvserve (or any OpenAI-style server) and times each request; what `kvserve bench`
(service/bench_cli.py) and the benchmarks over HTTP (benchmarks/) send.

Workloads: fixed lengths of random token-id prompts, or a synthetic chat-like mix of
lengths. Closed loop at a concurrency, or open loop at a Poisson request rate; bounded
in request count and time. A run's requests are summarized by service/bench_report.py.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from typing import Any

import httpx

from service.bench_report import Result, summarize


class SSEData:
    """The `data:` payloads of a server-sent event stream, fed as the bytes arrive (any
    split, any of the three line endings); `[DONE]` is dropped. Splitting bytes here
    costs the client less CPU per event than httpx's text-then-lines iterators, and on
    a machine shared with the server that CPU is taken from the server being measured."""

    _line_end = re.compile(rb"\r\n|\r|\n")

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> list[bytes]:
        self._pending += data
        if b"\n" not in data and b"\r" not in data:
            return []
        *lines, self._pending = self._line_end.split(self._pending)
        return [
            line[5:]
            for line in lines
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]"
        ]


def workload(
    kind: str, n: int, prompt_len: int, output_len: int, vocab: int, seed: int
) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if kind == "fixed":
            p, o = prompt_len, output_len
        else:  # chat-like: long-tailed prompt and answer lengths around the given means
            p = int(min(max(rng.lognormvariate(0, 0.8) * prompt_len, 8), 8 * prompt_len))
            o = int(min(max(rng.lognormvariate(0, 0.6) * output_len, 4), 4 * output_len))
        out.append(([rng.randrange(1000, vocab) for _ in range(p)], o))
    return out


async def one(
    client: httpx.AsyncClient,
    prompt: list[int],
    max_tokens: int,
    model: str | None,
    errors: tuple[type[BaseException], ...] = (httpx.HTTPError,),
    per_token: bool = False,
) -> Result:
    """One streamed completion, timed. per_token: each token its own event (its logprob
    asked for: a token that ends inside a character, whose text the server holds until
    the character is whole, still sends one), so the gaps are between tokens, not between
    pieces of text."""
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    if per_token:
        body["logprobs"] = 0
    result = Result(ok=False, prompt_tokens=len(prompt))
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return result
            events, chunks = SSEData(), 0
            async for data in resp.aiter_bytes():
                for payload in events.feed(data):
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        result.error = chunk["error"].get("message", "error")
                        return result
                    if chunk.get("usage"):
                        result.output_tokens = chunk["usage"]["completion_tokens"]
                        continue
                    now = time.perf_counter()
                    chunks += 1
                    if result.ttft is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        # a server that sends no usage chunk: one token per content chunk
        result.output_tokens = result.output_tokens or chunks
        result.ok = True
    except (*errors, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.e2e = time.perf_counter() - start
    return result


async def run(
    url: str,
    requests: list[tuple[list[int], int]],
    concurrency: int | None,
    rate: float | None,
    max_seconds: float,
    model: str | list[str] | None,
    api_key: str | None,
    seed: int,
    per_token: bool = False,
) -> dict[str, Any]:
    """model: the one every request names, or several: the closed loop's client i
    names model[i % len(model)], the open loop's request j model[j % len(model)]
    (LoRA adapters, benchmarks/lora.py). per_token: as `one`'s."""
    models = model if isinstance(model, list) else [model]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max(concurrency or 0, 256))
    transport, errors, transport_name = client_transport(limits)
    results: list[Result] = []
    async with httpx.AsyncClient(
        base_url=url, timeout=600, headers=headers, limits=limits, transport=transport
    ) as client:
        start, cpu_start = time.perf_counter(), time.process_time()
        deadline = start + max_seconds
        if (
            rate is None
        ):  # closed loop: `concurrency` clients, each sends its next request when done
            queue = list(reversed(requests))

            async def worker(name: str | None) -> None:
                while queue and time.perf_counter() < deadline:
                    prompt, n = queue.pop()
                    results.append(await one(client, prompt, n, name, errors, per_token))

            clients = range(concurrency or 1)
            await asyncio.gather(*(worker(models[i % len(models)]) for i in clients))
        else:  # open loop: Poisson arrivals at `rate` requests/s
            rng = random.Random(seed + 1)
            tasks = []
            for j, (prompt, n) in enumerate(requests):
                if time.perf_counter() >= deadline:
                    break
                name = models[j % len(models)]
                request = one(client, prompt, n, name, errors, per_token)
                tasks.append(asyncio.ensure_future(request))
                await asyncio.sleep(rng.expovariate(rate))
            results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
        client_cpu = time.process_time() - cpu_start
    return summarize(results, duration) | {
        "concurrency": concurrency,
        "request_rate": rate,
        "client_transport": transport_name,
        # what measuring cost: on a machine shared with the server, this CPU was not the server's
        "client_cpu_s": client_cpu,
    }


async def single_stream(
    url: str, prompt: list[int], max_tokens: int, model: str | None = None
) -> dict[str, float]:
    """One streamed request alone: decode tok/s = (chunks - 1) / (last chunk - first
    chunk), TTFT, and the number of chunks; SystemExit if it fails. Through the same
    transport as `run` (the client's CPU per token is taken from the server measured)."""
    transport, errors, _ = client_transport(httpx.Limits(max_connections=4))
    async with httpx.AsyncClient(base_url=url, timeout=600, transport=transport) as client:
        r = await one(client, prompt, max_tokens, model, errors)
    if not r.ok or not r.itl:
        raise SystemExit(f"request failed: {r.error}")
    return {"decode_tok_s": len(r.itl) / sum(r.itl), "ttft_s": r.ttft, "chunks": len(r.itl) + 1}


def client_transport(
    limits: httpx.Limits,
) -> tuple[httpx.AsyncBaseTransport | None, tuple[type[BaseException], ...], str]:
    """The httpx client's transport: aiohttp's (httpx-aiohttp, the `bench` extra) where
    installed, else httpx's own. Per streamed event the aiohttp transport costs the client
    about a third of the CPU (docs/decisions.md), and on a machine shared with the server
    that CPU is taken from the server measured.
    Returns the transport (None: httpx's default), the errors a request may raise through
    it, and its name for the report."""
    try:
        import aiohttp
        from httpx_aiohttp import AiohttpTransport
    except ImportError:
        return None, (httpx.HTTPError,), "httpx"
    return AiohttpTransport(limits=limits), (httpx.HTTPError, aiohttp.ClientError), "httpx+aiohttp"


def event_loop() -> asyncio.Runner:
    """uvloop where installed (as the server uses it): on a machine shared with the
    server, a cheaper client leaves more CPU to the server it measures."""
    try:
        import uvloop
    except ImportError:
        return asyncio.Runner()
    return asyncio.Runner(loop_factory=uvloop.new_event_loop)
