"""Serving benchmark: an async HTTP client against a running kvserve (or any OpenAI-style
server), as `kvserve bench` and benchmarks/serve_bench.py.

Workloads: fixed lengths of random token-id prompts, or a synthetic chat-like mix of
lengths. Closed loop at a concurrency, or open loop at a Poisson request rate; bounded
in request count and time. Each run reports request throughput, output and total
tokens/s, TTFT, inter-token latency, time per output token and end-to-end latency
(mean, p50, p90, p99) and errors; results go to JSON, and a sweep over concurrency can
be plotted (matplotlib, optional).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from service.launch import free_port


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


@dataclass
class Result:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


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
) -> Result:
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
    model: str | None,
    api_key: str | None,
    seed: int,
) -> dict[str, Any]:
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

            async def worker() -> None:
                while queue and time.perf_counter() < deadline:
                    prompt, n = queue.pop()
                    results.append(await one(client, prompt, n, model, errors))

            await asyncio.gather(*(worker() for _ in range(concurrency or 1)))
        else:  # open loop: Poisson arrivals at `rate` requests/s
            rng = random.Random(seed + 1)
            tasks = []
            for prompt, n in requests:
                if time.perf_counter() >= deadline:
                    break
                tasks.append(asyncio.ensure_future(one(client, prompt, n, model, errors)))
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


async def single_stream(url: str, prompt: list[int], max_tokens: int) -> dict[str, float]:
    """One streamed request alone: decode tok/s = (chunks - 1) / (last chunk - first
    chunk), TTFT, and the number of chunks; SystemExit if it fails. Through the same
    transport as `run` (the client's CPU per token is taken from the server measured)."""
    transport, errors, _ = client_transport(httpx.Limits(max_connections=4))
    async with httpx.AsyncClient(base_url=url, timeout=600, transport=transport) as client:
        r = await one(client, prompt, max_tokens, None, errors)
    if not r.ok or not r.itl:
        raise SystemExit(f"request failed: {r.error}")
    return {"decode_tok_s": len(r.itl) / sum(r.itl), "ttft_s": r.ttft, "chunks": len(r.itl) + 1}


def client_transport(
    limits: httpx.Limits,
) -> tuple[httpx.AsyncBaseTransport | None, tuple[type[BaseException], ...], str]:
    """The httpx client's transport: aiohttp's (httpx-aiohttp, the `bench` extra) where
    installed, else httpx's own. Per streamed event the aiohttp transport costs the client
    about a third of the CPU (16,384 events: 0.37 s against 1.0 s, benchmarks/RESULTS.md),
    and on a machine shared with the server that CPU is taken from the server measured.
    Returns the transport (None: httpx's default), the errors a request may raise through
    it, and its name for the report."""
    try:
        import aiohttp
        from httpx_aiohttp import AiohttpTransport
    except ImportError:
        return None, (httpx.HTTPError,), "httpx"
    return AiohttpTransport(limits=limits), (httpx.HTTPError, aiohttp.ClientError), "httpx+aiohttp"


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def pct(p: float) -> float:
        return 1000 * ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]

    return {
        "mean": 1000 * statistics.fmean(ordered),
        "p50": pct(50),
        "p90": pct(90),
        "p99": pct(99),
    }


def summarize(results: list[Result], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(results),
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "error_examples": [r.error for r in results if not r.ok][:3],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_tok_s": out_tokens / duration,
        "total_tok_s": (out_tokens + sum(r.prompt_tokens for r in ok)) / duration,
        "ttft_ms": _stats([r.ttft for r in ok if r.ttft is not None]),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "tpot_ms": _stats([r.tpot for r in ok if r.tpot is not None]),
        "e2e_ms": _stats([r.e2e for r in ok]),
    }


def print_table(runs: list[dict[str, Any]]) -> None:
    head = (
        f"{'conc':>5} {'rate':>6} {'ok/err':>8} {'req/s':>7} {'out tok/s':>10} {'tot tok/s':>10} "
        f"{'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} {'p99':>7} {'TPOT p50':>9} {'e2e p50':>9} {'p99':>9}"
    )
    print(head)
    print("-" * len(head))

    def f(v: float | None, w: int) -> str:
        return f"{v:{w}.1f}" if v is not None else " " * (w - 1) + "-"

    for r in runs:
        print(
            f"{r['concurrency'] or '-':>5} {r['request_rate'] or '-':>6} {r['completed']:>4}/{r['errors']:<3} "
            f"{r['request_throughput']:7.2f} {r['output_tok_s']:10.1f} {r['total_tok_s']:10.1f} "
            f"{f(r['ttft_ms']['p50'], 9)} {f(r['ttft_ms']['p99'], 8)} {f(r['itl_ms']['p50'], 8)} {f(r['itl_ms']['p99'], 7)} "
            f"{f(r['tpot_ms']['p50'], 9)} {f(r['e2e_ms']['p50'], 9)} {f(r['e2e_ms']['p99'], 9)}"
        )
    if runs:
        cpu = ", ".join(f"{r['client_cpu_s']:.2f}" for r in runs)
        print(f"client: {runs[0]['client_transport']} transport, CPU seconds per run: {cpu}")


