"""Multi-turn conversations past the KV pool: does the prefix cache's host tier keep a
returning user's earlier turns?

Many simulated users, each a conversation of --turns turns (a system prompt, then each
turn the whole conversation so far plus a new user message, answered in --output-len
tokens, greedy), with a think time between turns; more users than the KV pool holds at
once (--num-kv-blocks), so an idle user's blocks are evicted while others talk. Each
configuration is a fresh `kvserve serve` over HTTP with the same users:
  off        no host tier (--kv-host-gib 0): an evicted turn is recomputed
  host       the host tier (--kv-host-gib): evicted blocks are copied back
  host+disk  a host tier too small for the conversations (--disk-host-gib) and the disk
             tier behind it (--kv-disk-path, a temporary folder): most come back from files
  unbounded  a pool that holds every conversation: the hit rate a tier could reach
Per turn: TTFT p50 and p99 and the prefix-hit rate (cached / prompt tokens, from each
response's usage). Then a workload with no reuse (every request a new prompt), off and
host in turns (--no-reuse-rounds each, the median), in output tokens/s: what the tier's
copies cost where nothing comes back.
Prints the tables, writes JSON and records the rows in docs/results.md.

    PYTHONPATH=. .venv/bin/python benchmarks/multiturn.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import OUT, checkpoint, write_json
from benchmarks.results import record
from service.bench_cli import wait_healthy
from service.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
WORDS = [f"{a}{b}" for a in "bcdfghklmnprstvz" for b in ("a", "e", "i", "o", "u", "ay", "ee")]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def user(
    client: httpx.AsyncClient, i: int, args: argparse.Namespace, reuse: bool
) -> list[dict[str, Any]]:
    """One user's turns: each one's TTFT, prompt and cached tokens, output tokens."""
    rng = random.Random(i)
    await asyncio.sleep(rng.uniform(0, args.think))  # users arrive spread out
    said = f"System: {words(rng, args.system_words)}\n"
    turns = []
    for t in range(args.turns):
        message = f"User {i}: {words(rng, args.user_words)}\nAssistant:"
        prompt = said + message if reuse else f"User {i}.{t}: {words(rng, args.system_words)}"
        body = {"prompt": prompt, "max_tokens": args.output_len, "temperature": 0,
                "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        start, first, text, usage = time.perf_counter(), None, "", None
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    usage = event["usage"]
                elif event["choices"]:
                    first = first or time.perf_counter()
                    text += event["choices"][0]["text"]
        assert usage is not None and first is not None
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        turns.append({"ttft_s": first - start, "prompt_tokens": usage["prompt_tokens"],
                      "cached_tokens": cached, "output_tokens": usage["completion_tokens"],
                      "seconds": time.perf_counter() - start})  # fmt: skip
        said = prompt + text + "\n"
        await asyncio.sleep(rng.uniform(0.5, 1.5) * args.think)
    return turns


async def workload(url: str, args: argparse.Namespace, reuse: bool) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=args.users + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        users = await asyncio.gather(*(user(client, i, args, reuse) for i in range(args.users)))
        seconds = time.perf_counter() - start
    per_turn = []
    for t in range(args.turns):
        rows = [u[t] for u in users]
        ttft = sorted(r["ttft_s"] for r in rows)
        prompt = sum(r["prompt_tokens"] for r in rows)
        per_turn.append({
            "turn": t + 1, "ttft_p50_s": statistics.median(ttft),
            "ttft_p99_s": ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))],
            "hit_rate": sum(r["cached_tokens"] for r in rows) / prompt, "prompt_tokens": prompt,
        })  # fmt: skip
    output = sum(r["output_tokens"] for u in users for r in u)
    return {"per_turn": per_turn, "seconds": seconds, "output_tok_s": output / seconds}


def serve(model: Path, args: argparse.Namespace, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "service.cli", "serve", "--model", str(model), "--dtype",
           "bfloat16", "--port", str(port), "--block-size", str(args.block_size),
           "--max-num-seqs", str(args.users), *extra]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, 600, " ".join(extra))
    return proc, url


def run(model: Path, args: argparse.Namespace, extra: list[str], reuse: bool) -> dict[str, Any]:
    proc, url = serve(model, args, extra)
    try:
        httpx.post(url + "/v1/completions", json={"prompt": "warm up", "max_tokens": 4},
                   timeout=600).raise_for_status()  # fmt: skip
        result = asyncio.run(workload(url, args, reuse))
        metrics = httpx.get(url + "/metrics", timeout=60).text
        for key, name in (("restored_blocks", "kvserve_kv_host_restored_blocks_total"),
                          ("disk_read_blocks", "kvserve_kv_disk_read_blocks_total")):  # fmt: skip
            result[key] = sum(float(line.split()[-1]) for line in metrics.splitlines()
                              if line.startswith(name))  # fmt: skip
        return result
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="a checkpoint (default: SmolLM2-135M's shape)")
    ap.add_argument("--users", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-words", type=int, default=300)
    ap.add_argument("--user-words", type=int, default=40)
    ap.add_argument("--output-len", type=int, default=24)
    ap.add_argument("--think", type=float, default=2.0, help="mean seconds between turns")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-kv-blocks", type=int, default=160, help="the bounded pool")
    ap.add_argument("--host-gib", type=float, default=1.0)
    ap.add_argument("--disk-host-gib", type=float, default=0.01, help="host+disk's host tier")
    ap.add_argument("--no-reuse-rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=OUT / "multiturn.json")
    ap.add_argument("--no-record", action="store_true", help="leave docs/results.md alone")
    args = ap.parse_args()
    model = args.model or checkpoint(OUT / "smollm2-135m-random")
    pool = ["--num-kv-blocks", str(args.num_kv_blocks)]
    disk = tempfile.mkdtemp(prefix="kvserve-multiturn-")
    configs = {
        "off": [*pool, "--kv-host-gib", "0"],
        "host": [*pool, "--kv-host-gib", str(args.host_gib)],
        "host+disk": [*pool, "--kv-host-gib", str(args.disk_host_gib), "--kv-disk-path", disk],
        "unbounded": ["--num-kv-blocks", str(args.num_kv_blocks * 16), "--kv-host-gib", "0"],
    }
    try:
        results = {name: run(model, args, extra, reuse=True) for name, extra in configs.items()}
    finally:
        shutil.rmtree(disk, ignore_errors=True)
    # no reuse: off and host in turns, --no-reuse-rounds times (the machine drifts)
    no_reuse: dict[str, list[dict[str, Any]]] = {"off": [], "host": []}
    for r in range(args.no_reuse_rounds):
        for name in ("off", "host") if r % 2 == 0 else ("host", "off"):
            no_reuse[name].append(run(model, args, configs[name], reuse=False))
    tok_s = {name: statistics.median(x["output_tok_s"] for x in runs)
             for name, runs in no_reuse.items()}  # fmt: skip
    print(f"{args.users} users x {args.turns} turns, pool of {args.num_kv_blocks} blocks of "
          f"{args.block_size}, SmolLM2-135M shape, bf16, over HTTP")  # fmt: skip
    print(f"{'turn':>4} " + " ".join(f"{n + ' p50 ms':>16} {'p99':>7} {'hit':>5}" for n in results))
    for t in range(args.turns):
        cells = []
        for r in results.values():
            row = r["per_turn"][t]
            cells.append(f"{row['ttft_p50_s'] * 1e3:16.0f} {row['ttft_p99_s'] * 1e3:7.0f} "
                         f"{row['hit_rate']:5.0%}")  # fmt: skip
        print(f"{t + 1:>4} " + " ".join(cells))

    def later(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name]["per_turn"][1:])

    speedup = later("off", "ttft_p50_s") / later("host", "ttft_p50_s")
    reach = later("host", "hit_rate") / max(later("unbounded", "hit_rate"), 1e-9)
    cost = tok_s["host"] / tok_s["off"]
    print(
        f"turns 2+: TTFT p50 {speedup:.2f}x lower with the host tier; hit rate {reach:.0%} "
        f"of the unbounded pool's; restored blocks {results['host']['restored_blocks']:.0f} "
        f"(host+disk: {results['host+disk']['restored_blocks']:.0f}, of them read from disk "
        f"{results['host+disk']['disk_read_blocks']:.0f})"
    )
    rounds = {
        n: ", ".join(f"{x['output_tok_s']:.1f}" for x in runs) for n, runs in no_reuse.items()
    }
    print(
        f"no reuse, median of {args.no_reuse_rounds}: {tok_s['off']:.1f} tok/s off "
        f"({rounds['off']}), {tok_s['host']:.1f} with the tier ({rounds['host']}): {cost:.2f}x"
    )
    write_json(args.json, {"results": results, "no_reuse": no_reuse, "speedup": speedup,
                           "hit_reach": reach, "no_reuse_ratio": cost,
                           "args": {k: str(v) for k, v in vars(args).items()}})  # fmt: skip
    if args.no_record:
        return
    shape = (
        f"{args.users} users x {args.turns} turns, pool {args.num_kv_blocks} x {args.block_size}"
    )
    record("multiturn", {
        f"turns 2+ TTFT p50, host tier against none ({shape})":
            f"{later('host', 'ttft_p50_s') * 1e3:.0f} ms against {later('off', 'ttft_p50_s') * 1e3:.0f}"
            f" ({speedup:.2f}x lower)",
        f"turns 2+ prefix-hit rate ({shape})":
            f"{later('host', 'hit_rate'):.0%} with the tier, {later('off', 'hit_rate'):.0%} "
            f"without, {later('unbounded', 'hit_rate'):.0%} with an unbounded pool",
        f"turns 2+ TTFT p50, a small host tier and the disk tier ({shape})":
            f"{later('host+disk', 'ttft_p50_s') * 1e3:.0f} ms, hit rate "
            f"{later('host+disk', 'hit_rate'):.0%}",
        f"no reuse, output tok/s ({shape})":
            f"{tok_s['host']:.1f} with the tier, {tok_s['off']:.1f} without ({cost:.2f}x; "
            f"median of {args.no_reuse_rounds} runs each, in turns)",
    })  # fmt: skip


if __name__ == "__main__":
    main()
