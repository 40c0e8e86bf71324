"""What --quantization int8 (or int4, or fp8) costs in quality, against the same checkpoint
in bf16.

For each checkpoint (the test suite's transformers-written parity checkpoints: Llama with
GQA, tied and untied, Qwen2 with q/k/v biases, GPT-2; and the peer checkpoint --base of
../shared/peers when --peers has it: the 180M Llama-3-style one, or the Qwen3-MoE-shaped
one), loaded twice in bf16: int8 and int4 on
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

With --llama BIN (llama.cpp's build/bin) and --text FILE, llama.cpp's own measure is taken
too: its llama-perplexity saves the bf16 GGUF's next-token distributions over --chunks
chunks of --ctx tokens of the text, then gives the mean KL and same-top share of each
--files GGUF against them (--kl-divergence); the peer checkpoint's runs here read those
chunks' tokens and score the positions llama-perplexity scores (the second half of each
chunk), so both engines' numbers are over the same next-token distributions; and those
runs are scored by llama.cpp's measure too (llama_measure: its bf16 log-probs stored in
16 bits, cut at -16, the same-top share on the stored ones), so both engines' numbers
are the same arithmetic. Those rows go to docs/results.md.

With --files NAME=PATH (a GGUF file or an AWQ/GPTQ folder of the peer checkpoint), each
file is loaded as it is (none: its weights dequantized to bf16), as the server holds it by
default (auto: each integer tensor in the kind that keeps its values, int4, int8g or
int8) and with --quantization, each against the peer checkpoint's bf16: what the file's
own bits cost, and what kvserve's kernels add on top of them.

Prints a table and writes JSON (--out).

    PYTHONPATH=. .venv/bin/python benchmarks/int8_quality.py --peers ../peers
    PYTHONPATH=. .venv/bin/python benchmarks/int8_quality.py --quantization int4 --peers ../peers \
        --files q4_0=../peers/models/llama-cl100k-135m-Q4_0.gguf
    PYTHONPATH=. .venv/bin/python benchmarks/int8_quality.py --quantization int4 --peers ../peers \
        --llama ../peers/llama.cpp/build/bin --text llama.cpp-docs.txt --llama-args=--no-repack \
        --files q4_k_m=../peers/models/llama-cl100k-135m-Q4_K_M.gguf
    PYTHONPATH=. .venv/bin/python benchmarks/int8_quality.py --quantization fp8
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import struct
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.results import record
from model.backends.fp8 import Fp8Linear, to_fp8
from model.loader import load
from service.config import Settings
from service.engine.core.engine import LLMEngine
from service.engine.request import SamplingParams
from tests import factories as hf

ROOT = Path(__file__).resolve().parents[1]


PEER = "peer"  # the name of the --base run


def checkpoints(tmp: Path, peers: Path | None, base: str) -> dict[str, Path]:
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
    big = peers / "models" / base if peers else None
    if big is not None and (big / "config.json").exists():
        out[PEER] = big
    return out


def llama_chunks(base: Path, bos: int | None) -> tuple[list[list[int]], int]:
    """The token chunks in a llama-perplexity --kl-divergence-base file ('_logits_', n_ctx,
    n_vocab, n_chunk, then n_ctx * n_chunk int32 tokens before the log-probs), each
    chunk's first token made `bos` as llama-perplexity makes it where the vocab adds
    one; and the first position it scores (n_ctx / 2: the next-token distributions from
    there to the chunk's second-to-last token)."""
    data = base.read_bytes()
    assert data[:8] == b"_logits_", f"{base} is not a llama-perplexity logits file"
    n_ctx, _, n_chunk = struct.unpack_from("<Iii", data, 8)
    tokens = struct.unpack_from(f"<{n_ctx * n_chunk}i", data, 20)
    chunks = [list(tokens[i * n_ctx : (i + 1) * n_ctx]) for i in range(n_chunk)]
    for chunk in chunks:
        chunk[0] = bos if bos is not None else chunk[0]
    return chunks, n_ctx // 2


def llama_kl(
    args: argparse.Namespace, tmp: Path
) -> tuple[dict[str, dict[str, float]], tuple[list[list[int]], int]]:
    """llama.cpp's own measure on each --files GGUF: llama-perplexity saves the bf16
    GGUF's log-probs over --chunks chunks of --ctx tokens of --text
    (--kl-divergence-base), then scores each file against them (--kl-divergence); and
    those chunks (llama_chunks), each starting with BOS where the vocab adds one, as
    llama-perplexity starts them."""
    from model.gguf import open_gguf

    bf16 = args.peers / "models" / f"{args.base}-bf16.gguf"
    base, tool = tmp / "base.kld", str(args.llama / "llama-perplexity")
    common = ["-c", str(args.ctx), "-t", str(os.cpu_count()), "-b", str(args.ctx)]
    common += shlex.split(args.llama_args)
    run = [tool, "-m", str(bf16), "-f", str(args.text), "--chunks", str(args.chunks)]
    subprocess.run([*run, *common, "--kl-divergence-base", str(base)], check=True,
                   capture_output=True)  # fmt: skip
    out = {}
    for name, file in (f.split("=", 1) for f in args.files):
        if not file.endswith(".gguf"):
            continue
        scored = [tool, "-m", file, *common, "--kl-divergence-base", str(base), "--kl-divergence"]
        log = subprocess.run(scored, check=True, capture_output=True, text=True)
        text = log.stdout + log.stderr
        kl = re.search(r"Mean\s+KLD:\s+([0-9.]+)", text)
        top = re.search(r"Same top p:\s+([0-9.]+)", text)
        assert kl and top, f"llama-perplexity printed no KLD for {file}"
        out[name] = {"kl_mean": float(kl.group(1)), "top1_agreement": float(top.group(1)) / 100}
        print(f"llama.cpp {name}", json.dumps(out[name]), flush=True)
    f = open_gguf(bf16)
    bos = (
        f.field("tokenizer.ggml.bos_token_id") if f.field("tokenizer.ggml.add_bos_token") else None
    )
    return out, llama_chunks(base, bos)


def llama_measure(ref: torch.Tensor, got: torch.Tensor) -> tuple[list[float], list[bool]]:
    """Each position's KL and same top as llama-perplexity's --kl-divergence computes them
    from logits (P, V) (tools/perplexity/perplexity.cpp): the reference's log-probs kept
    as 16-bit steps over its top 16 nats (log_softmax: below max - 16 one floor value),
    the KL summed over the tokens whose kept log-prob is above -16, the top the first
    of the kept log-probs' largest."""
    ref, got = ref.float(), got.float()
    top = ref.amax(-1, keepdim=True)
    low = torch.maximum(ref.amin(-1, keepdim=True), top - 16)
    lse = torch.exp(ref - top).double().sum(-1, keepdim=True).log().float()
    floor, scale = low - top - lse, (top - low) / 65535
    steps = torch.where(ref > low, torch.round((ref - low) * (1 / scale)), 0.0)
    base = torch.where(scale > 0, scale * steps + floor, floor)
    logq = got - got.amax(-1, keepdim=True)
    logq = logq - torch.exp(logq).double().sum(-1, keepdim=True).log().float()
    terms = torch.where(base > -16, torch.exp(base) * (base - logq), 0.0)
    kl = terms.double().sum(-1).tolist()
    return kl, (base.argmax(-1) == got.argmax(-1)).tolist()


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
def compare(
    ref: Path,
    path: Path,
    quantization: str,
    args: argparse.Namespace,
    chunks: tuple[list[list[int]], int] | None = None,
) -> dict[str, Any]:
    """ref's bf16 against path's with `quantization`, on random prompts or on `chunks`
    (llama_chunks': the logits from its first scored position on)."""
    backend = "torch" if args.quantization == "fp8" else "cpu"
    bf16, quant = engine(ref, "none", backend), engine(path, quantization, backend)
    cfg = bf16.model.cfg
    gen = torch.Generator().manual_seed(args.seed)
    length = min(args.prompt_len, cfg.max_position - args.output_len)
    prompts = [
        torch.randint(0, min(cfg.vocab_size, 100256), (length,), generator=gen).tolist()
        for _ in range(args.prompts)
    ]
    scored = slice(None)  # every position's next-token distribution
    if chunks is not None:  # llama-perplexity's tokens and positions
        prompts, scored = chunks[0], slice(chunks[1], -1)
    diffs, agree, scale, kl, llama_kl, llama_top = [], [], [], [], [], []
    for p in prompts:
        ids = torch.tensor(p)
        a, b = bf16.model(ids).float()[scored], quant.model(ids).float()[scored]
        diffs.append((a - b).abs())
        agree.append((a.argmax(-1) == b.argmax(-1)).float().mean().item())
        scale.append(a.std().item())
        logp, logq = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
        kl.append((logp.exp() * (logp - logq)).sum(-1).mean().item())
        if chunks is not None:
            position_kl, same = llama_measure(a, b)
            llama_kl += position_kl
            llama_top += same
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
    measured = {}
    if chunks is not None:  # every position counted alike, as llama-perplexity counts them
        measured = {"llama_kl_mean": statistics.fmean(llama_kl),
                    "llama_top1_agreement": statistics.fmean(llama_top)}  # fmt: skip
    return measured | {
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
    args = parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = checkpoints(Path(tmp), args.peers, args.base)
        runs = [(name, path, path, args.quantization) for name, path in paths.items()]
        for name, file in (f.split("=", 1) for f in args.files):
            for q in ("none", "auto", args.quantization):
                runs.append((f"{name} ({q})", paths[PEER], Path(file), q))
        llama, chunks = {}, None
        if args.llama is not None:
            llama, chunks = llama_kl(args, Path(tmp))
        for name, ref, path, q in runs:
            big = ref == paths.get(PEER)  # llama-perplexity's tokens are its vocab's
            results[name] = compare(ref, path, q, args, chunks if big else None)
            print(name, json.dumps({k: round(v, 4) for k, v in results[name].items()}), flush=True)
    print_table(results, llama, args)
    Path(args.out).write_text(
        json.dumps(
            {"args": vars(args) | {"peers": str(args.peers)}, "results": results, "llama": llama},
            indent=2,
            default=str,
        )
    )
    print(f"\nwrote {args.out}")
    if args.llama is not None:
        record(f"int4_quality ({args.base})", headline(results, llama))


def parse_args() -> argparse.Namespace:
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
        "--base", default="llama-cl100k-135m",
        help="the peer checkpoint (a folder of --peers' models, and its -bf16.gguf)",
    )  # fmt: skip
    ap.add_argument(
        "--llama", type=Path, default=None, metavar="BIN",
        help="llama.cpp's build/bin (llama-perplexity): its own KL of each --files GGUF, and "
        "the peer checkpoint's runs on its tokens and positions",
    )  # fmt: skip
    ap.add_argument("--text", type=Path, default=None, help="with --llama: the text it reads")
    ap.add_argument("--ctx", type=int, default=512, help="with --llama: tokens a chunk")
    ap.add_argument("--chunks", type=int, default=8, help="with --llama: chunks read")
    ap.add_argument("--llama-args", default="", help="with --llama: more llama-perplexity flags")
    ap.add_argument(
        "--out", default=None, help="default: benchmarks/out/<quantization>_quality.json"
    )
    args = ap.parse_args()
    args.out = args.out or str(ROOT / "benchmarks" / "out" / f"{args.quantization}_quality.json")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if args.llama is not None and args.text is None:
        ap.error("--llama reads --text")
    return args


def print_table(results: dict, llama: dict, args: argparse.Namespace) -> None:
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
    for name, r in llama.items():
        print(f"| llama.cpp {name} | | | | | {r['top1_agreement']:.1%} | {r['kl_mean']:.4f} | | |")


def headline(results: dict, llama: dict) -> dict[str, str]:
    """The peer checkpoint's runs and llama.cpp's, on the same positions, for the results
    table."""
    rows = {}
    for name, r in results.items():
        if name == PEER or " (" in name:
            file, _, held = name.rstrip(")").partition(" (")
            label = "int4 of the bf16 checkpoint" if not held else f"{file} file as {held}"
            rows[f"kvserve {label}: mean KL, top-1"] = (
                f"{r['kl_mean']:.5f}, {r['top1_agreement']:.1%}"
            )
            if "llama_kl_mean" in r:
                rows[f"kvserve {label}: llama.cpp's measure"] = (
                    f"{r['llama_kl_mean']:.6f}, {r['llama_top1_agreement']:.2%}"
                )
    for name, r in llama.items():
        rows[f"llama.cpp {name} file: mean KL, top-1"] = (
            f"{r['kl_mean']:.6f}, {r['top1_agreement']:.2%}"
        )
    return rows


if __name__ == "__main__":
    main()
