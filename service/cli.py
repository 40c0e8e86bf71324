"""The `kvserve` command.

torch and the model load when a command that needs them runs, not at import: `--help`
and a bad flag or KVSERVE_* variable answer in a fraction of a second."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from service.config import QUANTIZATIONS, Settings, add_arguments, load_settings

if TYPE_CHECKING:
    from model.audit import Held


def _with_torch(command: Callable[..., int]) -> Callable[..., int]:
    """Run a command under torch.inference_mode()."""

    @functools.wraps(command)
    def run(*args: object) -> int:
        import torch

        with torch.inference_mode():
            return command(*args)

    return run


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory (default: the random demo model)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto (bf16 on CUDA and on CPUs with AVX2 or newer, else fp32), float32, bfloat16",
    )


def _add_held_quantization(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quantization", default="auto", choices=QUANTIZATIONS,
        help="the weights as serve's --quantization holds them (auto: from the files' headers)",
    )  # fmt: skip


@_with_torch
def _cmd_generate(args: argparse.Namespace) -> int:
    from model.backends import select_backend
    from model.backends.device import dtype_name, pick_device, pick_dtype
    from model.generate import generate
    from model.loader import load

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
    model = loaded.model
    block_size = 16  # the cache is this run's alone: any size the backend takes
    backend = select_backend("auto", device, dtype, model.cfg, block_size)
    for token in generate(
        model,
        prompt,
        args.max_tokens,
        backend=backend,
        block_size=block_size,
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


@_with_torch
def _cmd_audit(args: argparse.Namespace) -> int:
    from model.audit import audit
    from model.backends.device import dtype_name, pick_device, pick_dtype
    from model.loader import load

    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device, args.quantization)
    loaded = load(args.model, dtype, device)
    cfg = loaded.model.cfg
    quantization, held = _plan_held(args, cfg, device, dtype)
    total = held.total if held is not None else None
    report = audit(cfg, dtype_name(dtype), quantization=quantization, held_bytes=total)
    print(json.dumps({"model": loaded.model_id, **report.as_dict()}, indent=2))
    return 0


def _plan_config(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from model.config import ModelConfig
    from model.demo import demo_config
    from model.weights import load_config, read_json

    if args.config:
        data = read_json(Path(args.config))
        return (
            ModelConfig.from_hf_config(data)
            if "architectures" in data or "model_type" in data
            else ModelConfig.from_dict(data)
        )
    return load_config(args.model) if args.model else demo_config()


@_with_torch
def _cmd_plan(args: argparse.Namespace) -> int:
    import torch

    from model.audit import plan
    from model.backends.device import dtype_name, pick_device, pick_dtype
    from model.backends.machine import Machine

    cfg = _plan_config(args)
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    if args.memory_gib is not None:
        memory = int(args.memory_gib * (1 << 30))
    elif device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    machine = None if args.no_measure else Machine.measure(dtype, device)
    world = args.tensor_parallel_size
    quantization, held = _plan_held(args, cfg, device, dtype)
    report = plan(
        cfg,
        dtype_name(dtype),
        memory,
        args.seq_len or cfg.max_position,
        machine.bandwidth if machine else None,
        machine.matmul_flops if machine else None,
        world,
        quantization=quantization,
        held=held,
    )
    report = {"model": cfg.name, "device": str(device), **report}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    kinds = dtype_name(dtype) + (f", linears {quantization}" if quantization != "none" else "")
    print("\n".join(_plan_lines(report, cfg.name, kinds, memory, world, machine is not None)))
    return 0


def _plan_held(args: argparse.Namespace, cfg, device, dtype) -> tuple[str, Held | None]:  # type: ignore[no-untyped-def]
    """--quantization as `kvserve serve` would hold the weights, and what they take where
    the config cannot give it (model.audit.Held): auto keeps a checkpoint's integer
    tensors in their own kinds on the cpu backend in bf16 (read from the files' headers;
    a tied table stored as integers copied in its kind), and is none elsewhere or for a
    float checkpoint (service/build.py's _held_as, before the load); int4 off the CPU
    has no 8-bit groups: every linear in int4 (the torch and Triton backends), the head
    a copy."""
    import torch

    from model.audit import Held, quantized_bytes, routed_expert_bytes, stored_held, weight_bytes
    from model.backends.device import dtype_name
    from model.weights import stored_kinds

    name = dtype_name(dtype)
    if args.quantization == "int4" and device.type != "cpu":
        experts = routed_expert_bytes(cfg, name) // dtype.itemsize  # their weights
        total = weight_bytes(cfg, name, "int4", mix=False)
        # int4's bytes have no per-row part: no rows given
        return "int4", Held(total, quantized_bytes(experts, 0, "int4"), cfg.tie_embeddings)
    if args.quantization != "auto":
        return args.quantization, None
    if not args.model or device.type != "cpu" or dtype != torch.bfloat16:
        return "none", None
    stored = stored_kinds(args.model)
    if not stored:
        return "none", None
    return "auto", stored_held(cfg, name, stored)


def _plan_lines(
    report: dict, name: str, held: str, memory: int, world: int, measured: bool
) -> list[str]:
    """`kvserve plan`'s report in words."""
    p = report["parameters"]
    gib = 1 << 30
    each = f" per device (of {world})" if world > 1 else ""
    lines = [
        f"model {name}: {p['total']:,} parameters ({held}, {report['weight_bytes'] / gib:.2f} GiB of weights)",
        f"  embedding {p['embedding']:,}  attention {p['attention']:,}  ffn {p['ffn']:,}  norms {p['norms']:,}  head {p['head']:,}",
        f"weights{each}: {report['weight_bytes_per_device'] / gib:.2f} GiB",
        *_expert_lines(report, each),
        f"KV cache: {report['kv_bytes_per_token']:,} bytes per token"
        + (f", {report['kv_bytes_per_token_per_device']:,}{each}" if world > 1 else ""),
        f"memory {memory / gib:.1f} GiB{each}: {report['kv_room_bytes'] / gib:.2f} GiB left for KV = {report['kv_tokens']:,} tokens"
        f" = {report['sequences_of_seq_len']:,} sequences of {report['seq_len']:,} tokens"
        + (
            f" (windowed layers' KV of the window alone; "
            f"{report['sequences_of_seq_len_global_kv']:,} with global KV in every layer)"
            if "sequences_of_seq_len_global_kv" in report
            else ""
        ),
    ]
    if world > 1:
        lines.append(
            f"collectives per token: all-reduce {report['allreduce_bytes_per_token']:,} bytes, "
            f"logits all-gather {report['allgather_bytes_per_token']:,} bytes; "
            f"{report['link_bytes_per_token_per_device']:,} bytes sent per device (ring)"
        )
    if measured:
        device = report["device"].split(":")[0]
        lines += [
            f"this {device}: read bandwidth {report['bandwidth_gb_s']:.1f} GB/s, matmul {report['matmul_tflops']:.2f} TFLOP/s",
            f"  decode floor {report['decode_floor_ms_per_token']:.2f} ms/token (weights read / bandwidth)",
            f"  prefill ceiling {report['prefill_ceiling_tokens_per_s']:,.0f} tokens/s (matmul / 2 x active parameters)",
        ]
    return lines


def _expert_lines(report: dict, each: str) -> list[str]:
    """A mixture of experts' lines: what one token runs of it and reads."""
    p = report["parameters"]
    if p["active"] == p["total"]:
        return []
    return [
        f"mixture of experts: {p['active']:,} of the {p['total']:,} parameters run per token; "
        f"one sequence's decode step reads {report['decode_read_bytes_per_device'] / (1 << 30):.2f} GiB{each} "
        "(a batch reads more: each row's experts, model/audit.py's experts_touched)"
    ]


def _cmd_serve(args: argparse.Namespace) -> int:
    return _serve(load_settings(args))  # a setting that does not parse stops here


@_with_torch
def _serve(settings: Settings) -> int:
    if settings.api_server_count > 1:  # a supervisor of several fronts and their engine
        from service.fronts import serve_fronts

        return serve_fronts(settings)
    from service.server import serve

    return serve(settings)


@_with_torch
def _cmd_download(args: argparse.Namespace) -> int:
    from model.hub import download

    print(download(args.model, args.revision, args.download_dir))
    return 0


def main(argv: list[str] | None = None) -> int:
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
    _add_held_quantization(aud)
    aud.set_defaults(func=_cmd_audit)
    pl = sub.add_parser(
        "plan", help="capacity plan: what fits in memory, and this machine's floors"
    )
    pl.add_argument(
        "--model", default=None, help="model directory (config only; weights are not read)"
    )
    pl.add_argument("--config", default=None, help="a config.json (HF) or kvserve_config.json")
    pl.add_argument("--device", default="auto")
    pl.add_argument("--dtype", default="auto")
    pl.add_argument("--memory-gib", type=float, default=None, help="default: this device's memory")
    _add_held_quantization(pl)
    pl.add_argument("--seq-len", type=int, default=None, help="default: the model's context length")
    pl.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="devices the model is split over (--memory-gib is then each one's)",
    )
    pl.add_argument("--no-measure", action="store_true", help="skip measuring bandwidth and matmul")
    pl.add_argument("--json", action="store_true", help="print JSON")
    pl.set_defaults(func=_cmd_plan)
    dl = sub.add_parser(
        "download", help="fetch a Hub model's config, weights and tokenizer into the cache"
    )
    dl.add_argument("model", help="a Hugging Face repo id, e.g. HuggingFaceTB/SmolLM2-135M")
    dl.add_argument("--revision", default=None)
    dl.add_argument("--download-dir", default=None, help="default: HF_HOME's cache")
    dl.set_defaults(func=_cmd_download)
    from service import bench_cli

    bn = sub.add_parser(
        "bench", help="serving benchmark against a running server (see service/bench_cli.py)"
    )
    bench_cli.add_arguments(bn)
    bn.set_defaults(func=bench_cli.run_cli)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:  # a bad setting; CheckpointError and TokenizerError are ValueErrors
        print(f"kvserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
