"""The GPU path measured in one command (fits one 10-minute device call on an H100).

Random-weight checkpoints of the Llama-3.2-1B shape and the SmolLM2-135M shape (and,
named in --shapes, a mixture of experts: 6 of Qwen3-30B-A3B's layers), bf16, written by
transformers; for each, in the same run:

- single-stream decode (128 prompt tokens, 256 out), ms/token with CUDA graphs (async
  scheduling on, and off on the same engine) and eagerly, against the weight-bandwidth
  floor (the bytes a token reads / device copy bandwidth measured here);
- offline throughput of 256 requests x (512 in, 256 out), async scheduling on and off
  alternated, two runs each (the better one reported), fresh prompts every run after a
  warm-up run of the same shapes, against transformers `generate` at its best batch size;
  and one run each way with every 8th request asking for logprobs and a frequency
  penalty (which async scheduling keeps on the device);
- prefill of 8 x 2048 tokens (the context less one where shorter), tokens/s against the
  roofline (measured bf16 matmul FLOP/s / 2 x parameters);
- HTTP streaming at concurrency 64 against the offline engine on the same requests.

Prints a table and writes JSON. `--smoke` runs the same code on tiny shapes (the CPU, in
seconds) so that the script itself is tested where there is no GPU.

    PYTHONPATH=. python benchmarks/gpu_bench.py
"""

from __future__ import annotations

import argparse
import shlex
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import (
    MOE_SHAPES,
    OUT,
    SHAPES,
    SMOKE,
    SMOKE_MOE,
    checkpoint,
    engine_for,
    run_batch,
    run_single,
    sync,
    write_json,
)
from model.audit import count_params, read_bytes
from model.backends.machine import matmul_throughput
from service import bench
from service.bench_cli import spawn
from service.config import Settings
from service.engine.core.engine import LLMEngine

MIXED = dict(logprobs=1, frequency_penalty=0.5)  # what some of the offline requests ask for


