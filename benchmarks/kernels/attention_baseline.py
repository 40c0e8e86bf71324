"""kvserve's paged attention (model/backends/cpu/kernels/paged_attention.c) against the same source at
another commit: both built from their own files (with the headers beside them) at this
CPU's level, or KVSERVE_CPU_ISA's (the tile kernel at amx, else the vector one; the
bf16 kernel paged_attention runs there), for the 180M Llama-3-style checkpoint's heads
(9 query heads over 3 K/V heads of 64 channels, a bf16 cache of 16-token blocks), loaded
into one process, their calls alternating (benchmarks/kernels/kernel_at.py).

  decode   --rows query rows of each --context's tokens, scattered blocks, one cache per
           layer (--layers): the K/V come from memory, as in a decode step
  prefill  one prompt of each --prefill length, every token a query row over the tokens
           up to it, --layers calls on one cache (a prefill step's attention)

Per workload the median of --repeats turns for each build. Prints a table and writes JSON.

    PYTHONPATH=. .venv/bin/python benchmarks/kernels/attention_baseline.py --baseline HEAD~1 --rows 1 16 --prefill 2040
"""

from __future__ import annotations

import argparse
import ctypes
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import OUT
from benchmarks.kernels.kernel_at import alternate, library_at
from model.backends.cpu.isa import isa_flags
from model.backends.cpu.kernels.attention import ATTENTION_FLAGS, attention_isa
from model.backends.cpu.kernels.build import bind

KV, GROUP, D, BLOCK = 3, 3, 64, 16


def build(rev: str | None, level: str, tmp: Path) -> ctypes._CFuncPtr:
    """The bf16 kernel of `level` (paged_attention_amx at amx, else paged_attention_bf16)
    from this tree (rev None) or from commit `rev`."""
    shape = [f"-DHEAD_DIM={D}", f"-DBLOCK_SIZE={BLOCK}", f"-DGROUP={GROUP}"]
    lib = library_at(rev, "paged_attention.c", [*ATTENTION_FLAGS, *isa_flags(level), *shape], tmp)
    name = "paged_attention_amx" if level == "amx" else "paged_attention_bf16"
    bind(lib, name, "paged_attention_amx_init")
    if level == "amx" and not lib.paged_attention_amx_init():
        raise SystemExit("the OS does not grant this process the AMX tile state")
    return getattr(lib, name)


def workload(
    fn: ctypes._CFuncPtr,
    q: torch.Tensor,  # (R, H, D) bf16
    caches: list[tuple[torch.Tensor, torch.Tensor]],  # one (K, V) per call
    tables: torch.Tensor,  # (B, max_blocks) int64
    lens: torch.Tensor,  # (R,) int64
    row_seq: torch.Tensor | None,  # (R,) int64, None: row r is sequence r
) -> Callable[[], None]:
    """One call per cache, as model.backends.cpu.kernels.attention.paged_attention makes it."""
    out = torch.empty_like(q)
    rows, threads = q.shape[0], torch.get_num_threads()
    seqs = row_seq.data_ptr() if row_seq is not None else None

    def run() -> None:
        for k, v in caches:
            fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), tables.data_ptr(), seqs,
               lens.data_ptr(), out.data_ptr(), rows, q.stride(0), KV, tables.shape[1],
               D**-0.5, None, threads)  # fmt: skip

    run.keep = out  # the output lives as long as the workload
    return run


def decode(rows: int, context: int, layers: int) -> tuple:
    blocks = -(-context // BLOCK)
    pool = rows * blocks + 8
    caches = [
        (
            torch.randn(pool, KV, D // 2, BLOCK, 2).to(torch.bfloat16),
            torch.randn(pool, KV, BLOCK // 2, D, 2).to(torch.bfloat16),
        )
        for _ in range(layers)
    ]
    tables = torch.randperm(pool)[: rows * blocks].view(rows, blocks).contiguous()
    lens = torch.full((rows,), context, dtype=torch.int64)
    q = torch.randn(rows, KV * GROUP, D).to(torch.bfloat16)
    return q, caches, tables, lens, None


def prefill(n: int, layers: int) -> tuple:
    blocks = -(-n // BLOCK)
    k = torch.randn(blocks + 8, KV, D // 2, BLOCK, 2).to(torch.bfloat16)
    v = torch.randn(blocks + 8, KV, BLOCK // 2, D, 2).to(torch.bfloat16)
    tables = torch.randperm(blocks + 8)[:blocks].view(1, blocks).contiguous()
    q = torch.randn(n, KV * GROUP, D).to(torch.bfloat16)
    return q, [(k, v)] * layers, tables, torch.arange(1, n + 1), torch.zeros(n, dtype=torch.int64)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--baseline", required=True, help="the commit to compare with")
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 16], help="decode rows")
    ap.add_argument("--context", type=int, nargs="+", default=[192])
    ap.add_argument("--prefill", type=int, nargs="*", default=[512, 2040], help="prompts")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", type=Path, default=OUT / "attention_baseline.json")
    args = ap.parse_args()
    level = attention_isa(D, BLOCK, GROUP, torch.bfloat16)
    torch.manual_seed(0)
    cases = [(f"decode {r} x {c}", decode(r, c, args.layers))
             for c in args.context for r in args.rows]  # fmt: skip
    cases += [(f"prefill {n}", prefill(n, args.layers)) for n in args.prefill]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        now, base = build(None, level, Path(tmp)), build(args.baseline, level, Path(tmp))
        print(f"paged_attention.c at {level}, threads {torch.get_num_threads()}: this tree "
              f"against {args.baseline}, {args.layers} layers")  # fmt: skip
        print(f"{'workload':>20} {'now ms':>9} {'baseline ms':>12} {'now/baseline':>13}")
        for name, inputs in cases:
            repeats = args.repeats if name.startswith("decode") else max(3, args.repeats // 3)
            t_now, t_base = alternate(workload(now, *inputs), workload(base, *inputs), repeats)
            print(f"{name:>20} {t_now:9.2f} {t_base:12.2f} {t_now / t_base:13.3f}")
            runs.append({"workload": name, "now_ms": t_now, "baseline_ms": t_base})
    args.json.parent.mkdir(parents=True, exist_ok=True)
    report = {"level": level, "baseline": args.baseline, "layers": args.layers, "runs": runs}
    args.json.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
