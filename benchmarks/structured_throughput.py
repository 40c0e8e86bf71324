"""What structured outputs cost a served batch: 16 concurrent JSON-Schema requests against
16 unconstrained ones, on one server, in alternating rounds (medians).

Both waves generate the same number of tokens, `--max-tokens` per request: the
unconstrained requests with ignore_eos, the constrained ones under a schema whose
document is longer than that (an array of `--items` short strings), so every request of
both waves runs to max_tokens and the waves differ only in the grammar's work. Output
tokens per second of each wave = completion tokens / the wave's wall time; the ratio is
the target (>= 90%).

Prints a table and writes JSON (--out).

    PYTHONPATH=. .venv/bin/python benchmarks/structured_throughput.py [--server-args "..."]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from service.bench_cli import spawn
from service.bench_report import cpu_model, write_report

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "List some words:"


def schema(items: int, kind: str = "strings") -> dict[str, Any]:
    """strings: short strings with length bounds (the mask's costly case: every token is
    checked against the characters left); records: objects of a patterned id, a bounded
    integer, an enum and a boolean (mostly the grammar's own structure)."""
    item: dict[str, Any] = {"type": "string", "minLength": 3, "maxLength": 8}
    if kind == "records":
        item = {
            "type": "object",
            "properties": {
                "id": {"type": "string", "pattern": "^[a-z]{2}[0-9]{3}$"},
                "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                "size": {"enum": ["S", "M", "L"]},
                "ok": {"type": "boolean"},
            },
            "required": ["id", "qty", "size", "ok"],
            "additionalProperties": False,
        }
    return {"type": "array", "items": item, "minItems": items, "maxItems": items}


async def wave(url: str, body: dict[str, Any], n: int) -> tuple[int, float, list[str]]:
    """n requests at once: completion tokens, wall seconds, finish reasons."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        t0 = time.perf_counter()
        rs = await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(n)))
        dt = time.perf_counter() - t0
    for r in rs:
        r.raise_for_status()
    done = [r.json() for r in rs]
    tokens = sum(d["usage"]["completion_tokens"] for d in done)
    return tokens, dt, [d["choices"][0]["finish_reason"] for d in done]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server-args", default="", help="kvserve serve flags (default: demo model)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--items", type=int, default=200)
    ap.add_argument("--schema", choices=["strings", "records"], default="strings")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/out/structured_throughput.json"))
    args = ap.parse_args()
    proc, url = spawn(args.server_args)
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    base = {"model": model, "prompt": PROMPT, "temperature": 1.0}
    free = base | {"max_tokens": args.max_tokens, "ignore_eos": True}
    guided = base | {"max_tokens": args.max_tokens, "guided_json": schema(args.items, args.schema)}
    runs: dict[str, list[dict[str, Any]]] = {"unconstrained": [], "json_schema": []}
    try:
        asyncio.run(wave(url, guided, 2))  # warm-up: the token table and the grammar
        asyncio.run(wave(url, free, 2))
        for _ in range(args.rounds):
            for name, body in (("unconstrained", free), ("json_schema", guided)):
                tokens, dt, reasons = asyncio.run(wave(url, body, args.concurrency))
                runs[name].append({"tokens": tokens, "seconds": dt, "tok_s": tokens / dt,
                                   "finish": sorted(set(reasons))})  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(30)
    med = {k: statistics.median(r["tok_s"] for r in v) for k, v in runs.items()}
    report = {
        "cpu": cpu_model(),
        "server_args": args.server_args,
        "schema": args.schema,
        "concurrency": args.concurrency,
        "runs": runs,
        "median_tok_s": med,
        "ratio": med["json_schema"] / med["unconstrained"],
    }
    print(f"{args.concurrency} concurrent, {args.rounds} rounds each, alternating ({model}, "
          f"schema {args.schema})")  # fmt: skip
    for name, v in runs.items():
        toks = statistics.median(r["tokens"] for r in v)
        print(f"  {name:<14} {med[name]:8.1f} tok/s  (median {toks:.0f} tokens a wave, "
              f"finish {v[0]['finish']})")  # fmt: skip
    print(f"  json_schema / unconstrained: {100 * report['ratio']:.1f}%")
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
