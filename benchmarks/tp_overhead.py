"""What tensor parallelism costs per token on this machine (gloo between processes).

Runs kvserve's engine on one rank and on --ranks ranks (this script starts the ranks, as
`kvserve serve` does; the cores split evenly between them), same model, same greedy
single-stream decode, and on the ranks also times the collectives alone:

  all-reduce     one all-reduce of a decode step's hidden state (1, d_model), the
                 operation a rank runs 2 x layers + 1 times per token
  all-gather     the logits' all-gather (1, padded vocab), once per token
  per token      2 x layers + 1 all-reduces + the all-gather: the collectives' share of
                 a decode step
  decode         ms per output token, single stream, one rank against the ranks

A machine with few cores cannot show a speed-up (the ranks split the same cores); the
point here is the overhead the collectives add. `kvserve plan --tensor-parallel-size N`
gives the bytes they move for a GPU config. Prints a table and writes JSON (--out).

    PYTHONPATH=. .venv/bin/python benchmarks/tp_overhead.py [--model DIR] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from service.bench_report import cpu_model
from service.launch import rendezvous

ROOT = Path(__file__).resolve().parents[1]


def _settings(args: argparse.Namespace, world: int):  # type: ignore[no-untyped-def]
    from service.config import Settings

    return Settings(
        model=args.model,
        dtype=args.dtype,
        tensor_parallel_size=world,
        max_num_seqs=1,
        kv_cache_gib=0.25,
    )


def _decode_ms(engine, args: argparse.Namespace) -> float:  # type: ignore[no-untyped-def]
    """Median ms per output token of greedy single-stream decodes (after a warm-up)."""
    from service.engine.request import SamplingParams

    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    prompt = [(13 * i + 7) % 1000 + 3 for i in range(args.prompt_len)]
    runs = []
    for i in range(args.repeats + 1):
        engine.add_request(f"r{i}", prompt, params)
        engine.step()  # the prefill (and first token)
        t0, n = time.perf_counter(), 0
        while engine.has_unfinished():
            n += len(engine.step())
        if i:  # the first run warms up
            runs.append(1000 * (time.perf_counter() - t0) / n)
    return statistics.median(runs)


def _collectives(tp, cfg, dtype: torch.dtype, n: int = 2000) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Median microseconds of one all-reduce of (1, d_model) and one logits all-gather."""
    x = torch.zeros(1, cfg.d_model, dtype=dtype)
    logits = torch.zeros(1, tp.shares(cfg).vocab_rows, dtype=dtype)
    out: dict[str, float] = {}
    for name, fn in (
        ("allreduce_us", lambda: tp.all_reduce(x)),
        ("allgather_us", lambda: tp.gather_vocab(logits, cfg.vocab_size)),
    ):
        for _ in range(50):
            fn()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n // 5):
                fn()
            times.append(1e6 * (time.perf_counter() - t0) / (n // 5))
        out[name] = statistics.median(times)
    return out


@torch.inference_mode()
def rank_main(args: argparse.Namespace) -> int:
    """One rank (RANK etc. in the environment); rank 0 writes its measurements to --out."""
    from service.build import build

    world = int(os.environ["WORLD_SIZE"])
    engine = build(_settings(args, world)).engine
    model = engine.model
    report: dict[str, Any] = {}
    if world > 1:
        report |= _collectives(model.tp, model.cfg, model.dtype)
        if model.tp.rank:
            engine.follow()
            return 0
    report["decode_ms"] = _decode_ms(engine, args)
    report["threads"] = torch.get_num_threads()
    engine.close()
    Path(args.out).write_text(json.dumps(report))
    return 0


def run(args: argparse.Namespace, world: int, out: Path) -> dict[str, Any]:
    env = os.environ | rendezvous(world) | {"PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, __file__, "--rank-of", str(world), "--out", str(out)]
    cmd += ["--dtype", args.dtype, "--output-len", str(args.output_len)]
    cmd += ["--prompt-len", str(args.prompt_len), "--repeats", str(args.repeats)]
    cmd += ["--model", args.model] if args.model else []
    procs = [
        subprocess.Popen(cmd, env=env | {"RANK": str(r), "LOCAL_RANK": str(r)})
        for r in range(world)
    ]
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"a rank of {world} failed (status {p.returncode})")
    return json.loads(out.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: the demo model)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/out/tp_overhead.json"))
    ap.add_argument("--rank-of", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_of:
        return rank_main(args)
    from model.demo import demo_config
    from model.weights import load_config

    cfg = load_config(args.model) if args.model else demo_config()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    one = run(args, 1, out.with_suffix(".1.json"))
    many = run(args, args.ranks, out.with_suffix(f".{args.ranks}.json"))
    per_token_us = (2 * cfg.n_layers + 1) * many["allreduce_us"] + many["allgather_us"]
    report = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "model": cfg.name,
        "dtype": args.dtype,
        "ranks": args.ranks,
        "one_rank": one,
        "ranks_run": many,
        "collectives_per_token_us": per_token_us,
        "collective_share_of_step": per_token_us / 1000 / many["decode_ms"],
    }
    rows = [
        ("all-reduce (1, d_model)", f"{many['allreduce_us']:.1f} us"),
        ("logits all-gather", f"{many['allgather_us']:.1f} us"),
        (f"per token ({2 * cfg.n_layers + 1} all-reduces + 1 gather)", f"{per_token_us / 1000:.3f} ms"),
        (f"decode, 1 rank ({one['threads']} threads)", f"{one['decode_ms']:.2f} ms/token"),
        (f"decode, {args.ranks} ranks ({many['threads']} threads each)", f"{many['decode_ms']:.2f} ms/token"),
        ("collectives' share of a TP decode step", f"{100 * report['collective_share_of_step']:.0f}%"),
    ]  # fmt: skip
    print(f"{report['cpu']}, {report['cores']} cores; {cfg.name} {args.dtype}")
    for name, value in rows:
        print(f"  {name:<48} {value:>14}")
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
