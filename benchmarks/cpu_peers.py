"""kvserve against llama.cpp's server (and vLLM's CPU build) on the same CPU, checkpoint and
workload, in one run.

Both serve the 180M Llama-3-style checkpoint that ../shared/peers/build.sh writes (or
with --model its Qwen3-MoE-shaped one, qwen3moe-cl100k-a100m; kvserve the HF directory,
llama.cpp its GGUFs): kvserve in bf16 and with --quantization int8, llama-server in bf16
and Q8_0 (and fp32 on both with --fp32); with --systems, vLLM's CPU build on the HF
directory (../shared/peers/vllm_cpu.sh), its default binding (vllm-bf16: the engine
computes on one core) and both cores (vllm-bf16-tuned); and the 4-bit files: kvserve
(--quantization auto) and llama.cpp on the Q4_K_M GGUF (kvserve-q4_k_m, llama-q4_k_m),
kvserve and vLLM on an AWQ folder of the checkpoint (kvserve-awq, vllm-awq[-tuned]).
Each server is started on
127.0.0.1, warmed up with one request, and measured with the same streaming client
(service/bench.py): prompts of random token ids sent as id arrays, greedy, `ignore_eos`.

  single stream   one request (llama-server -np 1 -c 2048): decode tok/s = (chunks - 1)
                  / (last chunk - first chunk), and TTFT
  concurrent      --concurrency requests at once (llama-server -np N -c 4096): output
                  tok/s = generated tokens / wall time, TTFT p50; next to it the bf16
                  ceiling of that wave on this machine (model/audit.py's batch_floor: its
                  multiply-adds at the best bf16 matmul rate measured between turns, at
                  KVSERVE_CPU_ISA's level where that is set (bf16_matmul_rate), its
                  reads at the best read bandwidth) and each bf16 system's share of it

All servers of a phase run side by side; each of --rounds rounds gives every system one
turn, one after another (a drift in the machine's speed falls on all), and the table has
the medians over the rounds. With a vLLM server among the systems, each server runs alone
instead, its turns one after another: vLLM's idle engine keeps the cores busy
(docs/decisions.md).

Prints the CPU (model name, the flags that pick kernels), kvserve's kernel levels, a
table with the ratios, and writes JSON (--out).

    PYTHONPATH=. .venv/bin/python benchmarks/cpu_peers.py --peers ../peers --fp32
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks.results import record
from model.audit import batch_floor, count_params, idle_expert_bytes, read_bytes
from model.backends.cpu.isa import cpu_flags, cpu_isa, native_isa
from model.backends.machine import bf16_kernel_rate, matmul_throughput, memory_bandwidth
from model.weights import load_config
from service import bench
from service.bench_cli import wait_healthy
from service.bench_report import cpu_model
from service.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
MODEL = "llama-cl100k-135m"
FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")


def start(
    cmd: list[str], url: str, log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """env: variables added to this process's for the server."""
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=os.environ | (env or {})
        )
    wait_healthy(proc, url, 600, f"{shlex.join(cmd)} (log: {log})")
    return proc


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def llama_files(peers: Path, model: str, variant: str) -> tuple[Path, Path]:
    """build.sh's llama-server and the checkpoint's GGUF of `variant` (bf16, q8_0, f32,
    q4_k_m; llama-quantize's files are named in capitals, Q8_0 and Q4_K_M)."""
    models = peers / "models"
    gguf = next(
        (p for v in (variant, variant.upper()) if (p := models / f"{model}-{v}.gguf").exists()),
        models / f"{model}-{variant}.gguf",
    )
    return peers / "llama.cpp" / "build" / "bin" / "llama-server", gguf


def missing(systems: list[str], peers: Path, model: str) -> list[str]:
    """What the systems need from build.sh's PEERS_DIR that is not there, each with how
    to make it (build.sh writes the HF checkpoint and the f32/bf16 GGUFs, not Q8_0)."""
    lacking = []
    if not (peers / "models" / model).is_dir():
        lacking.append(f"{peers / 'models' / model} (run ../shared/peers/build.sh {peers})")
    for system in systems:
        kind, variant = system.split("-", 1)
        if kind == "vllm" and not (peers / "vllm-venv" / "bin" / "python").exists():
            lacking.append(f"{peers / 'vllm-venv'} (run ../shared/peers/vllm_cpu.sh {peers})")
        if variant.startswith("awq") and not checkpoint_of(peers, model, "awq").is_dir():
            lacking.append(
                f"{checkpoint_of(peers, model, 'awq')} (tests/int_checkpoints.py's "
                f"write_packed({peers / 'models' / model}, ..., 'awq', group=64))"
            )
        if kind != "llama" and variant != "q4_k_m":
            continue
        server, gguf = llama_files(peers, model, variant)
        if not server.exists():
            lacking.append(f"{server} (run ../shared/peers/build.sh {peers})")
        if not gguf.exists():
            lacking.append(
                f"{gguf} (make it with llama.cpp's convert_hf_to_gguf.py "
                f"{peers / 'models' / model} --outtype {variant} --outfile {gguf}, "
                "in build.sh's venv)"
            )
    return sorted(set(lacking))


