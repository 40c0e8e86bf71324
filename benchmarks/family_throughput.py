"""Offline throughput of each model family against Llama's at the same shape: does a
family's variation keep it on the fast path?

Each family is a random-weight checkpoint written by transformers' own `save_pretrained`
in the SmolLM2-135M shape (benchmarks.common.SMOLLM2_135M: hidden 576, 30 layers, 9
heads, 3 KV heads) with what makes the family itself switched on: Qwen3's q/k norms,
SmolLM3's layers without RoPE, Granite's multipliers, Phi-4-mini's partial rotary and
LongRoPE, OLMo 2's output norms and whole-projection q/k norms, Gemma 3's sandwich
norms, GeGLU and windowed layers (a window of 512, which these requests stay within),
Gemma 2's soft-capped scores and logits besides. The engine runs 64 requests of 128
random prompt tokens and 64 output tokens at once, then one request alone, for each
family right after Llama, --pairs times (the median of the ratios within each pair; the
tok/s shown are the median pair's), in one process. Prints a table, writes JSON and
records the rows in docs/results.md.

    PYTHONPATH=. .venv/bin/python benchmarks/family_throughput.py
"""

from __future__ import annotations

import argparse
import gc
import random
import shutil
import statistics
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    OUT,
    SMOLLM2_135M,
    checkpoint,
    engine_for,
    run_batch,
    run_single,
    write_json,
)
from benchmarks.results import record
from model.audit import count_params

HEAD_DIM = SMOLLM2_135M["hidden_size"] // SMOLLM2_135M["num_attention_heads"]  # 64
PAIRS = HEAD_DIM * 3 // 8  # Phi-4-mini's 3/4 of the head rotated, in pairs
# transformers' config class and what switches the family's variation on
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "Llama": ("Llama", {}),
    "Qwen3": ("Qwen3", {"head_dim": HEAD_DIM}),
    "Mistral": ("Mistral", {"sliding_window": None}),
    "SmolLM3": ("SmolLM3", {"no_rope_layer_interval": 4, "pad_token_id": 0}),
    "Granite": (
        "Granite",
        {
            "embedding_multiplier": 12.0,
            "residual_multiplier": 0.22,
            "attention_multiplier": 0.0078125,
            "logits_scaling": 8.0,
        },
    ),
    "Phi-3 (Phi-4-mini's rotation)": (
        "Phi3",
        {
            "pad_token_id": 0,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 100000.0,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0] * PAIRS,
                "long_factor": [4.0] * PAIRS,
                "original_max_position_embeddings": 1024,
                "factor": 2.0,
            },
            "original_max_position_embeddings": 1024,
        },
    ),
    "OLMo 2": ("Olmo2", {"pad_token_id": 0}),
    "Gemma 3": (
        "Gemma3Text",
        {"head_dim": HEAD_DIM, "query_pre_attn_scalar": HEAD_DIM, "sliding_window": 512},
    ),
    "Gemma 2": (
        "Gemma2",
        {
            "head_dim": HEAD_DIM,
            "query_pre_attn_scalar": HEAD_DIM,
            "sliding_window": 512,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
        },
    ),
}


