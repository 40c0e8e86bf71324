"""`kvserve bench` (and benchmarks/serve_bench.py): the serving benchmark against a
running kvserve (or any OpenAI-style server), or one it starts (--spawn).

Workloads: fixed lengths of random token-id prompts, or a synthetic chat-like mix of
lengths. Closed loop at each of a sweep of concurrencies, or open loop at a Poisson
request rate; bounded in request count and time. Each run reports request throughput,
output and total tokens/s, TTFT, inter-token latency, time per output token and
end-to-end latency (mean, p50, p90, p99) and errors; results go to JSON, and a sweep over
concurrency can be plotted (matplotlib, optional). The client is service/bench.py, the
report service/bench_report.py.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx

from service.bench import event_loop, run, workload
from service.bench_report import plot, print_table
from service.launch import free_port


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
