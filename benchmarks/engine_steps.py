"""The offline engine's step times, one row per dtype: the measurement behind the
instruction-set levels' table in docs/kernels.md (run it under
`KVSERVE_CPU_ISA=avx2|avx512f|avx512-bf16` to force a level below the CPU's own).

The engine is built from `Settings` as the server builds it (the checkpoint, --dtype,
--quantization), then each of --rounds rounds times, greedy with `ignore_eos`:

  batch 1    one request of --prompt-len random tokens: its prefill step, and the median
             of its --output-len decode steps
  batch 16   16 such requests at once: the first step (all their prompt tokens) and the
             median decode step
  long       one request of --long tokens: its prefill step (0: skipped)
  decode at  for each of --decode-at's contexts, one request of that many prompt tokens:
             the median of its --output-len decode steps (a long context's attention).
             Where the checkpoint's config allows fewer positions, it is timed through a
             copy of the config that allows them (the weights linked, not copied; RoPE
             itself has no limit, and random weights have no trained one)

The table has the medians over the rounds; the JSON every round's values.

    PYTHONPATH=. .venv/bin/python benchmarks/engine_steps.py --dtype bfloat16 float32
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import OUT
from model.backends.cpu.isa import cpu_isa
from model.backends.device import DTYPES
from service.build import build
from service.config import Settings
from service.engine.request import SamplingParams

MODEL = Path(__file__).resolve().parents[1].parent / "peers" / "models" / "llama-cl100k-135m"
COLUMNS = ("batch1_prefill", "batch1_decode", "batch16_first", "batch16_decode", "long_prefill")


def steps(engine, rng: random.Random, n: int, prompt: int, out: int) -> list[float]:
    """Seconds of each engine step until n requests of `prompt` tokens finish."""
    params = SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)
    for i in range(n):
        ids = [rng.randrange(1000, 50000) for _ in range(prompt)]
        engine.add_request(f"r{time.monotonic_ns()}-{i}", ids, params)
    times = []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return times


def with_positions(model: Path, positions: int, tmp: Path) -> Path:
    """`model`, or where its config.json allows fewer than `positions` tokens, a folder in
    tmp with its files linked and a config.json that allows them."""
    config = json.loads((model / "config.json").read_text())
    if config.get("max_position_embeddings", 0) >= positions:
        return model
    longer = tmp / model.name
    longer.mkdir()
    for f in model.iterdir():
        if f.name != "config.json":
            (longer / f.name).symlink_to(f.resolve())
    (longer / "config.json").write_text(
        json.dumps({**config, "max_position_embeddings": positions})
    )
    return longer


def measure(args: argparse.Namespace, dtype: str) -> dict[str, list[float]]:
    settings = Settings(
        model=str(args.model),
        dtype=dtype,
        quantization=args.quantization,
        max_num_seqs=16,
        max_num_batched_tokens=max(2048, args.long, 16 * args.prompt_len, *args.decode_at),
        kv_cache_gib=1.0,
    )
    engine = build(settings).engine
    rng = random.Random(0)
    steps(engine, rng, 1, 16, 4)  # warm-up
    rows: dict[str, list[float]] = {c: [] for c in COLUMNS}
    rows |= {f"decode_at_{n}": [] for n in args.decode_at}
    for _ in range(args.rounds):
        one = steps(engine, rng, 1, args.prompt_len, args.output_len)
        rows["batch1_prefill"].append(one[0])
        rows["batch1_decode"].append(statistics.median(one[1:]))
        many = steps(engine, rng, 16, args.prompt_len, args.output_len)
        rows["batch16_first"].append(many[0])
        rows["batch16_decode"].append(statistics.median(many[1:]))
        if args.long:
            rows["long_prefill"].append(steps(engine, rng, 1, args.long, 1)[0])
        for n in args.decode_at:
            rows[f"decode_at_{n}"].append(
                statistics.median(steps(engine, rng, 1, n, args.output_len)[1:])
            )
    engine.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, default=MODEL, help="a Hugging Face checkpoint")
    ap.add_argument("--dtype", nargs="+", default=["bfloat16"], choices=list(DTYPES))
    ap.add_argument("--quantization", default="none", choices=["none", "int8", "int4"])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--long", type=int, default=2040, help="long prompt's tokens (0: none)")
    ap.add_argument("--decode-at", type=int, nargs="*", default=[], help="contexts (tokens)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=OUT / "engine_steps.json")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        if args.decode_at:
            positions = max(args.decode_at) + args.output_len
            args.model = with_positions(args.model, positions, Path(tmp))
        results = {d: measure(args, d) for d in args.dtype}
    print(f"kernels: {cpu_isa()}; quantization {args.quantization}; medians of {args.rounds}")
    at = "".join(f" decode step at {n:,} |" for n in args.decode_at)
    print("| dtype | batch 1 prefill | batch 1 decode step | batch 16 first step "
          f"| batch 16 decode step | long prefill |{at}")  # fmt: skip
    print("|---|---|---|---|---|---|" + "---|" * len(args.decode_at))
    for dtype, rows in results.items():
        cells = [f"{1000 * statistics.median(v):,.1f} ms" if v else "-" for v in rows.values()]
        print(f"| {dtype} | " + " | ".join(cells) + " |")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    report = {"isa": cpu_isa(), "quantization": args.quantization, "seconds": results}
    args.json.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