def command(
    system: str,
    peers: Path,
    model: str,
    port: int,
    slots: int,
    threads: int,
    llama_args: list[str],
) -> list[str]:
    """The server command line for `system` ('kvserve-<bf16|int8|int4|fp32|q4_k_m|awq>',
    'llama-<bf16|q8_0|f32|q4_k_m>' or 'vllm-<bf16|awq>[-tuned]'; kvserve-q4_k_m serves the
    llama.cpp Q4_K_M file itself, the awq systems the AWQ folder: checkpoint_of);
    `llama_args` go to every llama-server."""
    kind, variant = system.split("-", 1)
    if kind == "vllm":
        return [
            str(peers / "vllm-venv" / "bin" / "python"), "-m",
            "vllm.entrypoints.openai.api_server",
            "--model", str(checkpoint_of(peers, model, variant.removesuffix("-tuned"))),
            "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(port),
            "--max-num-seqs", str(max(slots, 16)), "--max-model-len", "2048",
            # on the CPU this is the share of the machine's memory vLLM takes for itself
            # (weights and KV); its default (0.92) does not start beside the other servers
            "--gpu-memory-utilization", "0.25",
        ]  # fmt: skip
    if kind == "llama":
        ctx = 2048 if slots == 1 else 4096
        server, gguf = llama_files(peers, model, variant)
        return [
            str(server), "-m", str(gguf), "-t", str(threads), "-np", str(slots), "-c", str(ctx),
            "--host", "127.0.0.1", "--port", str(port), *llama_args,
        ]  # fmt: skip
    dtype = "float32" if variant == "fp32" else "bfloat16"
    quant = ["--quantization", variant] if variant in ("int8", "int4") else []
    path = checkpoint_of(peers, model, variant)
    return [
        sys.executable, "-m", "service.cli", "serve", "--model", str(path),
        "--dtype", dtype, *quant, "--port", str(port), "--max-num-seqs", str(max(slots, 16)),
    ]  # fmt: skip


def checkpoint_of(peers: Path, model: str, variant: str) -> Path:
    """What a kvserve or vLLM system of `variant` serves: the Q4_K_M GGUF for q4_k_m, the
    AWQ folder (`<model>-awq`: AWQ's GEMM packing of the checkpoint, group 64, as
    tests/int_checkpoints.py packs it) for awq, else the HF folder."""
    if variant == "q4_k_m":
        return llama_files(peers, model, variant)[1]
    return peers / "models" / (f"{model}-awq" if variant == "awq" else model)


def server_env(system: str, peers: Path) -> dict[str, str]:
    """vllm-*-tuned: vLLM's CPU engine on both cores, as its CPU install guide advises
    for a benchmark (by default it computes on one and keeps the other for its server)."""
    if not (system.startswith("vllm") and system.endswith("-tuned")):
        return {}
    return {
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "LD_PRELOAD": str(peers / "vllm-venv" / "lib" / "libiomp5.so"),
    }


def floor_kind(system: str) -> str:
    """Which weight-bandwidth floor a system's weights have: bf16, int8, int4, fp32, or a
    4-bit file's own ('q4_k_m file', 'awq file': each tensor in the kind that keeps it,
    as kvserve's --quantization auto holds them; vLLM's AWQ too)."""
    kind, variant = system.split("-")[:2]
    if kind in ("kvserve", "vllm") and variant in ("q4_k_m", "awq"):
        return f"{variant} file"
    return {"f32": "fp32", "q8_0": "int8", "q4_k_m": "int4"}.get(variant, variant)


BANDWIDTH: list[float] = []  # bytes/s, one probe per single-stream round
COMPUTE: list[float] = []  # bf16 FLOP/s, one probe per concurrent round


