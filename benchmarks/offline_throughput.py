"""Offline throughput of the engine on a random-weight SmolLM2-135M-shaped checkpoint.

64 requests of 128 random prompt tokens and 128 output tokens (ignore_eos), submitted at
once (`--max-num-seqs` below `--requests` runs them that many at a time, as a closed-loop
client at that concurrency would); then one request alone (time to first token, decode ms/token next to the
weight-bandwidth floor); then, when transformers is installed, HF `generate` at batch 8
in the same dtype, in the same run. Prints a table and writes JSON.

    python benchmarks/offline_throughput.py --dtype float32 bfloat16
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch
from results import record

from model.audit import weight_bytes
from model.device import DTYPES, dtype_name
from model.hardware import memory_bandwidth
from model.tokenizer import Tokenizer
from model.weights import load_model
from service.config import Settings
from service.engine.engine import LLMEngine
from service.engine.request import SamplingParams

OUT = Path(__file__).parent / "out"
SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=0,
    eos_token_id=0,
)


def checkpoint(path: Path) -> Path:
    """Write (once) a random-weight checkpoint with transformers' own save_pretrained, and
    a byte-level BPE tokenizer.json trained here on Python's sources to the model's
    vocabulary size, so that `kvserve serve` can serve the directory."""
    if not (path / "config.json").exists():
        import transformers as tf

        torch.manual_seed(0)
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**SMOLLM2_135M))
        model.save_pretrained(path)
    if not (path / "tokenizer.json").exists():
        write_tokenizer(path)
    return path


def _utf8(path: Path) -> bool:
    try:
        path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def write_tokenizer(path: Path, vocab_size: int = SMOLLM2_135M["vocab_size"]) -> None:
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    # the whole standard library: enough text for one merge per vocabulary id, so that
    # every id the random model samples decodes to text
    files = [f for f in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")) if _utf8(f)]
    tok.train([str(f) for f in files], trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


class _StepKinds:
    """An engine observer that notes whether each step was decodes only (one new token
    per sequence)."""

    def __init__(self) -> None:
        self.decode_only = False

    def on_step(self, seconds: float, num_tokens: int, num_seqs: int) -> None:
        self.decode_only = num_tokens == num_seqs

    def on_token_intervals(self, seconds: list[float]) -> None:
        pass

    def on_finished(self, output: object) -> None:
        pass


def run_batch(
    engine: LLMEngine,
    prompts: list[list[int]],
    out_len: int,
    extras: Callable[[int], dict] | None = None,
) -> dict[str, float]:
    """Every prompt as a greedy request of out_len tokens at once, run to the end;
    extras(i): more SamplingParams fields for request i (none by default)."""
    for i, p in enumerate(prompts):
        more = extras(i) if extras is not None else {}
        params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True, **more)
        engine.add_request(f"b{i}-{time.monotonic_ns()}", p, params)
    decode_times: list[float] = []
    generated = 0
    kinds, observer = _StepKinds(), engine.observer
    engine.observer = kinds
    t0 = time.perf_counter()
    try:
        while engine.has_unfinished():
            s0 = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - s0
            generated += sum(len(o.token_ids) for o in outs)
            if outs and kinds.decode_only:
                decode_times.append(dt)
    finally:
        engine.observer = observer
    total = time.perf_counter() - t0
    return {
        "requests": len(prompts),
        "output_tokens": generated,
        "seconds": total,
        "output_tok_s": generated / total,
        "mean_decode_step_ms": 1000 * sum(decode_times) / max(1, len(decode_times)),
    }


def run_single(engine: LLMEngine, prompt: list[int], out_len: int) -> dict[str, float]:
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    engine.add_request(f"single-{time.monotonic_ns()}", prompt, params)
    t0 = time.perf_counter()
    first = None
    n = 0
    while engine.has_unfinished():
        outs = engine.step()
        n += sum(len(o.token_ids) for o in outs)
        if first is None and n:
            first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None
    return {
        "ttft_ms": 1000 * (first - t0),
        "decode_ms_per_token": 1000 * (end - first) / max(1, n - 1),
    }


def run_hf(
    path: Path, dtype: torch.dtype, prompts: list[list[int]], out_len: int
) -> dict[str, float]:
    import transformers as tf

    model = tf.LlamaForCausalLM.from_pretrained(path, dtype=dtype).eval()
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
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--json", type=Path, default=OUT / "offline_throughput.json")
    ap.add_argument(
        "--no-record", dest="record", action="store_false", help="leave docs/results.md as is"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    path = checkpoint(OUT / "smollm2-135m-random")
    rng = random.Random(0)
    prompts = [
        [rng.randrange(1, 49152) for _ in range(args.prompt_len)] for _ in range(args.requests)
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
        engine = LLMEngine(model, Tokenizer.default(), settings)
        run_single(engine, prompts[0][:16], 4)  # warm-up
        batch = run_batch(engine, prompts, args.output_len)
        batch["max_num_seqs"] = engine.max_num_seqs
        single = run_single(engine, prompts[1], args.output_len)
        floor_ms = 1000 * weight_bytes(model.cfg, dtype_name(dtype)) / bandwidth
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
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.json}")
    if args.record:
        record("offline_throughput", headline(results, args))


def headline(results: dict, args: argparse.Namespace) -> dict[str, str]:
    """The run's numbers for the results table."""
    rows = {}
    shape = f"SmolLM2-135M shape, {args.requests} x ({args.prompt_len} in, {args.output_len} out)"
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
