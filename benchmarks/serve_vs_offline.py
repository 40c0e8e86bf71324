"""Serving over HTTP against the offline engine, alternated in one sitting (issue #6's 90%).

Starts `kvserve serve` on the checkpoint, loads the same checkpoint (same tokenizer, same
dtype) into engines in this process, and alternates: a closed-loop streaming HTTP run at
the concurrency (service/bench.py's client), and the offline engine through the same
waves (the same number of requests, `max_num_seqs` = the concurrency, submitted at once,
and the server's cap on prompt tokens in a step with decodes).
Pairs take turns going first, so a drift in the machine's speed falls on both sides; each
run draws fresh prompts, so no run finds the last one's prefixes cached. On a shared
machine two commands minutes apart differ on their own; this measures both sides within
seconds of each other. Then one stream alone, ms a token over HTTP against the offline
engine's. Several concurrencies run on one server; several sets of server flags (one
server each, in turn) share the offline engines. Prints every pair, the medians and a
table; writes JSON and records the rows in docs/results.md.

    PYTHONPATH=. .venv/bin/python benchmarks/serve_vs_offline.py --concurrency 32 --pairs 6
    PYTHONPATH=. python benchmarks/serve_vs_offline.py --shape llama-3.2-1b \
        --concurrency 64 256 --pairs 2 --serve-args "--engine-process off" "--engine-process on"
"""

from __future__ import annotations

import argparse
import gc
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import OUT, SHAPES, SMOKE, checkpoint, run_batch, run_single, write_json
from benchmarks.process_cpu import cpu_by_role, spent
from benchmarks.results import record
from model.backends.device import pick_device, pick_dtype
from model.loader import load
from service import bench
from service.bench_cli import spawn
from service.config import Settings
from service.engine.core.engine import LLMEngine


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model", type=Path, default=None, help="default: a random checkpoint of --shape"
    )
    ap.add_argument(
        "--shape",
        choices=[*SHAPES, "tiny"],
        default="smollm2-135m",
        help="tiny: 2 layers of 64 features, whose forward costs little, so the host's work "
        "per token dominates as on a GPU (the CPU proxy for the serving path)",
    )
    ap.add_argument(
        "--serve-args",
        nargs="+",
        default=[""],
        help="more `kvserve serve` flags; several sets (each quoted) run one server each, "
        "in turn, against the same offline engines",
    )
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[32])
    ap.add_argument(
        "--requests", type=int, default=None, help="per run (default 4 x conc., 2 x above 64)"
    )
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--kv-cache-gib", type=float, default=2.0)
    ap.add_argument(
        "--mixed-prefill-tokens",
        type=int,
        default=None,
        help="both sides; 0: no cap (default: the server's default for the device)",
    )
    ap.add_argument("--json", type=Path, default=OUT / "serve_vs_offline.json")
    ap.add_argument(
        "--no-record", dest="record", action="store_false", help="leave docs/results.md as is"
    )
    args = ap.parse_args()
    shape = SMOKE if args.shape == "tiny" else SHAPES[args.shape]
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else None  # the checkpoint's, as served
    path = args.model or checkpoint(OUT / f"{args.shape}-random", shape, dtype)
    offline = Offline(path, args)
    servers = []
    for flags in args.serve_args:
        servers.append(serve(path, flags.strip(), offline, args))
        write_json(args.json, {"config": config(args), "servers": servers})
    summary(servers)
    if any(p["http"]["errors"] for s in servers for c in s["runs"] for p in c["pairs"]):
        sys.exit(1)
    if args.record:
        record_rows(servers, args)


def config(args: argparse.Namespace) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()} | {
        "threads": torch.get_num_threads()
    }


def requests_for(conc: int, args: argparse.Namespace) -> int:
    """Requests a run: four waves at the concurrency, two above 64 streams (a run of
    several hundred streams is long enough in two)."""
    return args.requests or (4 * conc if conc <= 64 else 2 * conc)


