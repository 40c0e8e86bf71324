"""What speculative decoding buys: single-stream decode with and without n-gram proposals
(and a draft model with --draft) on a copy-heavy and a random workload, and 16 requests
at once with speculation as served (it turns itself off above --speculative-max-batch)
and forced on at that size. Offline engine, greedy, ignore_eos; every configuration is
its own engine over the same weights, and they take turns for --rounds (medians).

Workloads, with a random-weight model in mind (it copies nothing it is not shown):
  copy     16 random tokens, then a 48-token random span three times, greedy
  random   160 random tokens, greedy; a random model's greedy output falls into loops
           of its own (often one token repeated), which the lookup finds too
  sampled  160 random tokens at temperature 1: output that does not repeat, where
           drafts are almost never right and speculation costs what it costs

Single stream: decode ms/token = (last token's time - first token's) / (tokens - 1), so
the prefill is left out. 16 at once: all output tokens / wall time, prefills included.
Prints a table and writes JSON.

    PYTHONPATH=. .venv/bin/python benchmarks/spec_decode.py --model ../peers/models/llama-cl100k-135m
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time
from typing import Any

import torch

from benchmarks.common import OUT
from model.demo import init_weights
from model.loader import load
from model.transformer import Transformer
from service.bench_report import cpu_model, write_report
from service.config import Settings
from service.engine.core.engine import LLMEngine
from service.engine.request import SamplingParams


def prompts(kind: str, n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if kind == "copy":
            span = [rng.randrange(vocab) for _ in range(48)]
            out.append([rng.randrange(vocab) for _ in range(16)] + span * 3)
        else:
            out.append([rng.randrange(vocab) for _ in range(160)])
    return out


def random_draft(model: Transformer, layers: int) -> Transformer:
    """A random model of the model's shape with `layers` layers (the same vocabulary)."""
    draft = Transformer(dataclasses.replace(model.cfg, n_layers=layers))
    init_weights(draft, seed=1)
    return draft.to(model.dtype).eval()


def run(
    engine: LLMEngine, batch: list[list[int]], max_tokens: int, temperature: float
) -> dict[str, float]:
    """All of `batch` at once, to the end: wall seconds, decode ms/token of the first
    request, the drafts verified and accepted, engine steps."""
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True)
    stats = engine.stats
    drafted, accepted = stats.spec_draft_tokens, stats.spec_accepted_tokens
    t0 = time.perf_counter()
    for i, p in enumerate(batch):
        engine.add_request(f"r{i}", p, params)
    first = last = None
    steps = tokens = 0
    while engine.has_unfinished():
        outs = engine.step()
        steps += 1
        now = time.perf_counter()
        for o in outs:
            tokens += len(o.token_ids)
            if o.request_id == "r0" and o.token_ids:
                first = first or now
                last = now
    wall = time.perf_counter() - t0
    assert first is not None and last is not None and tokens == max_tokens * len(batch)
    return {
        "wall_s": wall,
        "decode_ms": 1000 * (last - first) / (max_tokens - 1),
        "tok_s": tokens / wall,
        "drafted": stats.spec_draft_tokens - drafted,
        "accepted": stats.spec_accepted_tokens - accepted,
        "steps": steps,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="checkpoint directory (default: the demo model)")
    ap.add_argument("--draft", help="a draft model's directory: adds its rows")
    ap.add_argument(
        "--draft-layers",
        type=int,
        help="adds rows with a random draft model of the model's shape and N layers: what a "
        "draft model costs (its drafts are wrong; so are those of the model's own first N "
        "layers when its weights are random)",
    )
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrent", type=int, default=16)
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(OUT / "spec_decode.json"))
    args = ap.parse_args()

    dtype, device = getattr(torch, args.dtype), torch.device("cpu")
    loaded = load(args.model, dtype, device)
    drafts: dict[str, Transformer] = {}
    if args.draft:
        drafts["draft model"] = load(args.draft, dtype, device).model
    if args.draft_layers:
        drafts[f"draft, {args.draft_layers} layers"] = random_draft(loaded.model, args.draft_layers)
    vocab = loaded.model.cfg.vocab_size
    base = dict(max_num_seqs=args.concurrent, num_kv_blocks=2048)
    spec = dict(num_speculative_tokens=args.num_speculative_tokens)
    configs: dict[str, dict[str, Any]] = {
        "off": {},
        "ngram": dict(speculative_method="ngram", **spec),
        f"ngram, on at {args.concurrent}": dict(
            speculative_method="ngram", speculative_max_batch=args.concurrent, **spec
        ),
    }
    for name in drafts:
        configs[name] = dict(speculative_method="draft", speculative_model=name, **spec)
    engines = {
        name: LLMEngine.build(
            loaded.model, loaded.tokenizer, Settings(**base, **kw).engine, draft=drafts.get(name)
        )
        for name, kw in configs.items()
    }
    c = args.concurrent
    cases = [  # name, prompts, requests, temperature
        ("1 stream, copy", "copy", 1, 0.0),
        ("1 stream, random", "random", 1, 0.0),
        ("1 stream, sampled", "random", 1, 1.0),
        (f"{c} at once, copy", "copy", c, 0.0),
        (f"{c} at once, random", "random", c, 0.0),
        (f"{c} at once, sampled", "random", c, 1.0),
    ]
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    for r in range(args.rounds):
        for i, (case, kind, n, temp) in enumerate(cases):
            # prompts of their own per case and round: a case reusing another's would be
            # served from each engine's prefix cache
            batch = prompts(kind, n, vocab, seed=r * len(cases) + i)
            for name, engine in engines.items():
                if n == 1 and name.startswith("ngram, on at"):
                    continue  # the same as "ngram" for one stream
                got = run(engine, batch, args.max_tokens, temp)
                results.setdefault((case, name), []).append(got)

    rows = []
    for (case, name), runs in results.items():
        med = {key: statistics.median(x[key] for x in runs) for key in runs[0]}
        drafted = sum(x["drafted"] for x in runs)
        rows.append(
            {
                "case": case,
                "config": name,
                **med,
                "acceptance": sum(x["accepted"] for x in runs) / drafted if drafted else None,
                "tokens_per_step": args.max_tokens
                * (1 if case.startswith("1 ") else args.concurrent)
                / med["steps"],
            }
        )
    print(
        f"CPU: {cpu_model()}, {torch.get_num_threads()} threads; {args.dtype}; "
        f"{args.model or 'demo model'}; k = {args.num_speculative_tokens}; {args.rounds} rounds"
    )
    print(
        f"{'case':<22} {'config':<16} {'decode ms/tok':>13} {'tok/s':>8} {'accepted':>9} {'tok/step':>9}"
    )
    for row in rows:
        acc = f"{row['acceptance']:.0%}" if row["acceptance"] is not None else "-"
        print(
            f"{row['case']:<22} {row['config']:<16} {row['decode_ms']:>13.2f} "
            f"{row['tok_s']:>8.1f} {acc:>9} {row['tokens_per_step']:>9.2f}"
        )
    write_report(args.out, {"cpu": cpu_model(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
