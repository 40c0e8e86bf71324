"""Offline throughput of the engine on a random-weight SmolLM2-135M-shaped checkpoint (or
--model: a Hugging Face folder, such as ../peers' Qwen3-MoE peer).

64 requests of 128 random prompt tokens and 128 output tokens (ignore_eos), submitted at
once (`--max-num-seqs` below `--requests` runs them that many at a time, as a closed-loop
client at that concurrency would); then one request alone (time to first token, decode ms/token next to the
weight-bandwidth floor: the bytes one token reads, a mixture's chosen experts alone);
then, when transformers is installed, HF `generate` at batch 8 in the same dtype, in the
same run. Prints a table and writes JSON.

    PYTHONPATH=. .venv/bin/python benchmarks/offline_throughput.py --dtype float32 bfloat16
    PYTHONPATH=. .venv/bin/python benchmarks/offline_throughput.py --dtype bfloat16 \
        --model ../peers/models/qwen3moe-cl100k-a100m --requests 16
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from benchmarks.common import OUT, checkpoint, run_batch, run_single, write_json
from benchmarks.results import record
from model.audit import read_bytes
from model.backends.device import DTYPES, dtype_name
from model.backends.machine import memory_bandwidth
from model.tokenizer import Tokenizer
from model.weights import load_config, load_model
from service.config import Settings
from service.engine.core.engine import LLMEngine


def run_hf(
    path: Path, dtype: torch.dtype, prompts: list[list[int]], out_len: int
) -> dict[str, float]:
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    ids = torch.tensor(prompts)
    kwargs = dict(max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:, :8], max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm-up
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        total = time.perf_counter() - t0
    generated = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return {
        "batch": ids.shape[0],
        "output_tokens": generated,
        "seconds": total,
        "output_tok_s": generated / total,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument(
        "--max-num-seqs", type=int, default=None, help="running at once (default: --requests)"
    )
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-batch", type=int, default=8)
    ap.add_argument("--model", type=Path, default=None, help="a Hugging Face model folder")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--json", type=Path, default=OUT / "offline_throughput.json")
    ap.add_argument(
        "--no-record", dest="record", action="store_false", help="leave docs/results.md as is"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    path = args.model or checkpoint(OUT / "smollm2-135m-random")
    vocab = load_config(path).vocab_size
    rng = random.Random(0)
    prompts = [
        [rng.randrange(1, min(vocab, 49152)) for _ in range(args.prompt_len)]
        for _ in range(args.requests)
    ]
    bandwidth = memory_bandwidth(mib=1024)
    results = {"threads": args.threads, "memory_bandwidth_gb_s": bandwidth / 1e9, "runs": []}
    for name in args.dtype:
        dtype = DTYPES[name]
        model = load_model(path, dtype=dtype)
        settings = Settings(  # every prompt token a step can take (no cap beside decodes)
            max_num_seqs=args.max_num_seqs or args.requests,
            max_num_batched_tokens=2048,
            kv_cache_gib=2.0,
            mixed_prefill_tokens=0,
        )
        engine = LLMEngine.build(model, Tokenizer.default(), settings.engine)
        run_single(engine, prompts[0][:16], 4)  # warm-up
        batch = run_batch(engine, prompts, args.output_len)
        batch["max_num_seqs"] = engine.max_num_seqs
        single = run_single(engine, prompts[1], args.output_len)
        floor_ms = 1000 * read_bytes(model.cfg, dtype_name(dtype)) / bandwidth
        run = {"dtype": name, "batch": batch, "single": single, "bandwidth_floor_ms": floor_ms}
        run["single"]["x_floor"] = single["decode_ms_per_token"] / floor_ms
        if not args.no_hf:
            try:
                hf = run_hf(path, dtype, prompts[: args.hf_batch], args.output_len)
            except ImportError:
                hf = None
            if hf:
                run["hf"] = hf
                run["x_hf"] = batch["output_tok_s"] / hf["output_tok_s"]
        results["runs"].append(run)
        del engine, model
    print_table(results)
    write_json(args.json, results)
    if args.record:
        name = f" ({args.model.name})" if args.model else ""
        record(f"offline_throughput{name}", headline(results, args))


def headline(results: dict, args: argparse.Namespace) -> dict[str, str]:
    """The run's numbers for the results table."""
    rows = {}
    model = args.model.name if args.model else "SmolLM2-135M shape"
    shape = f"{model}, {args.requests} x ({args.prompt_len} in, {args.output_len} out)"
    for run in results["runs"]:
        rows[f"{shape}, {run['dtype']}"] = f"{run['batch']['output_tok_s']:.1f} tok/s" + (
            f", {run['x_hf']:.2f}x transformers generate" if "x_hf" in run else ""
        )
        rows[f"one request's decode, {run['dtype']}"] = (
            f"{run['single']['decode_ms_per_token']:.2f} ms/token, "
            f"{run['single']['x_floor']:.2f}x the weight-bandwidth floor"
        )
    return rows


def print_table(results: dict) -> None:
    print(
        f"threads {results['threads']}, memory read bandwidth {results['memory_bandwidth_gb_s']:.1f} GB/s"
    )
    head = f"{'dtype':9} {'batch tok/s':>11} {'step ms':>8} {'HF b8 tok/s':>11} {'x HF':>6} {'TTFT ms':>8} {'ms/tok':>7} {'floor ms':>8} {'x floor':>7}"
    print(head)
    print("-" * len(head))
    for r in results["runs"]:
        hf = r.get("hf", {}).get("output_tok_s", float("nan"))
        print(
            f"{r['dtype']:9} {r['batch']['output_tok_s']:11.1f} {r['batch']['mean_decode_step_ms']:8.1f} "
            f"{hf:11.1f} {r.get('x_hf', float('nan')):6.2f} {r['single']['ttft_ms']:8.1f} "
            f"{r['single']['decode_ms_per_token']:7.2f} {r['bandwidth_floor_ms']:8.2f} {r['single']['x_floor']:7.2f}"
        )


if __name__ == "__main__":
    main()
