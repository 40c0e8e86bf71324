"""What huge pages (model/pages.py) are worth to a CPU decode step, measured in one
process so that the memory's drift between sittings does not decide it: the engine is
built as the server builds it (weights and KV pool in huge-page arenas where Linux allows),
then each round runs one request (a --prompt-len random prompt, --output-len greedy tokens)
with the weights and KV pool where the engine put them and one with plain-page copies of
both, alternating which goes first. Reports the median decode step of each, per round and
overall; prints a table and writes JSON.

    PYTHONPATH=. .venv/bin/python benchmarks/huge_pages.py --rounds 6
    PYTHONPATH=. .venv/bin/python benchmarks/huge_pages.py --quantization int8 --prompt-len 2000
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

import torch

from benchmarks.engine_steps import steps
from model.device import cpu_isa
from model.layers import Linear
from model.pages import MADV_NOHUGEPAGE, huge_pages, madvise
from service.build import build
from service.config import Settings

OUT = Path(__file__).parent / "out"
MODEL = Path(__file__).resolve().parents[1].parent / "peers" / "models" / "llama-cl100k-135m"


def plain_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of t in 4 KB pages, also where THP runs in 'always' mode: the copy's whole
    pages are advised MADV_NOHUGEPAGE before they are written."""
    out = torch.empty_like(t)
    ptr, nbytes = out.data_ptr(), out.numel() * out.element_size()
    start = ptr + (-ptr % 4096)
    madvise(start, max(0, (ptr + nbytes - start) // 4096 * 4096), MADV_NOHUGEPAGE)
    return out.copy_(t)


def anon_huge_kb() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, default=MODEL, help="a Hugging Face checkpoint")
    ap.add_argument("--quantization", default="none", choices=["none", "int8"])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--json", type=Path, default=OUT / "huge_pages.json")
    args = ap.parse_args()
    if not huge_pages():
        raise SystemExit("no transparent huge pages here (or KVSERVE_HUGE_PAGES=0)")

    settings = Settings(
        model=str(args.model),
        dtype="bfloat16",
        quantization=args.quantization,
        max_num_seqs=1,
        max_num_batched_tokens=max(2048, args.prompt_len + 1),
        kv_cache_gib=1.0,
    )
    engine = build(settings).engine
    model, kv = engine.runner.model, engine.runner.kv_cache
    linears = [m for m in model.modules() if isinstance(m, Linear) and m._tiles is not None]
    placed = {
        "huge": ([m._tiles for m in linears], kv.data),
        "plain": ([plain_copy(m._tiles) for m in linears], plain_copy(kv.data)),
    }
    huge_kb = anon_huge_kb()

    def use(where: str) -> None:
        tiles, data = placed[where]
        for m, t in zip(linears, tiles, strict=True):
            m._tiles = t
        kv.data = data
        kv._layers = kv.backend.kv_views(data, model.cfg, kv.num_blocks + 1, kv.block_size)
        if model._stack is not None:
            model._stack._cache = None  # its layer arguments point at the old addresses

    rng = random.Random(0)

    def decode_ms() -> float:  # random prompts: no prefix-cache hits between runs
        times = steps(engine, rng, 1, args.prompt_len, args.output_len)
        return 1000 * statistics.median(times[1:])

    use("huge")
    decode_ms()  # warm-up
    runs: dict[str, list[float]] = {"huge": [], "plain": []}
    for r in range(args.rounds):
        for where in ("huge", "plain") if r % 2 == 0 else ("plain", "huge"):
            use(where)
            runs[where].append(decode_ms())
    use("huge")
    engine.close()

    med = {k: statistics.median(v) for k, v in runs.items()}
    print(
        f"kernels: {cpu_isa()}; quantization {args.quantization}; prompt {args.prompt_len}; "
        f"AnonHugePages {huge_kb / 1024:.0f} MiB after the build"
    )
    print("| pages | decode step, ms (each round) | median |")
    print("|---|---|---|")
    for k, v in runs.items():
        print(f"| {k} | {', '.join(f'{x:.2f}' for x in v)} | {med[k]:.2f} |")
    print(f"huge / plain: {med['huge'] / med['plain']:.3f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "isa": cpu_isa(),
        "quantization": args.quantization,
        "prompt_len": args.prompt_len,
        "anon_huge_kb": huge_kb,
        "decode_ms": runs,
    }
    args.json.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
