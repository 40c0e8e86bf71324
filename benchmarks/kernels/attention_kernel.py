"""kvserve's paged attention kernel on its own, for decode steps with the K/V in memory.

Decode rows (one query token per sequence) of the 180M Llama-3-style checkpoint's shape
(9 query heads over 3 K/V heads of 64 channels, bf16 cache, 16-token blocks), each
sequence `--context` tokens long, its blocks scattered over the pool as the block
manager leaves them. Each of `--layers` layers has its own cache, so a pass reads every
layer's K/V from memory the way a decode step does (16 rows at 192 tokens: 71 MB); the
`hot` column repeats one layer's cache instead (it stays in cache: the compute alone).
Times one pass over the layers (median of --repeats) per row count, next to the time the
K/V bytes take at the measured read bandwidth. `--prefill`: then one prompt of each
length, every one of its tokens a query row over the tokens up to it (a prefill step's
attention; the prompt's K/V, just written, are in cache), with the GFLOP/s of its
multiply-adds. Prints tables and writes JSON.

    PYTHONPATH=. .venv/bin/python benchmarks/kernels/attention_kernel.py --rows 1 4 16 64 --prefill 128 512 2040
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import OUT
from model.backends.cpu.kernels.attention import (
    attention_isa,
    paged_attention,
    paged_attention_supported,
)
from model.backends.machine import memory_bandwidth

KV, GROUP, D, BLOCK = 3, 3, 64, 16


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--context", type=int, default=192)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--prefill", type=int, nargs="*", default=[], help="prompt lengths")
    ap.add_argument("--json", type=Path, default=OUT / "attention_kernel.json")
    args = ap.parse_args()
    probe = torch.empty(1, KV, D // 2, BLOCK, 2, dtype=torch.bfloat16)
    if not paged_attention_supported(probe, KV * GROUP, KV, D):
        raise SystemExit("kvserve's attention kernel is not built on this CPU")
    bandwidth = memory_bandwidth(mib=1024)
    isa = attention_isa(D, BLOCK, GROUP, torch.bfloat16)
    print(
        f"kernel: {isa}; threads {torch.get_num_threads()}; read bandwidth {bandwidth / 1e9:.1f} GB/s"
    )
    print(
        f"{'rows':>5} {'context':>8} {'ms':>8} {'hot ms':>8} {'K/V MB':>8} {'bytes ms':>9} {'x bytes':>8}"
    )
    runs = []
    for rows in args.rows:
        run = measure(rows, args.context, args.layers, args.repeats)
        run["bytes_ms"] = 1000 * run["kv_bytes"] / bandwidth
        runs.append(run)
        print(
            f"{rows:5d} {args.context:8d} {run['ms']:8.3f} {run['hot_ms']:8.3f} "
            f"{run['kv_bytes'] / 1e6:8.1f} {run['bytes_ms']:9.3f} {run['ms'] / run['bytes_ms']:7.2f}x"
        )
    prefills = [prefill(n, args.layers, args.repeats) for n in args.prefill]
    if prefills:
        print(f"\n{'prompt':>7} {'layers':>7} {'ms':>8} {'GFLOP/s':>8}")
    for run in prefills:
        print(f"{run['prompt']:7d} {args.layers:7d} {run['ms']:8.1f} {run['gflop_s']:8.1f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    result = {"kernel": isa, "bandwidth_gb_s": bandwidth / 1e9, "runs": runs,
              "prefill": prefills}  # fmt: skip
    args.json.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.json}")


def measure(rows: int, context: int, layers: int, repeats: int) -> dict[str, float]:
    torch.manual_seed(0)
    blocks = -(-context // BLOCK)
    pool = rows * blocks + 8

    def cache(*shape: int) -> torch.Tensor:
        return torch.randn(pool, KV, *shape).to(torch.bfloat16)

    ks = [cache(D // 2, BLOCK, 2) for _ in range(layers)]
    vs = [cache(BLOCK // 2, D, 2) for _ in range(layers)]
    tables = torch.randperm(pool)[: rows * blocks].view(rows, blocks).contiguous()
    lens = torch.full((rows,), context, dtype=torch.int64)
    q = torch.randn(rows, KV * GROUP, D).to(torch.bfloat16)

    def one_pass(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> float:
        start = time.perf_counter()
        for k, v in zip(k_caches, v_caches, strict=True):
            paged_attention(q, k, v, tables, lens, D**-0.5)
        return time.perf_counter() - start

    def median_ms(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> float:
        one_pass(k_caches, v_caches)
        return 1000 * statistics.median(one_pass(k_caches, v_caches) for _ in range(repeats))

    return {
        "rows": rows,
        "context": context,
        "ms": median_ms(ks, vs),
        "hot_ms": median_ms(ks[:1] * layers, vs[:1] * layers),
        "kv_bytes": 2 * layers * rows * context * KV * D * 2,
    }


def prefill(n: int, layers: int, repeats: int) -> dict[str, float]:
    """One prompt of n tokens, each a query row over the tokens up to it; one layer's
    cache, `layers` calls."""
    torch.manual_seed(0)
    blocks = -(-n // BLOCK)
    k = torch.randn(blocks + 8, KV, D // 2, BLOCK, 2).to(torch.bfloat16)
    v = torch.randn(blocks + 8, KV, BLOCK // 2, D, 2).to(torch.bfloat16)
    tables = torch.randperm(blocks + 8)[:blocks].view(1, blocks).contiguous()
    q = torch.randn(n, KV * GROUP, D).to(torch.bfloat16)
    lens, row_seq = torch.arange(1, n + 1), torch.zeros(n, dtype=torch.int64)

    def one_pass() -> float:
        start = time.perf_counter()
        for _ in range(layers):
            paged_attention(q, k, v, tables, lens, D**-0.5, None, row_seq)
        return time.perf_counter() - start

    one_pass()
    ms = 1000 * statistics.median(one_pass() for _ in range(max(3, repeats // 5)))
    flop = layers * KV * GROUP * 4 * D * n * (n + 1) / 2  # q.k and p.v: 2 D each per (row, key)
    return {"prompt": n, "ms": ms, "gflop_s": flop / ms / 1e6}


if __name__ == "__main__":
    main()