def bf16_matmul_rate() -> float:
    """The best rate a step's bf16 matmuls reach here (model.backends.machine.matmul_throughput:
    kvserve's bf16 linear kernel or PyTorch's bf16 matmul, whichever is faster), the
    kernel's alone where KVSERVE_CPU_ISA holds the kernels below the CPU's own level:
    oneDNN would still use the CPU's best units (AMX), a ceiling the servers under test
    are not allowed to reach."""
    if cpu_isa() == native_isa():
        return matmul_throughput(torch.bfloat16)
    return bf16_kernel_rate() or matmul_throughput(torch.bfloat16)


def weight_bytes(model_dir: Path) -> dict[str, float]:
    """Bytes a decode step reads per token: every weight once (a tied head reads the
    embedding matrix), in bf16, and with int8 linears (1 byte + 8 bytes per output row);
    with --quantization int4 as model/audit.py counts its mix; of a mixture of experts,
    only the experts one token runs (model/audit.py)."""
    from safetensors import safe_open

    params, rows = 0, 0
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            shape = f.get_slice(name).get_shape()
            numel = 1
            for d in shape:
                numel *= d
            params += numel
            if len(shape) == 2:
                rows += shape[0]
    cfg = load_config(model_dir)
    return {
        "params": params,
        "active_params": count_params(cfg).active,
        "bf16": 2 * params - idle_expert_bytes(cfg, "bfloat16", "none", 1),
        "int8": params + 8 * rows - idle_expert_bytes(cfg, "bfloat16", "int8", 1),
        "int4": read_bytes(cfg, "bfloat16", "int4"),  # its mix of int4 and int8g
    }


def file_read_bytes(checkpoint: Path) -> float:
    """What a decode step reads of a 4-bit file (a GGUF, an AWQ folder) as kvserve's
    --quantization auto holds it: its integer tensors in their kinds, the rest in bf16
    (model.weights.stored_kinds, model/audit.py's stored_held and read_bytes: a
    tied table stored as integers is held twice, the bf16 lookup table and the head's
    copy in its kind, and a step reads the head and a row of the table)."""
    from model.audit import stored_held
    from model.weights import stored_kinds

    cfg = load_config(checkpoint)
    return read_bytes(cfg, "bfloat16", held=stored_held(cfg, "bfloat16", stored_kinds(checkpoint)))


def measure(systems: list[str], args: argparse.Namespace, slots: int) -> dict[str, Any]:
    """Each system's runs (medians over --rounds, and the rounds): side by side, or one
    server at a time where a vLLM server is among them (its idle engine keeps the cores
    busy, which would slow whichever server is measured beside it)."""
    alone = any(system.startswith("vllm") for system in systems)
    runs: dict[str, list[dict[str, Any]]] = {}
    for group in [[system] for system in systems] if alone else [systems]:
        runs |= side_by_side(group, args, slots)
    out = {}
    for system, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "chunks"}
        if slots == 1:
            med["ms_per_token"] = 1000 / med["decode_tok_s"]
        out[system] = med | {"rounds": rs, "alone": alone}
    return out


