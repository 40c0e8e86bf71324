"""The `kvserve` command."""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from model.audit import audit
from model.device import dtype_name, pick_device, pick_dtype
from model.generate import generate
from model.loader import load
from model.tokenizer import TokenizerError
from model.weights import CheckpointError


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory (default: the random demo model)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument(
        "--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16"
    )


def _cmd_generate(args: argparse.Namespace) -> int:
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    t0 = time.perf_counter()
    loaded = load(args.model, dtype, device)
    load_s = time.perf_counter() - t0
    tok = loaded.tokenizer
    prompt = tok.encode(args.prompt)
    detok = tok.detokenizer()
    print(
        f"[{loaded.model_id} on {device} {dtype_name(dtype)}, loaded in {load_s:.2f}s]",
        file=sys.stderr,
    )
    sys.stdout.write(args.prompt)
    t0 = time.perf_counter()
    n = 0
    for token in generate(
        loaded.model,
        prompt,
        args.max_tokens,
        temperature=args.temperature,
        eos_ids=tok.eos_ids,
        seed=args.seed,
    ):
        sys.stdout.write(detok.push([token]))
        sys.stdout.flush()
        n += 1
    sys.stdout.write(detok.flush() + "\n")
    dt = time.perf_counter() - t0
    print(
        f"[{len(prompt)} prompt tokens, {n} generated in {dt:.2f}s: {n / dt:.1f} tok/s]",
        file=sys.stderr,
    )
    return 0


def _cmd_audit(args: argparse.Namespace) -> int:
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    loaded = load(args.model, dtype, device)
    report = audit(loaded.model.cfg, dtype_name(dtype)).as_dict()
    print(json.dumps({"model": loaded.model_id, **report}, indent=2))
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from service.config import load_settings
    from service.server import serve

    return serve(load_settings(args))


def main(argv: list[str] | None = None) -> int:
    from service.config import add_arguments

    parser = argparse.ArgumentParser(prog="kvserve", description="kvserve: LLM inference service")
    sub = parser.add_subparsers(dest="command", required=True)
    srv = sub.add_parser("serve", help="serve the OpenAI API (flags override KVSERVE_* variables)")
    add_arguments(srv)
    srv.set_defaults(func=_cmd_serve)
    gen = sub.add_parser("generate", help="run one prompt through the model and stream the text")
    _add_model_args(gen)
    gen.add_argument("--prompt", default="The quick brown fox")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.set_defaults(func=_cmd_generate)
    aud = sub.add_parser("audit", help="memory audit: parameters by component, weight and KV bytes")
    _add_model_args(aud)
    aud.set_defaults(func=_cmd_audit)
    args = parser.parse_args(argv)
    try:
        with torch.inference_mode():
            return args.func(args)
    except (CheckpointError, TokenizerError, ValueError) as exc:
        print(f"kvserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
