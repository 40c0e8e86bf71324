"""One engine step of the SmolLM2-135M-shaped checkpoint (bf16, packed weights) with each
attention path kvserve has for the paged cache, on the step shapes the scheduler makes:

- `tiles`:  model/kernels/paged_attention.c on the AMX tile unit (bf16, block size 16),
  with the layers as one C call (model/kernels/stack.c), as the engine runs them here
- `vector`: the same kernel's vector code (CPUs without AMX, float32 caches), layer by
  layer through the modules
- `gather`: gather the blocks and run SDPA (where no kernel applies: CUDA, no C compiler);
  queries are padded within groups (the decodes together, each longer query alone)

Times one forward (best of --repeats). Prints a table and writes JSON.

    python benchmarks/attention_paths.py
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import torch

import model.attention as attention
from model.attention import AttentionMetadata, PagedKVCache
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
        meta = AttentionMetadata.paged(tables, cached, new, BLOCK, pad_block=cache.null_block)
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
    model.pack_weights()
    cache = PagedKVCache(model.cfg, 2048, BLOCK, torch.bfloat16, "cpu")
    kernel, supported = attention.paged_attention, attention.paged_attention_supported
    stack = model._stack  # the one-call layers run the tile kernel only
    paths = {
        "tiles": (kernel, supported, stack),
        "vector": (functools.partial(kernel, use_amx=False), supported, None),
        "gather": (kernel, lambda *a: False, None),
    }
    rows = []
    print(f"{'step':36s} {'tiles ms':>10s} {'vector ms':>10s} {'gather ms':>10s}")
    for label, cached, new in STEPS:
        row = {"step": label, "tokens": sum(new)}
        for name, (fn, check, layers) in paths.items():
            attention.paged_attention, attention.paged_attention_supported = fn, check
            model._stack = layers
            row[f"{name}_ms"] = step_ms(model, cache, cached, new, args.repeats)
        attention.paged_attention, attention.paged_attention_supported = kernel, supported
        model._stack = stack
        rows.append(row)
        print(
            f"{label:36s} {row['tiles_ms']:10.1f} {row['vector_ms']:10.1f} {row['gather_ms']:10.1f}"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"threads": torch.get_num_threads(), "steps": rows}, indent=2))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
