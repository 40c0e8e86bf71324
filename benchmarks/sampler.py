"""What one sampler call costs: `Sampler.sample` over a batch of bf16 logits the size of
a served vocabulary, per sampling configuration (medians of --repeats calls, each on a
fresh copy of the logits, as the sampler consumes its input). Peaked logits (x8) stand
in for a trained model's distribution, whose top_p mass lies in a few hundred tokens;
plain normal logits for a random model's flat one.

Prints a table and writes JSON (--out).

    PYTHONPATH=. .venv/bin/python benchmarks/sampler.py [--vocab 128256] [--rows 1 16 64]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from service.bench_report import cpu_model, write_report
from service.engine.request import Request, SamplingParams
from service.engine.sampler import Sampler

OUT = Path(__file__).parent / "out" / "sampler.json"
CONFIGS: dict[str, dict[str, object]] = {
    "greedy": {"temperature": 0.0},
    "greedy, logprobs 5": {"temperature": 0.0, "logprobs": 5},
    "temperature 1": {"temperature": 1.0},
    "temperature 0.7": {"temperature": 0.7},
    "top_k 50": {"temperature": 1.0, "top_k": 50},
    "top_p 0.9": {"temperature": 1.0, "top_p": 0.9},
    "min_p 0.05": {"temperature": 1.0, "min_p": 0.05},
}


def time_call(sampler: Sampler, logits: torch.Tensor, params: dict, repeats: int) -> float:
    rows = logits.shape[0]
    requests = [Request(f"r{i}", [1], SamplingParams(**params), 0.0) for i in range(rows)]
    copies = [logits.clone() for _ in range(repeats + 2)]
    sampler.sample(copies.pop(), requests, [None] * rows)  # warm-up
    times = []
    for given in copies[:repeats]:
        t0 = time.perf_counter()
        sampler.sample(given, requests, [None] * rows)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=128_256)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()

    sampler = Sampler(args.vocab, torch.device("cpu"))
    rows_out = []
    print(f"CPU: {cpu_model()}, {torch.get_num_threads()} threads; vocab {args.vocab}; bf16")
    print(f"{'config':<20} {'logits':<7}" + "".join(f" {f'{b} rows ms':>11}" for b in args.rows))
    for name, params in CONFIGS.items():
        for shape, scale in (("peaked", 8.0), ("flat", 1.0), ("1 flat", 8.0)):
            if shape != "peaked" and "top_p" not in params:
                continue  # only top_p's cost depends on the distribution's shape
            ms = {}
            for b in args.rows:
                g = torch.Generator().manual_seed(b)
                logits = torch.randn(b, args.vocab, generator=g) * scale
                if shape == "1 flat":  # one row of the batch flat, the others peaked
                    logits[0] /= scale
                logits = logits.bfloat16()
                ms[b] = time_call(sampler, logits, params, args.repeats)
            rows_out.append({"config": name, "logits": shape, "ms": ms})
            print(f"{name:<20} {shape:<7}" + "".join(f" {ms[b]:>11.2f}" for b in args.rows))
    write_report(args.out, {"cpu": cpu_model(), "args": vars(args), "rows": rows_out})


if __name__ == "__main__":
    main()
