"""Two commits of kvserve serving side by side, taking turns: did a change move the speed?

Checks out --before and --after into git worktrees, starts `kvserve serve` from each (this
venv's Python, each worktree's code) on the same checkpoint and settings, warms both up,
then runs --rounds rounds; in each, both take a single-stream request (decode tok/s =
(chunks - 1) / (last chunk - first chunk)) and a wave of --concurrency requests (output
tok/s), in alternating order, so a drift in the machine's speed falls on both. Prints
every round and the medians; writes JSON.

    PYTHONPATH=. .venv/bin/python benchmarks/serve_ab.py --before 98d6aa5 --after HEAD \\
        --model ../peers/models/llama-cl100k-135m --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from service import bench
from service.bench_cli import wait_healthy
from service.launch import free_port

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--before", required=True, help="a commit")
    ap.add_argument("--after", default="HEAD", help="a commit")
    ap.add_argument("--model", required=True, help="a model directory both serve")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--serve-args", default="", help="more `kvserve serve` flags for both")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "serve_ab.json"))
    args = ap.parse_args()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    model = str(Path(args.model).resolve())
    with tempfile.TemporaryDirectory() as tmp:
        trees = {}
        for side in ("before", "after"):
            trees[side] = Path(tmp) / side
            rev = getattr(args, side)
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(trees[side]), rev],
                check=True,
                capture_output=True,
            )
        try:
            results = run(args, model, trees)
        finally:
            for tree in trees.values():
                subprocess.run(
                    ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                    check=False,
                )
    for side, r in results.items():
        rounds = r["single"], r["concurrent"]
        r["median"] = {
            "single": statistics.median(rounds[0]),
            "concurrent": statistics.median(rounds[1]),
        }
        print(
            f"{side:6s} {getattr(args, side)}: single stream {r['median']['single']:.1f} tok/s "
            f"(rounds {', '.join(f'{x:.1f}' for x in rounds[0])}); {args.concurrency} concurrent "
            f"{r['median']['concurrent']:.1f} tok/s (rounds {', '.join(f'{x:.1f}' for x in rounds[1])})"
        )
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    print(f"wrote {args.out}")


def run(args: argparse.Namespace, model: str, trees: dict[str, Path]) -> dict[str, dict]:
    procs, urls = {}, {}
    try:
        for side, tree in trees.items():
            port = free_port()
            cmd = [
                sys.executable, "-m", "service.cli", "serve", "--model", model,
                "--dtype", args.dtype, "--port", str(port),
                "--max-num-seqs", str(args.concurrency), *shlex.split(args.serve_args),
            ]  # fmt: skip
            env = dict(os.environ, PYTHONPATH=str(tree))
            procs[side] = subprocess.Popen(
                cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            urls[side] = f"http://127.0.0.1:{port}"
            wait_healthy(procs[side], urls[side], 600, f"kvserve at {side}")
        n = args.concurrency
        reqs = bench.workload(
            "fixed", (n + 1) * 2 * (args.rounds + 1), args.prompt_len, args.output_len, 100256, 0
        )
        results = {side: {"single": [], "concurrent": []} for side in trees}
        with bench.event_loop() as loop:
            for url in urls.values():  # warm-up
                loop.run(bench.run(url, reqs[:1], 1, None, 600, None, None, 0))
            i = 1
            for r in range(args.rounds):
                order = list(urls) if r % 2 == 0 else list(reversed(urls))
                for side in order:
                    results[side]["single"].append(
                        loop.run(bench.single_stream(urls[side], *reqs[i]))["decode_tok_s"]
                    )
                    i += 1
                for side in order:
                    wave = reqs[i : i + n]
                    i += n
                    run = loop.run(bench.run(urls[side], wave, n, None, 600, None, None, 0))
                    results[side]["concurrent"].append(run["output_tok_s"])
        return results
    finally:
        for proc in procs.values():
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    main()
