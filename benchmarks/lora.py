"""LoRA adapters against the base model on one server, in one run: what serving adapters
costs in decode speed.

One `kvserve serve` of --model (the peer's 180M Llama-3-style checkpoint by default) with
--adapters adapters of rank --rank on every projection (q, k, v, o, gate, up, down),
written by `peft` with random weights into benchmarks/out/lora/ (once), all in the bank
at once (--max-loras). Each of --rounds rounds, in alternating order, gives both sides
one turn of each:

  single stream   one request (decode tok/s = (chunks - 1) / (last chunk - first chunk)):
                  the base model's, and one adapter's
  concurrent      --concurrency clients, each sending its next request when one ends:
                  all naming the base model, or client i naming adapter i % --adapters
                  (output tok/s = generated tokens / wall time)

Then three more waves: the base model's, one over the adapters, and one over them while
another adapter is loaded and unloaded every second (/v1/load_lora_adapter, an admin
key): the streams' worst gap between tokens in each.

Prints the CPU, a table of the medians and the adapters' share of the base model's, and
writes JSON (--out); records the row in docs/results.md.

    PYTHONPATH=. .venv/bin/python benchmarks/lora.py --model ../peers/models/llama-cl100k-135m
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import subprocess
import sys
from pathlib import Path

import httpx
import torch

from benchmarks.results import record
from service import bench
from service.bench_cli import wait_healthy
from service.bench_report import cpu_model
from service.launch import free_port
from tests.factories import write_adapter

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out"
ADMIN = secrets.token_hex(16)  # the server's admin key, for the loads
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="../peers/models/llama-cl100k-135m")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--serve-args", default="", help="more `kvserve serve` flags")
    ap.add_argument("--out", default=str(OUT / "lora.json"))
    args = ap.parse_args()
    model = Path(args.model).resolve()
    folders = write_adapters(model, args.adapters + 1, args.rank)
    churned = folders.pop(f"a{args.adapters}")  # the one loaded and unloaded
    results, churn = measure(args, model, folders, churned)
    report(args, results, churn)


def write_adapters(model: Path, n: int, rank: int) -> dict[str, Path]:
    """n rank-`rank` adapters of every projection of `model`, random A and B (peft's
    default B is zero: no delta), written once under benchmarks/out/lora/."""
    import transformers as tf

    folders = {f"a{i}": OUT / "lora" / f"{model.name}-r{rank}-{i}" for i in range(n)}
    for i, folder in enumerate(folders.values()):
        if not (folder / "adapter_model.safetensors").is_file():
            hf = tf.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
            write_adapter(hf, folder, i, r=rank, lora_alpha=2 * rank, target_modules=PROJECTIONS)
    return folders


def measure(
    args: argparse.Namespace, model: Path, adapters: dict[str, Path], churned: Path
) -> tuple[dict, dict]:
    """The rounds' results by side, and the base, calm and churning waves'."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    modules = ",".join(f"{name}={path}" for name, path in adapters.items())
    cmd = [
        sys.executable, "-m", "service.cli", "serve", "--model", str(model), "--port",
        str(port), "--dtype", "bfloat16", "--lora-modules", modules, "--max-loras",
        str(len(adapters)), "--max-lora-rank", str(args.rank), "--max-num-seqs",
        str(args.concurrency), "--admin-api-keys", ADMIN, *args.serve_args.split(),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(proc, url, 600, "kvserve")
        results = rounds(args, url, model.name, list(adapters))
        return results, churn_waves(args, url, model.name, list(adapters), churned)
    finally:
        proc.terminate()
        proc.wait()


def rounds(args: argparse.Namespace, url: str, base: str, names: list[str]) -> dict:
    n = args.concurrency
    reqs = bench.workload(
        "fixed", (n + 1) * 2 * (args.rounds + 1), args.prompt_len, args.output_len, 100256, 0
    )
    sides = {"base": base, "adapters": names}
    results: dict = {side: {"single": [], "concurrent": []} for side in sides}
    with bench.event_loop() as loop:
        for model in (base, *names):  # warm-up: every adapter into the bank
            loop.run(bench.run(url, reqs[:1], 1, None, 600, model, None, 0))
        i = 1
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for side in order:
                one = base if side == "base" else names[r % len(names)]
                single = loop.run(bench.single_stream(url, *reqs[i], one))
                results[side]["single"].append(single["decode_tok_s"])
                i += 1
            for side in order:
                wave = reqs[i : i + n]
                i += n
                run = loop.run(bench.run(url, wave, n, None, 600, sides[side], None, 0))
                if run["errors"]:
                    raise SystemExit(f"{side}: {run['error_examples']}")
                results[side]["concurrent"].append(run["output_tok_s"])
    return results


def churn_waves(
    args: argparse.Namespace, url: str, base: str, names: list[str], churned: Path
) -> dict:
    """The worst inter-token gap of a wave of the base model, of one over the adapters,
    and of one while another adapter is loaded and unloaded every second: between
    tokens (bench.run's per_token), not between pieces of text (a character of two
    tokens comes as one piece, two steps after the last)."""
    n = args.concurrency
    reqs = bench.workload("fixed", 12 * n, args.prompt_len, args.output_len, 100256, 1)
    out = {}
    with bench.event_loop() as loop:
        plain = loop.run(bench.run(url, reqs[: 4 * n], n, None, 600, base, None, 0, True))
        calm = loop.run(bench.run(url, reqs[4 * n : 8 * n], n, None, 600, names, None, 0, True))
        churning = loop.run(_churning(url, reqs[8 * n :], n, names, churned))
    for name, run in (("base", plain), ("calm", calm), ("churn", churning)):
        if run["errors"]:
            raise SystemExit(f"{name}: {run['error_examples']}")
        out[name] = {"itl_max_ms": run["itl_ms"]["max"], "output_tok_s": run["output_tok_s"]}
    out["churn"]["cycles"] = churning["cycles"]
    return out


async def _churning(url: str, wave: list, n: int, names: list[str], folder: Path) -> dict:
    stop = asyncio.Event()
    cycles = asyncio.create_task(_load_unload(url, folder, stop))
    run = await bench.run(url, wave, n, None, 600, names, None, 0, per_token=True)
    stop.set()
    return run | {"cycles": await cycles}


async def _load_unload(url: str, folder: Path, stop: asyncio.Event) -> int:
    """Load and unload the adapter at `folder`, half a second each, until `stop`."""
    cycles = 0
    headers = {"Authorization": f"Bearer {ADMIN}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as client:
        while not stop.is_set():
            body = {"lora_name": "churn", "lora_path": str(folder)}
            (await client.post("/v1/load_lora_adapter", json=body)).raise_for_status()
            await asyncio.sleep(0.5)
            body = {"lora_name": "churn"}
            (await client.post("/v1/unload_lora_adapter", json=body)).raise_for_status()
            await asyncio.sleep(0.5)
            cycles += 1
    return cycles


def report(args: argparse.Namespace, results: dict, churn: dict) -> None:
    median = {s: {k: statistics.median(v) for k, v in r.items()} for s, r in results.items()}
    share = {k: median["adapters"][k] / median["base"][k] for k in ("single", "concurrent")}
    print(f"CPU: {cpu_model()}")
    print(f"{args.adapters} adapters of rank {args.rank} on every projection, {args.rounds} rounds")
    print(f"{'':10s} {'single tok/s':>13s} {f'{args.concurrency} streams tok/s':>18s}")
    for side, m in median.items():
        print(f"{side:10s} {m['single']:13.1f} {m['concurrent']:18.1f}")
    print(f"{'share':10s} {share['single']:13.2f} {share['concurrent']:18.2f}")
    plain, calm = churn["base"]["itl_max_ms"], churn["calm"]["itl_max_ms"]
    churning = churn["churn"]["itl_max_ms"]
    print(f"worst gap between tokens: base {plain:.1f} ms, over the adapters {calm:.1f} ms, with "
          f"an adapter loaded and unloaded every second ({churn['churn']['cycles']} times) "
          f"{churning:.1f} ms")  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rounds": results, "median": median,
                               "share": share, "churn": churn, "cpu": cpu_model()}, indent=2))  # fmt: skip
    print(f"wrote {out}")
    m, c = median, args.concurrency
    record(
        f"lora ({args.adapters} adapters, rank {args.rank}, every projection"
        + (f", {args.serve_args})" if args.serve_args else ")"),
        {
            "single-stream decode, adapter / base": (
                f"{m['adapters']['single']:.1f} / {m['base']['single']:.1f} tok/s "
                f"({share['single']:.2f}x)"
            ),
            f"{c} streams over the adapters / base": (
                f"{m['adapters']['concurrent']:.1f} / {m['base']['concurrent']:.1f} tok/s "
                f"({share['concurrent']:.2f}x)"
            ),
            "worst gap between tokens, base / adapters / an adapter loaded and unloaded "
            "each second": f"{plain:.1f} / {calm:.1f} / {churning:.1f} ms",
        },
    )


if __name__ == "__main__":
    main()