def side_by_side(
    systems: list[str], args: argparse.Namespace, slots: int
) -> dict[str, list[dict[str, Any]]]:
    """Start every system's server (each with `slots` slots), warm each up, then take
    --rounds turns: in each round every system runs the workload once, one after another,
    so that a drift in the machine's speed falls on all of them."""
    threads = int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1))
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        for system in systems:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            log = Path(args.out).with_suffix(f".{system}.{slots}.log")
            servers[system] = (
                start(
                    command(
                        system,
                        args.peers,
                        args.model,
                        port,
                        slots,
                        threads,
                        shlex.split(args.llama_args),
                    ),
                    url,
                    log,
                    server_env(system, args.peers),
                ),
                url,
            )
        n = 1 if slots == 1 else args.concurrency
        reqs = bench.workload(
            "fixed", n * (args.rounds + 1), args.prompt_len, args.output_len, 100256, args.seed
        )
        runs: dict[str, list[dict[str, Any]]] = {system: [] for system in systems}
        with bench.event_loop() as loop:
            for _, url in servers.values():  # warm-up
                loop.run(bench.run(url, reqs[:1], 1, None, 600, None, None, args.seed))
            for i in range(1, args.rounds + 1):
                if slots == 1:  # the read bandwidth, between turns, for the floor
                    BANDWIDTH.append(memory_bandwidth("cpu", mib=1024))
                else:  # the matmul rate, between turns, for the wave's ceiling
                    COMPUTE.append(bf16_matmul_rate())
                wave = reqs[i * n : (i + 1) * n]
                for system, (_, url) in servers.items():
                    if slots == 1:
                        runs[system].append(loop.run(bench.single_stream(url, *wave[0])))
                    else:
                        run = loop.run(
                            bench.run(url, wave, slots, None, 600, None, None, args.seed)
                        )
                        if run["errors"]:
                            raise SystemExit(f"{system}: {run['error_examples']}")
                        runs[system].append(
                            {
                                "output_tok_s": run["output_tok_s"],
                                "ttft_p50_s": run["ttft_ms"]["p50"] / 1000,
                            }
                        )
    finally:
        for proc, _ in servers.values():
            stop(proc)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--peers", type=Path, default=ROOT.parent / "peers", help="build.sh's PEERS_DIR"
    )
    ap.add_argument(
        "--model",
        default=MODEL,
        help="a checkpoint build.sh writes under PEERS_DIR/models (qwen3moe-cl100k-a100m: "
        "the mixture of experts)",
    )
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5, help="turns of every system (medians)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fp32", action="store_true", help="also kvserve fp32 and llama.cpp f32")
    ap.add_argument(
        "--systems",
        default=None,
        help="comma-separated subset, or systems to add: vllm-bf16 (vLLM's CPU build, its "
        "default binding) and vllm-bf16-tuned (both cores), from ../shared/peers/vllm_cpu.sh; "
        "kvserve-q4_k_m, llama-q4_k_m, kvserve-awq, vllm-awq[-tuned]",
    )
    ap.add_argument(
        "--llama-args",
        default="",
        help="extra llama-server arguments, e.g. '--no-repack' where llama.cpp's AMX "
        "repacking of Q8_0 crashes (llama.cpp 0c1e570 on this checkpoint)",
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "cpu_peers.json"))
    args = ap.parse_args()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    systems = ["kvserve-bf16", "llama-bf16", "kvserve-int8", "llama-q8_0"]
    if args.fp32:
        systems += ["kvserve-fp32", "llama-f32"]
    if args.systems:
        systems = args.systems.split(",")
    if lacking := missing(systems, args.peers, args.model):
        sys.exit("cpu_peers: missing\n  " + "\n  ".join(lacking))
    flags = sorted(f for f in FLAGS if f in cpu_flags())
    header = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "model": args.model,
        "flags": flags,
        "kvserve_isa": cpu_isa(),
        "llama_args": args.llama_args,
        "workload": {
            k: getattr(args, k) for k in ("prompt_len", "output_len", "concurrency", "rounds")
        },
    }
    print(f"CPU: {header['cpu']}, {header['cores']} cores; flags: {' '.join(flags)}")
    print(f"kvserve kernels: {header['kvserve_isa']}")
    if args.llama_args:
        print(f"llama-server also gets: {args.llama_args}")
    single_runs = measure(systems, args, 1)
    concurrent_runs = measure(systems, args, args.concurrency)
    rows = {s: {"single": single_runs[s], "concurrent": concurrent_runs[s]} for s in systems}
    sizes = weight_bytes(args.peers / "models" / args.model)
    bandwidth = max(BANDWIDTH)
    for kind in {floor_kind(s) for s in systems if floor_kind(s).endswith(" file")}:
        variant = kind.removesuffix(" file")
        sizes[kind] = file_read_bytes(checkpoint_of(args.peers, args.model, variant))
    floors = {v: n / bandwidth * 1000 for v, n in sizes.items() if "params" not in v}
    floors["fp32"] = floors["bf16"] * 2
    print(
        f"\nread bandwidth {bandwidth / 1e9:.1f} GB/s (best of {len(BANDWIDTH)} probes, median "
        f"{statistics.median(BANDWIDTH) / 1e9:.1f}): weight-bandwidth floor "
        + ", ".join(f"{v} {ms:.1f} ms/token" for v, ms in floors.items())
    )
    print()
    print(
        f"| system | decode tok/s (1 stream) | ms/token | ratio to floor | TTFT 1 stream "
        f"| {args.concurrency} concurrent tok/s | TTFT p50 |"
    )
    print("|---|---|---|---|---|---|---|")
    for system, r in rows.items():
        s, c = r["single"], r["concurrent"]
        floor = floors[floor_kind(system)]
        s["ratio_to_floor"] = s["ms_per_token"] / floor
        print(
            f"| {system} | {s['decode_tok_s']:.1f} | {s['ms_per_token']:.1f} | {s['ratio_to_floor']:.2f}x | {s['ttft_s'] * 1000:.0f} ms "
            f"| {c['output_tok_s']:.1f} | {c['ttft_p50_s']:.2f} s |"
        )
    wave = batch_floor(
        load_config(args.peers / "models" / args.model), "bfloat16", args.concurrency,
        args.prompt_len, args.output_len, bandwidth, max(COMPUTE),
    )  # fmt: skip
    print(
        f"\n{args.concurrency} concurrent, bf16 ceiling on this machine at {cpu_isa()}: "
        f"{wave['ceiling_tok_s']:.1f} tok/s ({wave['seconds']:.2f} s: prefill "
        f"{wave['prefill_gflop']:.0f} GFLOP, then {args.output_len - 1} steps of "
        f"{wave['decode_gflop_per_step']:.2f} GFLOP / {wave['decode_mb_per_step']:.0f} MB "
        f"from the first) at {max(COMPUTE) / 1e9:.0f} GFLOP/s (best of {len(COMPUTE)} probes, "
        f"median {statistics.median(COMPUTE) / 1e9:.0f}) and {bandwidth / 1e9:.1f} GB/s"
    )
    for system in [s for s in rows if floor_kind(s) == "bf16"]:
        if system in rows:
            c = rows[system]["concurrent"]
            c["share_of_ceiling"] = c["output_tok_s"] / wave["ceiling_tok_s"]
            print(f"  {system}: {c['output_tok_s']:.1f} tok/s, {c['share_of_ceiling']:.0%} of it")
    ratios = {}
    for ours, theirs in (("kvserve-bf16", "llama-bf16"), ("kvserve-int8", "llama-q8_0"),
                         ("kvserve-int8", "kvserve-bf16"), ("kvserve-fp32", "llama-f32"),
                         ("kvserve-int4", "llama-q4_k_m"), ("kvserve-int4", "kvserve-bf16"),
                         ("kvserve-q4_k_m", "llama-q4_k_m"), ("kvserve-awq", "vllm-awq"),
                         ("kvserve-awq", "vllm-awq-tuned"),
                         ("kvserve-bf16", "vllm-bf16"), ("kvserve-bf16", "vllm-bf16-tuned")):  # fmt: skip
        if ours in rows and theirs in rows:
            ratios[f"{ours} / {theirs}"] = {
                "single": rows[ours]["single"]["decode_tok_s"]
                / rows[theirs]["single"]["decode_tok_s"],
                "concurrent": rows[ours]["concurrent"]["output_tok_s"]
                / rows[theirs]["concurrent"]["output_tok_s"],
            }
    print()
    for name, r in ratios.items():
        print(
            f"{name}: single stream {r['single']:.2f}x, {args.concurrency} concurrent {r['concurrent']:.2f}x"
        )
    extra = {
        "bandwidth_probes": BANDWIDTH,
        "bf16_matmul_probes": COMPUTE,
        "weight_bytes": sizes,
        "floors_ms": floors,
        "concurrent_bf16_floor": wave,
    }
    Path(args.out).write_text(
        json.dumps(header | extra | {"results": rows, "ratios": ratios}, indent=2)
    )
    print(f"\nwrote {args.out}")
    record(f"cpu_peers ({args.model}{table_of(systems)})", headline(rows, ratios, args))