def write_family(path: Path, family: str, extra: dict[str, Any], tokenizer: Path) -> Path:
    """The checkpoint (written once) with the shared tokenizer's files beside it."""
    if not (path / "config.json").exists():
        import transformers as tf

        torch.manual_seed(0)
        cfg = getattr(tf, f"{family}Config")(**{**SMOLLM2_135M, **extra})
        name = "Gemma3ForCausalLM" if family == "Gemma3Text" else f"{family}ForCausalLM"
        getattr(tf, name)(cfg).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, path / name)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--pairs", type=int, default=3, help="Llama-then-family runs; median ratio")
    ap.add_argument("--json", type=Path, default=OUT / "family_throughput.json")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: the Triton kernels with CUDA graphs, as kvserve serves there")  # fmt: skip
    ap.add_argument("--no-record", action="store_true", help="leave docs/results.md alone")
    args = ap.parse_args()
    device = torch.device(args.device)
    tokenizer = checkpoint(OUT / "smollm2-135m-random")  # offline_throughput's, and its tokenizer
    rng = random.Random(0)
    vocab = SMOLLM2_135M["vocab_size"]
    prompts = [
        [rng.randrange(1, vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)
    ]

    def measure(name: str) -> dict[str, Any]:
        family, extra = FAMILIES[name]
        path = tokenizer  # Llama: offline_throughput's checkpoint itself
        if family != "Llama":
            path = write_family(
                OUT / f"family-{family.lower()}-135m-random", family, extra, tokenizer
            )
        engine = engine_for(path, device, torch.bfloat16, max_num_seqs=args.requests)
        model = engine.model
        backend = engine.backend.name + (" + graphs" if engine.runner.graphs else "")
        batch = run_batch(engine, prompts, args.output_len)
        single = run_single(engine, prompts[0], args.output_len)
        row = {
            "family": name,
            "architecture": model.cfg.architecture,
            "parameters": count_params(model.cfg).total,
            "c_stack": model.fused_layers is not None,
            "backend": backend,
            "output_tok_s": round(batch["output_tok_s"], 1),
            "decode_ms_per_token": round(single["decode_ms_per_token"], 2),
        }
        engine.close()
        del engine, model
        gc.collect()
        return row

    # each family right after a Llama run of its own: this machine drifts over minutes,
    # so a ratio is taken within its pair
    rows = []
    for name in (n for n in args.families if n != "Llama"):
        pairs = [(measure("Llama"), measure(name)) for _ in range(args.pairs)]
        tput = [f["output_tok_s"] / ll["output_tok_s"] for ll, f in pairs]
        decode = [f["decode_ms_per_token"] / ll["decode_ms_per_token"] for ll, f in pairs]
        mid = sorted(range(len(pairs)), key=lambda i: tput[i])[len(pairs) // 2]
        llama, row = pairs[mid][0], dict(pairs[mid][1])  # the median throughput ratio's pair
        row["llama_tok_s"], row["llama_ms_per_token"] = (
            llama["output_tok_s"],
            llama["decode_ms_per_token"],
        )
        row["throughput_vs_llama"] = round(statistics.median(tput), 3)
        row["decode_time_vs_llama"] = round(statistics.median(decode), 3)
        row["pairs"] = [{"llama": ll, "family": f} for ll, f in pairs]
        rows.append(row)
    backends = sorted({r["backend"] for r in rows})
    print(f"{args.requests} x ({args.prompt_len} in, {args.output_len} out), bf16, {args.device}: "
          f"{', '.join(backends)}")  # fmt: skip
    print(
        f"{'family':30} {'params':>12} {'C stack':>8} {'tok/s':>8} {'Llama':>8} {'x Llama':>8} "
        f"{'ms/token':>9} {'Llama':>7} {'x Llama':>8}"
    )
    for r in rows:
        print(
            f"{r['family']:30} {r['parameters']:12,d} {r['c_stack']!s:>8} "
            f"{r['output_tok_s']:8.1f} {r['llama_tok_s']:8.1f} {r['throughput_vs_llama']:8.2f} "
            f"{r['decode_ms_per_token']:9.2f} {r['llama_ms_per_token']:7.2f} "
            f"{r['decode_time_vs_llama']:8.2f}"
        )
    write_json(args.json, {"rows": rows, "args": {k: str(v) for k, v in vars(args).items()}})
    if args.no_record:
        return
    shape = (
        f"SmolLM2-135M shape, bf16, {args.requests} x ({args.prompt_len} in, {args.output_len} out)"
    )
    if args.device != "cpu":
        shape += f", {args.device} ({', '.join(backends)})"
    record(
        "family_throughput",
        {
            f"{r['family']}, {shape}": (
                f"{r['output_tok_s']:.1f} tok/s, {r['throughput_vs_llama']:.2f}x Llama's "
                f"{r['llama_tok_s']:.1f} (median of {args.pairs} pairs); one stream {r['decode_ms_per_token']:.2f} "
                f"ms/token, {r['decode_time_vs_llama']:.2f}x; C stack "
                f"{'yes' if r['c_stack'] else 'no'}"
            )
            for r in rows
        },
    )


if __name__ == "__main__":
    main()