def plot(runs: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "matplotlib is not installed (pip install 'kvserve[bench]'): no plot", file=sys.stderr
        )
        return False
    conc = [r["concurrency"] for r in runs]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(conc, [r["output_tok_s"] for r in runs], "o-", label="output tokens/s")
    a.set_xscale("log", base=2)
    a.set_xlabel("concurrency")
    a.set_ylabel("tokens/s")
    a.set_title("throughput")
    a.grid(alpha=0.3)
    for key, label in (("ttft_ms", "TTFT"), ("itl_ms", "inter-token"), ("e2e_ms", "end-to-end")):
        b.plot(conc, [r[key]["p50"] for r in runs], "o-", label=f"{label} p50")
        b.plot(conc, [r[key]["p99"] for r in runs], "x--", label=f"{label} p99")
    b.set_xscale("log", base=2)
    b.set_yscale("log")
    b.set_xlabel("concurrency")
    b.set_ylabel("ms")
    b.set_title("latency")
    b.grid(alpha=0.3)
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def spawn(args: str) -> tuple[subprocess.Popen, str]:
    """Start `kvserve serve ARGS` on a free port and wait until it is healthy."""
    import shlex

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "serve", "--port", str(port), *shlex.split(args)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, 300, f"kvserve serve {args}")
    return proc, url


def write_report(path: str | Path, report: dict[str, Any]) -> None:
    """A benchmark's JSON report (its folder made), and say where it went."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


def cpu_model() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it (what RESULTS.md names)."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def wait_healthy(proc: subprocess.Popen, url: str, seconds: float, name: str) -> None:
    """Wait until the server `proc` answers 200 on /health; SystemExit naming it if it
    exits first or the time runs out (then it is killed)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"{name} did not become healthy")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument(
        "--spawn",
        metavar="ARGS",
        default=None,
        help="start `kvserve serve ARGS` locally and benchmark it",
    )
    ap.add_argument("--model", default=None)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--workload", choices=["fixed", "chat"], default="fixed")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument(
        "--vocab-size", type=int, default=32000, help="prompt token ids are drawn below this"
    )
    ap.add_argument(
        "--concurrency", type=int, nargs="+", default=[8], help="closed loop; several values sweep"
    )
    ap.add_argument(
        "--request-rate", type=float, default=None, help="open loop: Poisson arrivals per second"
    )
    ap.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="per run (default: 4 x concurrency, at least 16)",
    )
    ap.add_argument(
        "--max-seconds", type=float, default=300.0, help="stop sending new requests after this"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=Path("benchmarks/out/serve_bench.json"))
    ap.add_argument(
        "--plot", type=Path, default=None, help="PNG of latency and throughput against concurrency"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="kvserve bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(ap)
    return run_cli(ap.parse_args(argv))


def event_loop() -> asyncio.Runner:
    """uvloop where installed (as the server uses it): on a machine shared with the
    server, a cheaper client leaves more CPU to the server it measures."""
    try:
        import uvloop
    except ImportError:
        return asyncio.Runner()
    return asyncio.Runner(loop_factory=uvloop.new_event_loop)


def run_cli(args: argparse.Namespace) -> int:
    proc, url = spawn(args.spawn) if args.spawn else (None, args.url)
    runs = []
    try:
        points = [None] if args.request_rate else args.concurrency
        for conc in points:
            n = args.num_requests or max(16, 4 * (conc or 4))
            reqs = workload(
                args.workload, n, args.prompt_len, args.output_len, args.vocab_size, args.seed
            )
            work = run(
                url,
                reqs,
                conc,
                args.request_rate,
                args.max_seconds,
                args.model,
                args.api_key,
                args.seed,
            )
            with event_loop() as runner:
                runs.append(runner.run(work))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    print_table(runs)
    config = {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"config": config, "runs": runs}, indent=2))
    print(f"wrote {args.json}")
    if args.plot and len(runs) > 1 and plot(runs, args.plot):
        print(f"wrote {args.plot}")
    return 1 if any(r["errors"] for r in runs) else 0
