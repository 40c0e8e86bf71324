"""Joining the tensor-parallel group (model.parallel.join): ranks start side by side but
reach the join seconds apart on a loaded host, and --rank-timeout (how long a collective
waits for a rank) must not bound that wait."""

import os
import subprocess
import sys
from pathlib import Path

from service.launch import rendezvous

ROOT = Path(__file__).resolve().parents[2]

RANK = """
import os, sys, time
import torch, torch.distributed as dist
from model.parallel import join
late = float(sys.argv[1]) if os.environ["RANK"] == "1" else 0.0
time.sleep(late)
tp = join(2, torch.device("cpu"), timeout_s=1.0)
x = torch.ones(1)
tp.all_reduce(x)
print(f"rank {tp.rank} joined, sum {x.item():g}", flush=True)
dist.destroy_process_group()
"""


def test_a_rank_that_joins_later_than_the_rank_timeout_still_joins() -> None:
    """Rank 1 reaches the join 3 s after rank 0 while each collective waits 1 s: both
    join (the join waits at least JOIN_TIMEOUT_FLOOR_S) and their all-reduce adds up."""
    env = os.environ | rendezvous(2) | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, "3"],
            env=env | {"RANK": str(rank), "LOCAL_RANK": str(rank)},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outs = [proc.communicate(timeout=120)[0] for proc in procs]
    for rank, (proc, out) in enumerate(zip(procs, outs, strict=True)):
        assert proc.returncode == 0, f"rank {rank} failed:\n{out[-3000:]}"
        assert f"rank {rank} joined, sum 2" in out
