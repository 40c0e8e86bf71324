"""One engine step of the SmolLM2-135M-shaped checkpoint (bf16, packed weights) with each
CPU execution backend (model/backends), on the step shapes the scheduler makes:

- `cpu`: the C kernels (the ISA they chose is printed), with the layers as one C call
  (model/kernels/stack.c) where it takes the model (AMX), as the engine runs them
- `cpu_layers`: the same kernels layer by layer through the modules
- `torch`: the reference backend: gather the blocks and run SDPA; queries are padded
  within groups (the decodes together, each longer query alone)

Times one forward (best of --repeats). Prints a table and writes JSON.

    python benchmarks/attention_paths.py
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from model.backends import select_backend
from model.kv_cache import PagedKVCache
from model.weights import load_model

OUT = Path(__file__).parent / "out"
BLOCK = 16
# (label, cached tokens per sequence, new tokens per sequence)
STEPS = [
    ("64 decodes at 200 tokens", [200] * 64, [1] * 64),
    ("16 prompts x 128 (fresh)", [0] * 16, [128] * 16),
    ("16 decodes + 15 prompts x 128", [130] * 16 + [0] * 15, [1] * 16 + [128] * 15),
    ("1 prompt x 2048", [0], [2048]),
    ("512-token chunk after 1536 cached", [1536], [512]),
    ("63 decodes + 1985-token chunk", [200] * 63 + [0], [1] * 63 + [1985]),
]


def step_ms(model, cache, cached, new, repeats: int) -> float:
    tables, nxt = [], 0
    for c, n in zip(cached, new, strict=True):
        count = -(-(c + n) // BLOCK)
        tables.append(list(range(nxt, nxt + count)))
        nxt += count
    tokens = torch.randint(0, model.cfg.vocab_size, (sum(new),))
    best = float("inf")
    for _ in range(repeats):
        meta = cache.backend.metadata(tables, cached, new, BLOCK, "cpu", cache.null_block)
        start = time.perf_counter()
        with torch.inference_mode():
            model(tokens, meta, cache, torch.tensor([0]))
        best = min(best, time.perf_counter() - start)
    return 1000 * best


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, default=OUT / "smollm2-135m-random")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=OUT / "attention_paths.json")
    args = ap.parse_args()
    if not (args.model / "config.json").exists():
        raise SystemExit(f"{args.model}: run benchmarks/offline_throughput.py once to write it")
    model = load_model(args.model, dtype=torch.bfloat16)
    cpu = select_backend("cpu", torch.device("cpu"), torch.bfloat16, model.cfg, BLOCK)
    cpu.prepare(model)  # packed weights, and the one-call stack where it takes the model
    stack = model._stack
    caches = {
        name: PagedKVCache(model.cfg, 2048, BLOCK, torch.bfloat16, "cpu", backend)
        for name, backend in (
            ("cpu", cpu),
            ("cpu_layers", cpu),
            (
                "torch",
                select_backend("torch", torch.device("cpu"), torch.bfloat16, model.cfg, BLOCK),
            ),
        )
    }
    print(f"cpu backend: {cpu.describe()}")
    rows = []
    print(f"{'step':36s} " + " ".join(f"{name + ' ms':>14s}" for name in caches))
    for label, cached, new in STEPS:
        row = {"step": label, "tokens": sum(new)}
        for name, cache in caches.items():
            model._stack = stack if name == "cpu" else None
            row[f"{name}_ms"] = step_ms(model, cache, cached, new, args.repeats)
        model._stack = stack
        rows.append(row)
        print(f"{label:36s} " + " ".join(f"{row[name + '_ms']:14.1f}" for name in caches))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    report = {"threads": torch.get_num_threads(), "cpu_backend": cpu.describe(), "steps": rows}
    args.json.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
