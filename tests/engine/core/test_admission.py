"""A new prompt is admitted only while it leaves the running requests room to grow."""

from service.engine.core.scheduler import Scheduler
from service.engine.kv.blocks import BlockManager
from service.engine.request import Request, SamplingParams


def step(scheduler: Scheduler) -> list[Request]:
    """One schedule, as the engine runs it: the scheduled tokens are computed, and each
    sequence that reached its end samples one token. Returns the preempted."""
    out = scheduler.schedule()
    for seq in out.seqs:
        seq.request.num_computed += seq.num_new
        if seq.sample:
            seq.request.output_ids.append(1)
    return out.preempted


def test_an_admitted_prompt_does_not_preempt_a_running_one_next_step() -> None:
    """10 blocks of 4 tokens. R (7 prompt tokens) runs and will need a third block two
    steps on; W (32 tokens) would take the other 8. Admitting W at once would preempt it
    (or R) on the next step; with the free-block watermark it waits, and nothing is ever
    preempted."""
    blocks = BlockManager(10, 4)
    scheduler = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    running = Request("R", list(range(7)), params, 0.0)
    scheduler.add(running)
    assert step(scheduler) == []  # R's prompt
    waiting = Request("W", list(range(100, 132)), params, 0.0)
    scheduler.add(waiting)
    preempted: list[Request] = []
    for _ in range(12):
        preempted += step(scheduler)
        if len(running.output_ids) >= 5:
            scheduler.remove(running)  # R finishes; its blocks free up
    assert preempted == []
    assert waiting.num_computed >= 32  # and W ran once there was room
