"""Serving over HTTP against the offline engine, alternated in one sitting (issue #6's 90%).

Starts `kvserve serve` on the checkpoint, loads the same checkpoint (same tokenizer, same
dtype) into an engine in this process, and alternates: a closed-loop streaming HTTP run
at the concurrency (service/bench.py's client), and the offline engine through the same
waves (the same number of requests, `max_num_seqs` = the concurrency, submitted at once,
and the server's cap on prompt tokens in a step with decodes).
Pairs take turns going first, so a drift in the machine's speed falls on both sides; each
run draws fresh prompts, so no run finds the last one's prefixes cached. On a shared
machine two commands minutes apart differ on their own; this measures both sides within
seconds of each other. Prints every pair and the medians; writes JSON.

    PYTHONPATH=. .venv/bin/python benchmarks/serve_vs_offline.py --concurrency 32 --pairs 6
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import OUT, SMOKE, SMOLLM2_135M, checkpoint, run_batch
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
        choices=["smollm2-135m", "tiny"],
        default="smollm2-135m",
        help="tiny: 2 layers of 64 features, whose forward costs little, so the host's work "
        "per token dominates as on a GPU (the CPU proxy for the serving path)",
    )
    ap.add_argument("--serve-args", default="", help="more `kvserve serve` flags")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=None, help="per run (default 4 x conc.)")
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
    shape = SMOKE if args.shape == "tiny" else SMOLLM2_135M
    path = args.model or checkpoint(OUT / f"{args.shape}-random", shape)
    conc, n = args.concurrency, args.requests or 4 * args.concurrency

    serve_args = (
        f"--model {shlex.quote(str(path))} --dtype {args.dtype} --max-num-seqs {max(64, conc)} "
        f"--kv-cache-gib {args.kv_cache_gib} {args.serve_args}"
    )
    if args.mixed_prefill_tokens is not None:
        serve_args += f" --mixed-prefill-tokens {args.mixed_prefill_tokens}"
    proc, url = spawn(serve_args)
    try:
        device = pick_device("auto")
        loaded = load(path, pick_dtype(args.dtype, device), device)
        settings = Settings(
            max_num_seqs=conc,
            kv_cache_gib=args.kv_cache_gib,
            mixed_prefill_tokens=args.mixed_prefill_tokens,
        )
        cap = settings.engine.scheduler.mixed_prefill_cap(device.type)
        print(f"prompt tokens in a step with decodes, both sides: {cap or 'no cap'}")
        engine = LLMEngine.build(loaded.model, loaded.tokenizer, settings.engine)
        vocab = loaded.model.cfg.vocab_size
        gc.freeze()  # the model and engine stay out of the HTTP client's collections

        def prompts(seed: int) -> list[tuple[list[int], int]]:
            return bench.workload("fixed", n, args.prompt_len, args.output_len, vocab, seed)

        def offline(seed: int) -> tuple[float, float]:
            """Output tokens a second, and CPU µs per output token."""
            reqs = prompts(seed)
            cpu = time.process_time()
            run = run_batch(engine, [p for p, _ in reqs], args.output_len)
            return run["output_tok_s"], 1e6 * (time.process_time() - cpu) / run["output_tokens"]

        def http(seed: int) -> dict:
            """The run's figures, and the server's CPU µs per output token by role."""
            work = bench.run(url, prompts(seed), conc, None, 600, None, None, seed)
            before = cpu_by_role(proc.pid)
            with bench.event_loop() as runner:
                result = runner.run(work)
            tokens = max(1, result["completed"] * args.output_len)
            spent_us = spent(before, cpu_by_role(proc.pid))
            return result | {"cpu_us_per_token": {r: 1e6 * s / tokens for r, s in spent_us.items()}}

        offline(10_000)  # warm-up of both sides, not counted
        http(10_001)
        pairs = []
        for i in range(args.pairs):
            seed = 2 * i + 1
            if i % 2:
                off, off_cpu = offline(seed)
                served = http(seed + 1)
            else:
                served = http(seed + 1)
                off, off_cpu = offline(seed)
            pairs.append(
                {"http": served, "offline_tok_s": off, "offline_cpu_us_per_token": off_cpu}
            )
            print_pair(i, pairs[-1], conc)
    finally:
        proc.terminate()
        proc.wait(60)

    ratios = [p["http"]["output_tok_s"] / p["offline_tok_s"] for p in pairs]
    http_med = statistics.median(p["http"]["output_tok_s"] for p in pairs)
    off_med = statistics.median(p["offline_tok_s"] for p in pairs)
    print(
        f"median of ratios {100 * statistics.median(ratios):.1f}% (range "
        f"{100 * min(ratios):.1f}-{100 * max(ratios):.1f}%); medians {http_med:.1f} / "
        f"{off_med:.1f} = {100 * http_med / off_med:.1f}%; "
        f"errors {sum(p['http']['errors'] for p in pairs)}"
    )
    cpu = cpu_table(pairs)
    result = {
        "cpu_us_per_token": cpu,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "threads": torch.get_num_threads(),
        "pairs": pairs,
        "median_ratio": statistics.median(ratios),
        "ratio_of_medians": http_med / off_med,
        "mixed_prefill_tokens": cap,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    if any(p["http"]["errors"] for p in pairs):
        sys.exit(1)
    if args.record:
        name = f"{args.shape} shape" if args.model is None else args.model.name
        extra = f", {args.serve_args.strip()}" if args.serve_args.strip() else ""
        # one row set per shape and server flags: each keeps its own latest run
        variant = "" if args.shape == "smollm2-135m" and not extra else f" ({name}{extra})"
        record(
            f"serve_vs_offline{variant}",
            {
                f"HTTP against offline, {name}, {args.dtype}, {conc} streams{extra}": (
                    f"{100 * result['median_ratio']:.1f}% (median of {len(pairs)} pairs; "
                    f"{http_med:.0f} against {off_med:.0f} tok/s)"
                )
            },
        )


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
