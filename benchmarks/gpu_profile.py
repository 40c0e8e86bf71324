"""Where a GPU engine step's time goes: per-step wall times of a long prefill and of
single-stream decode, and torch.profiler's tables (host ops and device kernels) for each,
on gpu_bench.py's random checkpoints. A companion to gpu_bench.py's totals: it says
whether a step waits on the host (Python, metadata, sampling) or on kernels, and which.

    PYTHONPATH=. python benchmarks/gpu_profile.py --shapes smollm2-135m llama-3.2-1b

Every phase draws fresh prompts (none is in the prefix cache), and the timed prefill
follows a warm-up run of the same step shapes: the first step of a new shape pays for
compiling and autotuning its kernels.
`--smoke` runs the tiny shape on any device (how the script is checked without a GPU).
Writes every profile table to one file (--tables) and prints a summary last.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import OUT, SHAPES, SMOKE, checkpoint, engine_for, run_batch, sync
from service.engine.request import SamplingParams


def timed_steps(engine, device: torch.device) -> list[float]:
    """ms of each step until the engine is idle, synced per step: a step's host and
    device time in turn, with nothing overlapped (async scheduling's overlap is in
    gpu_bench's decode ms/token)."""
    steps = []
    while engine.has_unfinished():
        sync(device)
        t0 = time.perf_counter()
        engine.step()
        sync(device)
        steps.append(1000 * (time.perf_counter() - t0))
    return steps


def add(engine, prompts: list[list[int]], out_len: int) -> None:
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    for p in prompts:
        engine.add_request(f"p{time.monotonic_ns()}", p, params)


def profile(engine, device: torch.device, prompts, out_len: int, skip: int) -> tuple[str, str]:
    """Run the requests, profiling the steps after the first `skip` -> the tables by
    device time (host time where there is no GPU) and by host time, and the first's head."""
    add(engine, prompts, out_len)
    for _ in range(skip):
        engine.step()
    sync(device)
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        while engine.has_unfinished():
            engine.step()
        sync(device)
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    by_device = prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60)
    by_host = prof.key_averages().table(
        sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60
    )
    tables = f"by {key}\n{by_device}\n\nby self_cpu_time_total\n{by_host}\n"
    return tables, "\n".join(by_device.splitlines()[:14])


def python_profile(engine, prompt: list[int], steps: int) -> tuple[str, str]:
    """cProfile of `steps` single-stream decode steps -> the host's Python by own time,
    and its head."""
    import cProfile
    import io
    import pstats

    add(engine, [prompt], steps + 1)
    engine.step()  # the prompt
    prof = cProfile.Profile()
    prof.enable()
    while engine.has_unfinished():
        engine.step()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
    lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
    start = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls"))
    return buf.getvalue(), "\n".join(lines[start : start + 16])


def measure(name: str, shape: dict, args, device: torch.device) -> dict:
    dtype = torch.bfloat16
    path = checkpoint(args.out / f"{name}-random", shape, dtype)
    eng = engine_for(path, device, dtype, max_num_seqs=64, num_kv_blocks=4096)
    vocab, plen = eng.model.cfg.vocab_size, eng.max_model_len - 1

    def fresh(n: int) -> list[list[int]]:  # prompts no earlier run left in the prefix cache
        return [torch.randint(0, vocab, (plen,)).tolist() for _ in range(n)]

    run_batch(eng, fresh(args.prefills), 1)  # warm-up: the same step shapes, kernels built
    prompts = fresh(args.prefills)
    add(eng, prompts, 1)
    pre = timed_steps(eng, device)
    single = torch.randint(0, vocab, (128,)).tolist()
    run_batch(eng, [single], 16)  # warm-up
    add(eng, [single], args.decode_steps + 1)
    dec = timed_steps(eng, device)[1:]  # the prompt's step out
    pre_tables, pre_head = profile(eng, device, fresh(2), 1, 0)
    dec_tables, dec_head = profile(eng, device, [single], 33, 1)
    py_tables, py_head = python_profile(eng, single, 64)
    with args.tables.open("a") as f:  # one file: a lent GPU host brings back few
        for what, text in (("prefill", pre_tables), ("decode", dec_tables),
                           ("decode, host Python (cProfile)", py_tables)):  # fmt: skip
            f.write(f"===== {name}: {what}\n{text}\n")
    return {
        "prefill_step_ms": [round(ms, 2) for ms in pre],
        "prefill_tokens": len(prompts) * plen,
        "prefill_tok_s": len(prompts) * plen / (sum(pre) / 1000),
        "decode_step_ms_median": statistics.median(dec),
        "decode_step_ms_min": min(dec),
        "prefill_profile_head": pre_head,
        "decode_profile_head": dec_head,
        "decode_python_head": py_head,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--smoke", action="store_true", help="the tiny shape, any device")
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--out", type=Path, default=OUT, help="where the checkpoints are written")
    ap.add_argument("--tables", type=Path, default=OUT / "gpu_profile.txt")
    ap.add_argument("--prefills", type=int, default=8, help="prompts of the context less one")
    ap.add_argument("--decode-steps", type=int, default=64)
    args = ap.parse_args()
    args.tables.parent.mkdir(parents=True, exist_ok=True)
    args.tables.write_text("")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = {"smoke": SMOKE} if args.smoke else {n: SHAPES[n] for n in args.shapes}
    results = {name: measure(name, shape, args, device) for name, shape in shapes.items()}
    for name, r in results.items():
        print(f"\n== {name}: prefill steps (ms) {r['prefill_step_ms']}")
        print("prefill profile:\n" + r["prefill_profile_head"])
        print("decode profile:\n" + r["decode_profile_head"])
        print("decode, host Python by own time:\n" + r["decode_python_head"])
    print(f"\n{'model':14s} {'prefill tok/s':>14s} {'decode step ms (median, min)':>29s}")
    for name, r in results.items():
        print(f"{name:14s} {r['prefill_tok_s']:14.0f} "
              f"{r['decode_step_ms_median']:20.3f}, {r['decode_step_ms_min']:.3f}")  # fmt: skip
    print(f"tables in {args.tables}")


if __name__ == "__main__":
    main()
