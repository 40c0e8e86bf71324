"""Decode against the weight-bandwidth floor, bf16 beside FP8 and int4 weights, with the
decode step's kernels counted and timed by class (one command, a few minutes on an
H100/H200).

For each shape (Llama-3.2-1B's and Llama-3.1-8B's, and on request 6 of Qwen3-30B-A3B's
layers; random weights made in device memory: benchmarks/common.py random_model) and each weight format (bf16; fp8, `--quantization
fp8`: e4m3 linears with per-channel scales, per-token activation scales; int4,
`--quantization int4`: 4-bit codes with a float16 step and minimum each 32 in features, bf16
activations, the W4A16 kernel), one engine with CUDA graphs and async scheduling, as
`kvserve serve` runs:

- single-stream decode, ms/token (128 prompt tokens, 256 out), against the floor: the
  bytes a decode step reads (every weight once, of a mixture's experts the top k; an
  untied embedding only its row) over the device's copy bandwidth measured here;
- the decode step's kernels (torch.profiler, 32 steps of that stream): launches and GPU
  µs a step by class (benchmarks/launches.py), and a decoder layer's share: the
  difference between 4-layer and 2-layer models of the same widths, halved;
- prefill tokens/s of 8 fresh prompts of 2047 tokens against the bf16 roofline (measured
  bf16 matmul FLOP/s over 2 x the non-embedding parameters).

Prints a table, writes JSON and, on CUDA, records the rows in docs/results.md after each
one. `--smoke` runs the code on a tiny shape, bf16 only, on
any device (how it is checked without a GPU; no kernel census there).

    PYTHONPATH=. python benchmarks/gpu_decode.py --shapes llama-3.2-1b llama-3.1-8b
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

import torch

from benchmarks.common import (
    LLAMA_31_8B,
    LLAMA_32_1B,
    OUT,
    QWEN3_30B_A3B_6L,
    SMOKE,
    random_model,
    run_single,
    write_json,
)
from benchmarks.gpu_bench import copy_bandwidth, prefill
from benchmarks.launches import census
from benchmarks.results import record
from model.audit import count_params
from model.backends.machine import matmul_throughput
from model.tokenizer import Tokenizer
from service.config import Settings
from service.engine.core.engine import LLMEngine
from service.engine.request import SamplingParams

SHAPES = {"llama-3.2-1b": LLAMA_32_1B, "llama-3.1-8b": LLAMA_31_8B,
          "qwen3-30b-a3b-6l": QWEN3_30B_A3B_6L}  # fmt: skip
DEFAULT_SHAPES = ["llama-3.2-1b", "llama-3.1-8b"]
WEIGHTS = {"bf16": "none", "fp8": "fp8", "int4": "int4"}  # the row's name -> --quantization


def engine(shape: dict, quantization: str, device: torch.device, blocks: int) -> LLMEngine:
    model = random_model(shape, torch.bfloat16, device)
    settings = Settings(max_num_seqs=8, num_kv_blocks=blocks, quantization=quantization)
    return LLMEngine.build(model, Tokenizer.default(), settings.engine)


def bytes_read(model: torch.nn.Module) -> int:
    """What one decode step reads: every weight and scale once (after the backend's
    prepare: FP8's are e4m3, int4's codes, steps and minimums), of a mixture's expert
    stacks the top k of every expert's, a tied embedding once as the head (under int4
    its int4 copy, the head), an untied one not at all (its row alone)."""
    experts = model.cfg.experts
    seen, total = set(), 0.0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.data_ptr() in seen or name.startswith("_"):
            continue
        seen.add(t.data_ptr())
        if name == "embed.weight" and model.lm_head is not None:
            continue
        share = experts.top_k / experts.n_experts if ".experts." in name else 1
        total += t.numel() * t.element_size() * share
    return int(total)


def decode_census(eng: LLMEngine, vocab: int, steps: int) -> dict:
    """The kernels of `steps` decode steps of one stream, after its prompt and a warm-up."""
    prompt = torch.randint(0, vocab, (128,)).tolist()
    params = SamplingParams(max_tokens=steps + 16, temperature=0.0, ignore_eos=True)
    eng.add_request(f"census-{id(eng)}-{steps}", prompt, params)
    for _ in range(8):
        eng.step()
    counted = census(eng.step, steps)
    while eng.has_unfinished():
        eng.step()
    return counted


def per_layer(shape: dict, quantization: str, device: torch.device, vocab: int) -> dict:
    """A decoder layer's launches and GPU µs by class: 4 layers' census less 2 layers',
    halved (the step's fixed part cancels)."""
    found = []
    for layers in (2, 4):
        eng = engine(dict(shape, num_hidden_layers=layers), quantization, device, 256)
        found.append(decode_census(eng, vocab, 32))
        del eng
        gc.collect()
    two, four = found
    return {
        key: {k: (four[key].get(k, 0) - two[key].get(k, 0)) / 2 for k in four[key] | two[key]}
        for key in ("launches", "gpu_us")
    }


def measure(shape: dict, quantization: str, device: torch.device, args) -> dict:
    # the prefill's warm-up stays cached beside its timed run: evicting it would time the
    # prefix cache's host tier copying it out (multiturn.py measures that tier)
    blocks = 2 * 8 * -(-args.prefill_len // 16) + 256
    eng = engine(shape, quantization, device, blocks)
    cfg, vocab = eng.model.cfg, eng.model.cfg.vocab_size
    read = bytes_read(eng.model)
    floor_ms = 1000 * read / args.bandwidth
    prompt = torch.randint(0, vocab, (args.prompt_len,)).tolist()
    run_single(eng, prompt, 8)  # warm-up
    decode = run_single(eng, prompt, args.output_len)["decode_ms_per_token"]
    roofline = args.flops / (2 * count_params(cfg).non_embedding)
    pre = prefill(eng, 8, min(args.prefill_len, eng.max_model_len - 1), vocab, device)
    out = {
        "backend": eng.backend.describe(),
        "cuda_graphs": eng.runner.graphs is not None,
        "bytes_read_per_token": read,
        "floor_ms_per_token": floor_ms,
        "decode_ms_per_token": decode,
        "decode_vs_floor": decode / floor_ms,
        "prefill_tok_s": pre,
        "prefill_roofline_bf16_tok_s": roofline,
        "prefill_vs_roofline": pre / roofline,
    }
    if device.type == "cuda":
        out["step"] = decode_census(eng, vocab, 32)
        del eng
        gc.collect()
        out["layer"] = per_layer(shape, quantization, device, vocab)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--smoke", action="store_true", help="a tiny shape, bf16, any device")
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=DEFAULT_SHAPES)
    ap.add_argument("--weights", nargs="+", choices=list(WEIGHTS), default=list(WEIGHTS))
    ap.add_argument("--json", type=Path, default=OUT / "gpu_decode.json")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = {"smoke": SMOKE} if args.smoke else {n: SHAPES[n] for n in args.shapes}
    weights = ["bf16"] if args.smoke or device.type != "cuda" else args.weights
    args.prompt_len, args.output_len, args.prefill_len = (16, 16, 64) if args.smoke else (128, 256, 2047)  # fmt: skip
    args.bandwidth = copy_bandwidth(device, 64 if args.smoke else 1024)
    args.flops = matmul_throughput(torch.bfloat16, device, n=512 if args.smoke else 8192)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    results: dict[str, dict] = {}
    for name, shape in shapes.items():
        for w in weights:  # the JSON is rewritten after each row: a run cut short keeps them
            results[f"{name} {w}"] = measure(shape, WEIGHTS[w], device, args)
            gc.collect()
            write_json(args.json, {"device": gpu, "torch": torch.__version__,
                                   "copy_bandwidth": args.bandwidth, "bf16_flops": args.flops,
                                   "results": results})  # fmt: skip
            if device.type == "cuda":
                record(f"gpu_decode ({', '.join(shapes)})", headline(results, against_bf16(results)))  # fmt: skip
    print(f"\ndevice: {gpu}, torch {torch.__version__}, copy {args.bandwidth / 1e12:.2f} TB/s")
    print(f"{'model':22s} {'floor ms':>9s} {'decode ms':>10s} {'x floor':>8s} "
          f"{'prefill t/s':>12s} {'x roof':>7s} {'kernels/step':>13s} {'GPU us/step':>12s}")  # fmt: skip
    for name, r in results.items():
        step = r.get("step", {})
        print(f"{name:22s} {r['floor_ms_per_token']:9.3f} {r['decode_ms_per_token']:10.3f} "
              f"{r['decode_vs_floor']:8.2f} {r['prefill_tok_s']:12.0f} "
              f"{r['prefill_vs_roofline']:7.2f} {step.get('launches_total', 0):13.1f} "
              f"{step.get('gpu_us_total', 0):12.1f}")  # fmt: skip
    for name, r in results.items():
        if "layer" in r:
            layer = r["layer"]
            parts = ", ".join(f"{k} {n:g} ({layer['gpu_us'].get(k, 0):.1f} us)"
                              for k, n in layer["launches"].items() if n)  # fmt: skip
            print(f"{name}: a layer's launches: {parts}")
            print(f"{name}: a step's other kernels: {r['step']['other_kernels']}")
    for name, w, ratio in against_bf16(results):
        print(f"{name}: {w} decode / bf16 decode = {ratio:.2f}")


def against_bf16(results: dict[str, dict]) -> list[tuple[str, str, float]]:
    """(shape, format, its decode step over bf16's) for each shape measured both ways."""
    out = []
    for key, r in results.items():
        name, w = key.rsplit(" ", 1)
        if w != "bf16" and f"{name} bf16" in results:
            out.append((name, w, r["decode_ms_per_token"] / results[f"{name} bf16"]["decode_ms_per_token"]))  # fmt: skip
    return out


def headline(results: dict[str, dict], ratios: list[tuple[str, str, float]]) -> dict[str, str]:
    rows = {}
    for key, r in results.items():
        rows[f"{key}: one stream's decode (CUDA graphs)"] = (
            f"{r['decode_ms_per_token']:.3f} ms a token, {r['decode_vs_floor']:.2f}x the "
            f"floor ({r['floor_ms_per_token']:.3f} ms)"
        )
        rows[f"{key}: prefill of 8 fresh prompts"] = (
            f"{r['prefill_tok_s']:.0f} tok/s, {r['prefill_vs_roofline']:.2f} of the bf16 roofline"
        )
    for name, w, ratio in ratios:
        rows[f"{name}: {w} decode against bf16's"] = f"{ratio:.2f}x"
    return rows


if __name__ == "__main__":
    main()
