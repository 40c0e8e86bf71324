"""Start the ranks of tests/engine/exec/tp_rank.py as processes: on this host, or each in a
network namespace of its own joined by a veth pair (two hosts as far as gloo can tell)."""

import os
import subprocess
import sys
from pathlib import Path

from service.launch import rendezvous
from tests.factories import (
    write_gemma3,
    write_gpt2,
    write_gpt_oss,
    write_granite,
    write_llama,
    write_mistral,
    write_mixtral,
    write_olmo2,
    write_olmoe,
    write_phi3,
    write_qwen2,
    write_qwen2_moe,
    write_qwen3,
    write_qwen3_moe,
)
from tests.int_checkpoints import packed_from

# the checkpoints the tensor-parallel tests split: K/V heads split over 2 ranks, and
# fewer K/V heads than ranks (each holds a replica), q/k/v biases, GPT-2's fused Conv1D
WRITERS = {
    "llama_kv_split": lambda p: write_llama(p, tied=False),  # 8 heads, 2 K/V heads
    "llama_kv_replicated": lambda p: write_llama(p, tied=True, num_key_value_heads=1),
    "qwen2": write_qwen2,
    "qwen3": write_qwen3,  # q/k norms: one weight shared by the heads each rank holds
    "granite": write_granite,  # residuals scaled after the all-reduce
    "gemma3": write_gemma3,  # GeGLU's gate | up split per rank, sandwich norms, windows
    "phi3": write_phi3,  # q|k|v and gate|up one tensor each; each rank's heads reordered
    # q/k norms over every head together: the ranks' sums of squares joined (K/V heads
    # split, and one K/V head each rank holds a replica of)
    "olmo2": write_olmo2,
    "olmo2_kv_replicated": lambda p: write_olmo2(p, num_key_value_heads=1),
    # every layer windowed (8 keys): all the K/V in the window pool
    "mistral_window": lambda p: write_mistral(p, sliding_window=8),
    "gpt2": write_gpt2,
    # mixtures of experts: each rank every expert's share of its features, the router
    # replicated (a dense layer among the sparse ones; a shared expert behind its gate)
    "qwen3_moe": write_qwen3_moe,
    "qwen2_moe": write_qwen2_moe,
    "mixtral": write_mixtral,  # top 2 of 4, renormalized
    "olmoe": write_olmoe,  # q/k norms over the whole projections, split by head
    # GPTQ experts (activation order): each rank unpacks, then takes its share
    "qwen3_moe_gptq": lambda p: packed_from(write_qwen3_moe, p, "gptq", group=32, desc_act=True),
    # sinks split by head, expert biases (down's added once), windows beside global layers
    "gpt_oss": write_gpt_oss,
}

ROOT = Path(__file__).resolve().parents[3]


def run_ranks(
    world: int,
    argv: list[str],
    master: str = "127.0.0.1",
    wrap: list[list[str]] | None = None,
    env: list[dict[str, str]] | None = None,
    timeout: float = 240,
) -> list[subprocess.CompletedProcess]:
    """Run `python *argv` (`-m tests.engine.exec.tp_rank CKPT OUT`, or `-c CODE`) as `world`
    ranks; wrap[r]: a command prefix for rank r (ip netns exec NS); env[r]: its extra
    variables."""
    shared = rendezvous(world) | {
        "MASTER_ADDR": master,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
    }
    procs = []
    for rank in range(world):
        prefix = wrap[rank] if wrap else []
        extra = env[rank] if env else {}
        procs.append(
            subprocess.Popen(
                [*prefix, sys.executable, *argv],
                env=os.environ | shared | extra | {"RANK": str(rank), "LOCAL_RANK": str(rank)},
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    results = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out))
    return results
