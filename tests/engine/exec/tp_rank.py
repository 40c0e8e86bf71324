"""One tensor-parallel rank of the tests, built the way `kvserve serve` builds it:
`python -m tests.engine.exec.tp_rank CKPT OUT [KV_CACHE_GIB [KV_HOST_GIB]]` with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (tests/engine/exec/tp_ranks.py starts them). Every
rank runs the same dense forward; rank 0 then serves greedy requests through the engine
while the others follow, and writes what it saw to OUT as JSON. With a host tier, rank 0
then evicts the first prompt's blocks with others and serves it again from the tier."""

import json
import os
import sys
import time
from pathlib import Path

import torch

from service.build import build
from service.config import Settings
from service.engine.request import SamplingParams

PROMPTS = {"a": list(range(3, 40)), "b": [7, 8, 9, 7, 8, 9, 11], "c": list(range(100, 130))}


def settings(
    ckpt: str, world: int, kv_cache_gib: float = 0.001, kv_host_gib: float = 0.0
) -> Settings:
    return Settings(
        kv_host_gib=kv_host_gib,
        model=ckpt,
        dtype="float32",
        tensor_parallel_size=world,
        block_size=4,
        kv_cache_gib=kv_cache_gib,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        mixed_prefill_tokens=0,
        rank_timeout=60,
    )


def dense_tokens(vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (48,), generator=torch.Generator().manual_seed(0))


def serve(engine) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """Greedy requests (with logprobs) through the engine, batched and chunked."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            logprobs.setdefault(out.request_id, []).extend(lp.logprob for lp in out.logprobs)
    report = {"tokens": tokens, "logprobs": logprobs}
    tier = engine.blocks.tier
    if tier is not None:  # others' prompts take the whole pool twice over, then "a" again
        pool = engine.blocks.num_blocks * engine.blocks.block_size
        each = min(pool // 2, engine.max_model_len - 20)
        evict = {f"evict{i}": list(range(200 + i * each, 200 + (i + 1) * each))
                 for i in range(-(-2 * pool // each))}  # fmt: skip
        again = {"a again": PROMPTS["a"]}
        for batch in (evict, again):
            for rid, prompt in batch.items():
                engine.add_request(rid, [t % engine.model.cfg.vocab_size for t in prompt], params)
            while engine.has_unfinished():
                for out in engine.step():
                    tokens.setdefault(out.request_id, []).extend(out.token_ids)
        report["restored"] = tier.stats.restored
    return report


def _thread_name(tid: str) -> str:
    try:
        return Path(f"/proc/self/task/{tid}/comm").read_text().strip()
    except FileNotFoundError:
        return "(exited)"


def left_cleanly(within: float = 5.0) -> int:
    """After leaving the process group a rank runs no thread but its own: a gloo worker
    thread still alive when the interpreter finalises can abort the process (SIGABRT).
    A thread already on its way out gets `within` seconds to finish (on a loaded host
    the check can run before it is scheduled)."""
    deadline = time.monotonic() + within
    while len(tasks := os.listdir("/proc/self/task")) != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    if len(tasks) != 1:
        names = sorted(_thread_name(t) for t in tasks)
        print(f"{len(tasks) - 1} threads outlive the process group: {names}", flush=True)
        return 3
    return 0


@torch.inference_mode()
def main(ckpt: str, out: str, kv_cache_gib: float, kv_host_gib: float) -> int:
    world = int(os.environ["WORLD_SIZE"])
    engine = build(settings(ckpt, world, kv_cache_gib, kv_host_gib)).engine
    model = engine.model
    logits = model(dense_tokens(model.cfg.vocab_size))  # a collective: every rank runs it
    if model.tp.rank != 0:
        engine.follow()
        return left_cleanly()
    report = serve(engine)
    engine.close()
    if status := left_cleanly():
        return status
    report |= {
        "logits": logits.tolist(),
        "kv_blocks": engine.blocks.num_blocks,
        "kv_window_blocks": engine.kv_cache.window_blocks,
        "window_only": engine.kv_cache.window_only,
        "kv_pool_bytes": engine.kv_cache.nbytes,
    }
    Path(out).write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    cache_gib = float(sys.argv[3]) if len(sys.argv) > 3 else 0.001
    host_gib = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    sys.exit(main(sys.argv[1], sys.argv[2], cache_gib, host_gib))
