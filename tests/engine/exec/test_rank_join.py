"""Joining the tensor-parallel group (model.parallel.join): ranks start side by side but
reach the join seconds apart on a loaded host, and --rank-timeout (how long a collective
waits for a rank) must not bound that wait."""

from tests.engine.exec.tp_ranks import run_ranks

RANK = """
import os, time
import torch, torch.distributed as dist
from model.parallel import join
time.sleep(float(os.environ.get("LATE_S", "0")))
tp = join(2, torch.device("cpu"), timeout_s=1.0)
x = torch.ones(1)
tp.all_reduce(x)
print(f"rank {tp.rank} joined, sum {x.item():g}", flush=True)
dist.destroy_process_group()
"""


def test_a_rank_that_joins_later_than_the_rank_timeout_still_joins() -> None:
    """Rank 1 reaches the join 3 s after rank 0 while each collective waits 1 s: both
    join (the join waits at least JOIN_TIMEOUT_FLOOR_S) and their all-reduce adds up."""
    results = run_ranks(2, ["-c", RANK], env=[{}, {"LATE_S": "3"}], timeout=120)
    for rank, r in enumerate(results):
        assert r.returncode == 0, f"rank {rank} failed:\n{r.stdout[-3000:]}"
        assert f"rank {rank} joined, sum 2" in r.stdout