class Offline:
    """The checkpoint's offline engines, one per concurrency (its `max_num_seqs`), built on
    first use and kept for every server's turn: the offline side of each pair."""

    def __init__(self, path: Path, args: argparse.Namespace) -> None:
        self.device = pick_device("auto")
        self.loaded = load(path, pick_dtype(args.dtype, self.device), self.device)
        self.vocab = self.loaded.model.cfg.vocab_size
        self.args = args
        self.engines: dict[int, LLMEngine] = {}

    def engine(self, conc: int) -> LLMEngine:
        if conc not in self.engines:
            settings = Settings(
                max_num_seqs=conc,
                kv_cache_gib=self.args.kv_cache_gib,
                num_kv_blocks=self.blocks(conc),
                mixed_prefill_tokens=self.args.mixed_prefill_tokens,
            )
            cap = settings.engine.scheduler.mixed_prefill_cap(self.device.type)
            print(f"prompt tokens in a step with decodes, both sides: {cap or 'no cap'}")
            engine = LLMEngine.build(self.loaded.model, self.loaded.tokenizer, settings.engine)
            self.engines[conc] = engine
            run_batch(engine, [p for p, _ in self.prompts(conc, 10_000)], self.args.output_len)
            gc.freeze()  # the model and engines stay out of the HTTP client's collections
        return self.engines[conc]

    def blocks(self, conc: int) -> int | None:
        """On CUDA, a pool that holds a run's every request at once: the default
        (--gpu-memory-utilization) gives one engine most of the GPU, leaving the next engine
        of this process and the server nothing. On the CPU, --kv-cache-gib as the server."""
        if self.device.type != "cuda":
            return None
        block, a = Settings().block_size, self.args
        return requests_for(conc, a) * -(-(a.prompt_len + a.output_len) // block) + 256

    def prompts(self, conc: int, seed: int) -> list[tuple[list[int], int]]:
        a = self.args
        return bench.workload(
            "fixed", requests_for(conc, a), a.prompt_len, a.output_len, self.vocab, seed
        )

    def run(self, conc: int, seed: int) -> tuple[float, float]:
        """Output tokens a second, and CPU µs per output token."""
        engine, reqs = self.engine(conc), self.prompts(conc, seed)
        cpu = time.process_time()
        run = run_batch(engine, [p for p, _ in reqs], self.args.output_len)
        return run["output_tok_s"], 1e6 * (time.process_time() - cpu) / run["output_tokens"]

    def single(self, prompt: list[int]) -> float:
        """One request alone: ms a decoded token."""
        engine = self.engine(min(self.engines, default=1))
        return run_single(engine, prompt, self.args.output_len)["decode_ms_per_token"]


def serve(path: Path, flags: str, offline: Offline, args: argparse.Namespace) -> dict:
    """One server with `flags`, alternated with the offline engines at each concurrency,
    then one stream alone on both sides."""
    serve_args = (
        f"--model {shlex.quote(str(path))} --dtype {args.dtype} "
        f"--max-num-seqs {max(64, *args.concurrency)} --kv-cache-gib {args.kv_cache_gib} {flags}"
    )
    if args.mixed_prefill_tokens is not None:
        serve_args += f" --mixed-prefill-tokens {args.mixed_prefill_tokens}"
    print(f"server: {flags or 'default flags'}", flush=True)
    proc, url = spawn(serve_args)
    try:
        runs = [alternate(proc, url, conc, offline, args) for conc in args.concurrency]
        prompt = offline.prompts(1, 20_000)[0][0]
        with bench.event_loop() as runner:
            runner.run(bench.single_stream(url, prompt, args.output_len))  # warm-up
            http_single = runner.run(bench.single_stream(url, prompt, args.output_len))
        single = {
            "http_ms": 1000 / http_single["decode_tok_s"],
            "offline_ms": offline.single(prompt),
        }
    finally:
        proc.terminate()
        proc.wait(60)
    print(
        f"  one stream: {single['http_ms']:.2f} ms a token over HTTP, "
        f"{single['offline_ms']:.2f} offline ({single['http_ms'] / single['offline_ms']:.2f}x)"
    )
    return {"flags": flags, "runs": runs, "single_stream": single}


def alternate(proc, url: str, conc: int, offline: Offline, args: argparse.Namespace) -> dict:
    """`--pairs` pairs at `conc` streams, taking turns at going first, after a warm-up of
    each side."""

    def http(seed: int) -> dict:
        """The run's figures, and the server's CPU µs per output token by role."""
        work = bench.run(url, offline.prompts(conc, seed), conc, None, 600, None, None, seed)
        before = cpu_by_role(proc.pid)
        with bench.event_loop() as runner:
            result = runner.run(work)
        tokens = max(1, result["completed"] * args.output_len)
        spent_us = spent(before, cpu_by_role(proc.pid))
        return result | {"cpu_us_per_token": {r: 1e6 * s / tokens for r, s in spent_us.items()}}

    offline.engine(conc)  # built and warmed up once
    http(10_001)
    pairs = []
    for i in range(args.pairs):
        seed = 2 * i + 1
        if i % 2:
            off, off_cpu = offline.run(conc, seed)
            served = http(seed + 1)
        else:
            served = http(seed + 1)
            off, off_cpu = offline.run(conc, seed)
        pairs.append({"http": served, "offline_tok_s": off, "offline_cpu_us_per_token": off_cpu})
        print_pair(i, pairs[-1], conc)
    ratios = [p["http"]["output_tok_s"] / p["offline_tok_s"] for p in pairs]
    http_med = statistics.median(p["http"]["output_tok_s"] for p in pairs)
    off_med = statistics.median(p["offline_tok_s"] for p in pairs)
    print(
        f"  c{conc}: median of ratios {100 * statistics.median(ratios):.1f}% (range "
        f"{100 * min(ratios):.1f}-{100 * max(ratios):.1f}%); medians {http_med:.1f} / "
        f"{off_med:.1f} = {100 * http_med / off_med:.1f}%; "
        f"errors {sum(p['http']['errors'] for p in pairs)}"
    )
    return {
        "concurrency": conc,
        "cpu_us_per_token": cpu_table(pairs),
        "pairs": pairs,
        "median_ratio": statistics.median(ratios),
        "ratio_of_medians": http_med / off_med,
        "http_tok_s": http_med,
        "offline_tok_s": off_med,
    }


def summary(servers: list[dict]) -> None:
    print(f"\n{'server flags':28s} {'streams':>7s} {'HTTP tok/s':>11s} {'offline':>9s} "
          f"{'HTTP/off':>9s} {'1-stream HTTP ms':>17s} {'offline ms':>11s}")  # fmt: skip
    for s in servers:
        single = s["single_stream"]
        for r in s["runs"]:
            print(f"{s['flags'] or 'default':28s} {r['concurrency']:7d} {r['http_tok_s']:11.1f} "
                  f"{r['offline_tok_s']:9.1f} {100 * r['median_ratio']:8.1f}% "
                  f"{single['http_ms']:17.2f} {single['offline_ms']:11.2f}")  # fmt: skip


def record_rows(servers: list[dict], args: argparse.Namespace) -> None:
    """One row set per shape (and model), each server's flags a row per concurrency and
    one for a single stream."""
    name = f"{args.shape} shape" if args.model is None else args.model.name
    rows = {}
    for s in servers:
        flags = s["flags"] or "default flags"
        for r in s["runs"]:
            rows[f"HTTP against offline, {r['concurrency']} streams, {flags}"] = (
                f"{100 * r['median_ratio']:.1f}% (median of {len(r['pairs'])} pairs; "
                f"{r['http_tok_s']:.0f} against {r['offline_tok_s']:.0f} tok/s)"
            )
        one = s["single_stream"]
        rows[f"one stream over HTTP against offline, {flags}"] = (
            f"{one['http_ms']:.2f} against {one['offline_ms']:.2f} ms a token "
            f"({one['http_ms'] / one['offline_ms']:.2f}x)"
        )
    record(f"serve_vs_offline ({name}, {args.dtype})", rows)


def cpu_table(pairs: list[dict]) -> dict[str, float]:
    """Median CPU µs per streamed token, by the server's roles and for the offline engine;
    prints them as a table."""
    roles = sorted({r for p in pairs for r in p["http"]["cpu_us_per_token"]})
    table = {
        r: statistics.median(p["http"]["cpu_us_per_token"].get(r, 0.0) for p in pairs)
        for r in roles
    }
    table["offline engine"] = statistics.median(p["offline_cpu_us_per_token"] for p in pairs)
    print("CPU µs per output token (medians; the server's from /proc, by role)")
    for role, us in table.items():
        print(f"  {role:<16} {us:8.1f}")
    engine = table.get("engine core")
    if engine:
        print(f"  engine core / offline engine: {engine / table['offline engine']:.2f}x")
    return table


def print_pair(i: int, pair: dict, conc: int) -> None:
    h = pair["http"]
    itl = h["itl_ms"]
    tail = f"{itl['p99'] / itl['p50']:.2f}x" if itl["p50"] else "-"
    print(
        f"pair {i + 1} ({'offline' if i % 2 else 'HTTP'} first): c{conc} HTTP "
        f"{h['output_tok_s']:.1f} tok/s, offline {pair['offline_tok_s']:.1f} = "
        f"{100 * h['output_tok_s'] / pair['offline_tok_s']:.1f}%; ITL p50 {itl['p50'] or 0:.1f} "
        f"p99 {itl['p99'] or 0:.1f} ms ({tail}); "
        f"{h['completed']} ok / {h['errors']} errors; client CPU {h['client_cpu_s']:.2f} s",
        flush=True,
    )


if __name__ == "__main__":
    main()
