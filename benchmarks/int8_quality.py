"""What --quantization int8 (or int4, or fp8) costs in quality, against the same checkpoint
in bf16.

For each checkpoint (the test suite's transformers-written parity checkpoints: Llama with
GQA, tied and untied, Qwen2 with q/k/v biases, GPT-2; and the 180M Llama-3-style
checkpoint of ../shared/peers when --peers has it), loaded twice in bf16: int8 and int4 on
the CPU backend (kvserve's bf16 kernels, and int8 or int4 weights); fp8 on the torch backend (bf16
weights, and FP8 linears in the dequantizing path the CPU runs: the same values a GPU's
FP8 matmuls read, the activations unquantized):

  logits       random prompts through the model without a cache: max and mean |quantized -
               bf16| over every position's logits, the mean relative to the bf16 logits'
               standard deviation, teacher-forced top-1 agreement (same context,
               same argmax), and the mean KL divergence of the quantized next-token
               distribution from bf16's (nats, over every position)
  greedy       the engine generating --output-len tokens greedily from each prompt:
               share of positions where the two runs chose the same token, and the mean
               length of the identical prefix

With --files NAME=PATH (a GGUF file or an AWQ/GPTQ folder of the 180M checkpoint), each
file is loaded as it is (its weights dequantized to bf16) and with --quantization, both
against the 180M checkpoint's bf16: what the file's own 4 bits cost, and what kvserve's
--quantization adds on top of them.

Prints a table and writes JSON (--out).

    PYTHONPATH=. .venv/bin/python benchmarks/int8_quality.py --peers ../peers
    PYTHONPATH=. .venv/bin/python benchmarks/int8_quality.py --quantization int4 --peers ../peers \
        --files q4_0=../peers/models/llama-cl100k-135m-Q4_0.gguf
    PYTHONPATH=. .venv/bin/python benchmarks/int8_quality.py --quantization fp8
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from model.backends.fp8 import Fp8Linear, to_fp8
from model.loader import load
from service.config import Settings
from service.engine.core.engine import LLMEngine
from service.engine.request import SamplingParams
from tests import factories as hf

ROOT = Path(__file__).resolve().parents[1]


def checkpoints(tmp: Path, peers: Path | None) -> dict[str, Path]:
    out = {}
    for name, write in (
        ("llama-gqa-tied", lambda p: hf.write_llama(p, tied=True)),
        ("llama-gqa-untied", lambda p: hf.write_llama(p, tied=False, seed=1)),
        ("qwen2-bias", hf.write_qwen2),
        ("gpt2", hf.write_gpt2),
    ):
        path = tmp / name
        write(path)
        hf.write_tokenizer(path)
        out[name] = path
    big = peers / "models" / "llama-cl100k-135m" if peers else None
    if big is not None and (big / "model.safetensors").exists():
        out["llama3-180m"] = big
    return out


def engine(path: Path, quantization: str, backend: str) -> LLMEngine:
    loaded = load(path, torch.bfloat16, torch.device("cpu"))
    if quantization == "fp8":  # the server takes fp8 on CUDA alone: converted here
        to_fp8(loaded.model)
        quantization = "none"
    settings = Settings(attention_backend=backend, quantization=quantization, max_num_seqs=16)
    return LLMEngine.build(loaded.model, loaded.tokenizer, settings.engine)


def quantized_linears(model: torch.nn.Module) -> int:
    return sum(
        1
        for m in model.modules()
        if getattr(m, "quant", "bf16") != "bf16" or isinstance(m, Fp8Linear)
    )


def greedy(eng: LLMEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"q{i}", p, params)
    tokens: dict[str, list[int]] = {f"q{i}": [] for i in range(len(prompts))}
    while eng.has_unfinished():
        for out in eng.step():
            tokens[out.request_id] += out.token_ids
    return [tokens[f"q{i}"] for i in range(len(prompts))]


@torch.no_grad()
def compare(ref: Path, path: Path, quantization: str, args: argparse.Namespace) -> dict[str, Any]:
    """ref's bf16 against path's with `quantization`."""
    backend = "torch" if args.quantization == "fp8" else "cpu"
    bf16, quant = engine(ref, "none", backend), engine(path, quantization, backend)
    cfg = bf16.model.cfg
    gen = torch.Generator().manual_seed(args.seed)
    length = min(args.prompt_len, cfg.max_position - args.output_len)
    prompts = [
        torch.randint(0, min(cfg.vocab_size, 100256), (length,), generator=gen).tolist()
        for _ in range(args.prompts)
    ]
    diffs, agree, scale, kl = [], [], [], []
    for p in prompts:
        ids = torch.tensor(p)
        a, b = bf16.model(ids).float(), quant.model(ids).float()
        diffs.append((a - b).abs())
        agree.append((a.argmax(-1) == b.argmax(-1)).float().mean().item())
        scale.append(a.std().item())
        logp, logq = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
        kl.append((logp.exp() * (logp - logq)).sum(-1).mean().item())
    d = torch.cat([x.flatten() for x in diffs])
    ref, got = greedy(bf16, prompts, args.output_len), greedy(quant, prompts, args.output_len)
    same = [
        sum(x == y for x, y in zip(r, g, strict=True)) / len(r)
        for r, g in zip(ref, got, strict=True)
    ]
    prefix = []
    for r, g in zip(ref, got, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(r, g, strict=True)) if x != y), len(r))
        prefix.append(n)
    return {
        "quantized_linears": quantized_linears(quant.model),
        "logit_max_abs_err": d.max().item(),
        "logit_mean_abs_err": d.mean().item(),
        "mean_err_over_logit_std": d.mean().item() / statistics.fmean(scale),
        "top1_agreement": statistics.fmean(agree),
        "kl_mean": statistics.fmean(kl),
        "greedy_same_token_share": statistics.fmean(same),
        "greedy_identical_prefix_mean": statistics.fmean(prefix),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--peers", type=Path, default=ROOT.parent / "peers")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quantization", choices=["int8", "int4", "fp8"], default="int8")
    ap.add_argument("--files", nargs="*", default=[], metavar="NAME=PATH")
    ap.add_argument(
        "--out", default=None, help="default: benchmarks/out/<quantization>_quality.json"
    )
    args = ap.parse_args()
    args.out = args.out or str(ROOT / "benchmarks" / "out" / f"{args.quantization}_quality.json")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = checkpoints(Path(tmp), args.peers)
        runs = [(name, path, path, args.quantization) for name, path in paths.items()]
        for name, file in (f.split("=", 1) for f in args.files):
            for q in ("none", args.quantization):
                runs.append((f"{name} ({q})", paths["llama3-180m"], Path(file), q))
        for name, ref, path, q in runs:
            results[name] = compare(ref, path, q, args)
            print(name, json.dumps({k: round(v, 4) for k, v in results[name].items()}), flush=True)
    print()
    print(
        "| checkpoint | quantized linears | logit max err | logit mean err | mean err / logit std | top-1 agreement (teacher-forced) | mean KL (nats) | greedy same token | greedy identical prefix |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['quantized_linears']} | {r['logit_max_abs_err']:.4f} | {r['logit_mean_abs_err']:.4f} "
            f"| {r['mean_err_over_logit_std']:.3f} | {r['top1_agreement']:.1%} | {r['kl_mean']:.4f} "
            f"| {r['greedy_same_token_share']:.1%} | {r['greedy_identical_prefix_mean']:.1f} / {args.output_len} |"
        )
    Path(args.out).write_text(
        json.dumps({"args": vars(args) | {"peers": str(args.peers)}, "results": results}, indent=2)
    )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