def copy_bandwidth(device: torch.device, mib: int = 1024) -> float:
    """Device copy bandwidth, bytes/s read + written counted as read (a decode reads)."""
    x = torch.empty(mib << 18, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        y.copy_(x)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * x.numel() * 4 / best


def kv_blocks(args) -> int:
    """A KV pool that holds every request of the largest run at once, for each engine of
    this process. The default (--gpu-memory-utilization) sizes one engine per process,
    as a server is: it counts the process's other engines as used and leaves the second
    nothing. The served run (its own process) is sized by that default."""
    block = Settings().block_size
    need = max(
        args.requests * -(-(args.offline_in + args.offline_out) // block),
        4 * args.concurrency * -(-(args.prompt_len + args.output_len) // block),
        8 * -(-args.prefill_len // block),
    )
    return need + 256


def hf_best(path, device, dtype, prompts, out_len, batches) -> dict:
    import transformers as tf

    model = tf.LlamaForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    kw = dict(max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False, pad_token_id=0)
    best: dict = {}
    with torch.inference_mode():
        for b in batches:
            ids = torch.tensor(prompts[:b], device=device)
            model.generate(ids[:, :8], max_new_tokens=2, do_sample=False, pad_token_id=0)
            sync(device)
            t0 = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
            sync(device)
            tok_s = b * out_len / (time.perf_counter() - t0)
            print(f"  transformers generate batch {b}: {tok_s:.1f} tok/s")
            if tok_s > best.get("output_tok_s", 0):
                best = {"batch": b, "output_tok_s": tok_s}
    del model
    return best


def prefill(engine: LLMEngine, n: int, length: int, vocab: int, device: torch.device) -> float:
    """Prompt tokens/s of n fresh prompts of `length` (one token out; a prompt run before
    would come from the prefix cache), after the same run on other prompts: the first
    step of a new shape stalled 0.3-0.5 s on the H100 (a first-use cost, gone in a second
    run), which is start-up, not prefill."""
    warm, prompts = ([torch.randint(0, vocab, (length,)).tolist() for _ in range(n)] for _ in "ab")
    run_batch(engine, warm, 1)
    sync(device)
    t0 = time.perf_counter()
    run_batch(engine, prompts, 1)
    sync(device)
    return n * length / (time.perf_counter() - t0)


def http_vs_offline(path, engine, args, n, vocab) -> dict:
    reqs = bench.workload("fixed", n, args.prompt_len, args.output_len, vocab, 7)
    offline = run_batch(engine, [p for p, _ in reqs], args.output_len)["output_tok_s"]
    serve = f"--model {shlex.quote(str(path))} --dtype bfloat16 --max-num-seqs {args.concurrency}"
    proc, url = spawn(serve)
    try:
        with bench.event_loop() as runner:
            runner.run(
                bench.run(url, reqs[: args.concurrency], args.concurrency, None, 600, None, None, 1)
            )
            served = runner.run(bench.run(url, reqs, args.concurrency, None, 600, None, None, 7))
    finally:
        proc.terminate()
        proc.wait(60)
    return {"offline_tok_s": offline, "http_tok_s": served["output_tok_s"],
            "ratio": served["output_tok_s"] / offline, "errors": served["errors"]}  # fmt: skip


def scheduled(engine: LLMEngine, on: bool, run: Callable[[LLMEngine], dict]) -> dict:
    """run(engine) with async scheduling as the engine has it (on) or off, the engine then
    reading every step's tokens before it schedules the next (the same engine, graphs and
    pool): what async scheduling saves, measured beside it."""
    was = engine.async_scheduling
    engine.async_scheduling = was and on
    try:
        return run(engine)
    finally:
        engine.async_scheduling = was


def measure(name: str, shape: dict, args, device: torch.device) -> dict:
    dtype = torch.bfloat16
    path = checkpoint(args.out / f"{name}-random", shape, dtype)
    print(f"{name}: {path}")
    blocks = kv_blocks(args)
    eng = engine_for(path, device, dtype, max_num_seqs=args.concurrency, num_kv_blocks=blocks)
    cfg, vocab = eng.model.cfg, eng.model.cfg.vocab_size
    prefill_len = min(args.prefill_len, eng.max_model_len - 1)  # and one token out
    # a mixture's floor: the bytes one token reads (its experts, not all of them)
    floor_ms = 1000 * read_bytes(cfg, "bfloat16") / copy_bandwidth(device)
    flops = matmul_throughput(dtype, device, n=1024 if args.smoke else 8192)
    # prefill computes the head for one row a sequence: the layers' weights are the work
    # (of a mixture, the experts a token runs)
    p = count_params(cfg)
    roofline = flops / (2 * (p.non_embedding - p.ffn + p.ffn_active))
    prompt = torch.randint(0, vocab, (args.prompt_len,)).tolist()
    run_single(eng, prompt, 8)  # warm-up
    graphs = run_single(eng, prompt, args.output_len)
    read_each = scheduled(eng, False, lambda e: run_single(e, prompt, args.output_len))
    eager_eng = engine_for(
        path, device, dtype, max_num_seqs=args.concurrency, enforce_eager=True, num_kv_blocks=blocks
    )
    eager = run_single(eager_eng, prompt, args.output_len)
    del eager_eng

    def fresh() -> list[list[int]]:  # a prompt run before would come from the prefix cache
        return [torch.randint(0, vocab, (args.offline_in,)).tolist() for _ in range(args.requests)]

    prompts = fresh()
    big = engine_for(path, device, dtype, max_num_seqs=256, num_kv_blocks=blocks)
    # warm-up: the timed runs' step shapes (a shape's first step compiles kernels)
    run_batch(big, fresh(), args.offline_out)
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for on in (True, False, True, False):  # async scheduling on and off, alternated
        batch = fresh()
        runs[on].append(scheduled(big, on, lambda e, b=batch: run_batch(e, b, args.offline_out)))
    offline, offline_read_each = (max(runs[on], key=lambda r: r["output_tok_s"]) for on in (True, False))  # fmt: skip

    def mixed(e: LLMEngine) -> dict:  # every 8th request with logprobs and a penalty
        return run_batch(e, fresh(), args.offline_out, lambda i: MIXED if i % 8 == 0 else {})

    mixed_runs = {on: scheduled(big, on, mixed)["output_tok_s"] for on in (True, False)}
    pre = prefill(big, 8, prefill_len, vocab, device)
    del big
    hf = hf_best(path, device, dtype, prompts, args.offline_out, args.hf_batches)
    http = http_vs_offline(path, eng, args, 4 * args.concurrency, vocab)
    return {
        "backend": eng.backend.describe(),
        "cuda_graphs": eng.runner.graphs is not None,
        "floor_ms_per_token": floor_ms,
        "decode_ms_graphs": graphs["decode_ms_per_token"],
        "async_scheduling": eng.async_scheduling,
        "decode_ms_graphs_read_each_step": read_each["decode_ms_per_token"],
        "decode_ms_eager": eager["decode_ms_per_token"],
        "decode_vs_floor": graphs["decode_ms_per_token"] / floor_ms,
        "offline_tok_s": offline["output_tok_s"],
        "offline_tok_s_read_each_step": offline_read_each["output_tok_s"],
        "offline_runs_tok_s": {
            ("async" if on else "read_each_step"): [r["output_tok_s"] for r in rs]
            for on, rs in runs.items()
        },
        "offline_mixed_tok_s": {
            ("async" if on else "read_each_step"): v for on, v in mixed_runs.items()
        },
        "hf": hf,
        "offline_vs_hf": offline["output_tok_s"] / hf["output_tok_s"],
        "prefill_len": prefill_len,
        "kv_blocks": blocks,
        "prefill_tok_s": pre,
        "prefill_roofline_tok_s": roofline,
        "prefill_vs_roofline": pre / roofline,
        "http": http,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, seconds, any device")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--json", type=Path, default=OUT / "gpu_bench.json")
    ap.add_argument(
        "--shapes", nargs="+", choices=[*SHAPES, *MOE_SHAPES], default=list(SHAPES),
        help="which shapes, in this order (the JSON is rewritten after each one; the "
        "mixture of experts when named)",
    )  # fmt: skip
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    known = SHAPES | MOE_SHAPES
    shapes = {"smoke": SMOKE, "smoke-moe": SMOKE_MOE} if args.smoke else {name: known[name] for name in args.shapes}  # fmt: skip
    sizes = (16, 16, 8, 4, 4, 16, [2, 4], 4) if args.smoke else (128, 256, 256, 512, 256, 2048, [32, 64, 128], 64)  # fmt: skip
    (args.prompt_len, args.output_len, args.requests, args.offline_in, args.offline_out,
     args.prefill_len, args.hf_batches, args.concurrency) = sizes  # fmt: skip
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    results: dict[str, dict] = {}
    for name, shape in shapes.items():  # a run cut short keeps the shapes it finished
        results[name] = measure(name, shape, args, device)
        write_json(args.json, {"device": gpu, "torch": torch.__version__, "results": results})
    print(f"\ndevice: {gpu}, torch {torch.__version__}")
    print("(sync: async scheduling off, each step's tokens read before the next is queued)")
    print(f"{'model':14s} {'floor ms':>9s} {'graphs ms':>10s} {'sync ms':>8s} {'eager ms':>9s} "
          f"{'x floor':>8s} {'offline t/s':>12s} {'sync t/s':>9s} {'x HF':>6s} {'prefill t/s':>12s} "
          f"{'x roof':>7s} {'HTTP/off':>9s}")  # fmt: skip
    for name, r in results.items():
        print(f"{name:14s} {r['floor_ms_per_token']:9.2f} {r['decode_ms_graphs']:10.2f} "
              f"{r['decode_ms_graphs_read_each_step']:8.2f} {r['decode_ms_eager']:9.2f} "
              f"{r['decode_vs_floor']:8.2f} {r['offline_tok_s']:12.1f} "
              f"{r['offline_tok_s_read_each_step']:9.1f} {r['offline_vs_hf']:6.1f} "
              f"{r['prefill_tok_s']:12.0f} {r['prefill_vs_roofline']:7.2f} "
              f"{100 * r['http']['ratio']:8.1f}%")  # fmt: skip
    for name, r in results.items():
        m = r["offline_mixed_tok_s"]
        print(f"{name}: offline with every 8th request asking for logprobs and a penalty: "
              f"{m['async']:.1f} tok/s async, {m['read_each_step']:.1f} reading each step")  # fmt: skip


if __name__ == "__main__":
    main()