def table_of(systems: list[str]) -> str:
    """The 4-bit systems' runs are tables of their own beside the bf16/int8 one: the GGUF
    and int4 one against llama.cpp, the AWQ one against vLLM."""
    if any(floor_kind(system) == "int4" or "q4" in system for system in systems):
        return ", 4-bit"
    return ", AWQ" if any("awq" in system for system in systems) else ""


def headline(
    rows: dict[str, dict[str, Any]], ratios: dict[str, dict[str, float]], args: argparse.Namespace
) -> dict[str, str]:
    """docs/results.md's rows: each system's single-stream decode (and its ratio to the
    floor) and concurrent tok/s, then kvserve's ratios to its peers."""
    shape = f"{args.prompt_len} in, {args.output_len} out"
    out = {}
    for system, r in rows.items():
        s, c = r["single"], r["concurrent"]
        out[f"{system}: 1 stream decode ({shape})"] = (
            f"{s['decode_tok_s']:.1f} tok/s ({s['ratio_to_floor']:.2f}x the floor)"
        )
        out[f"{system}: {args.concurrency} streams"] = f"{c['output_tok_s']:.1f} tok/s"
    for name, r in ratios.items():
        out[name] = f"{r['single']:.2f}x at 1 stream, {r['concurrent']:.2f}x at {args.concurrency}"
    return out


if __name__ == "__main__":
    main()
