"""--scheduling-policy priority: waiting requests go by priority (lower first), then
arrival; under memory pressure the running request of the lowest priority is preempted
first; a waiting request that does not fit preempts running ones of a lower priority.
fcfs keeps arrival order and preempts the newest."""

from service.engine.core.scheduler import Scheduler
from service.engine.kv.blocks import BlockManager
from service.engine.request import Request, SamplingParams


def request(rid: str, priority: int, arrival: float, prompt: int = 4, out: int = 8) -> Request:
    params = SamplingParams(max_tokens=out, ignore_eos=True, priority=priority)
    return Request(rid, list(range(10, 10 + prompt)), params, arrival)


def step(scheduler: Scheduler) -> tuple[list[str], list[str]]:
    """One schedule, as the engine runs it (the scheduled tokens computed, a token sampled
    where a sequence reached its end; finished requests removed). Returns the ids
    scheduled and the ids preempted."""
    out = scheduler.schedule()
    for seq in out.seqs:
        seq.request.num_computed += seq.num_new
        if seq.sample:
            seq.request.output_ids.append(1)
            if len(seq.request.output_ids) >= seq.request.params.max_tokens:
                scheduler.remove(seq.request)
    return [s.request.request_id for s in out.seqs], [r.request_id for r in out.preempted]


def started(policy: str) -> list[str]:
    """The order in which requests start when one runs at a time."""
    scheduler = Scheduler(BlockManager(64, 4), 1, 64, policy=policy)
    for r in (request("late-low", 5, 0.0), request("urgent", 0, 1.0), request("next", 0, 2.0)):
        scheduler.add(r)
    order: list[str] = []
    for _ in range(40):
        for rid in step(scheduler)[0]:
            if rid not in order:
                order.append(rid)
    return order


def test_waiting_requests_start_by_priority_then_arrival() -> None:
    assert started("priority") == ["urgent", "next", "late-low"]
    assert started("fcfs") == ["late-low", "urgent", "next"]


def preempted(policy: str) -> list[str]:
    """Two requests that outgrow 6 blocks of 4 tokens: the older of a low priority, the
    newer urgent. Which is preempted first."""
    scheduler = Scheduler(BlockManager(6, 4), 4, 64, policy=policy)
    scheduler.add(request("old-low", 5, 0.0, prompt=4, out=16))
    scheduler.add(request("new-urgent", 0, 1.0, prompt=4, out=16))
    victims: list[str] = []
    for _ in range(40):
        victims += step(scheduler)[1]
    return victims


def test_memory_pressure_preempts_the_lowest_priority_first() -> None:
    assert preempted("priority")[0] == "old-low"
    assert preempted("fcfs")[0] == "new-urgent"


def test_an_urgent_request_takes_the_room_of_a_lower_priority_one() -> None:
    """One sequence at a time: a batch request (priority 10) runs; an interactive one
    (0) arrives and preempts it at once, runs to its end, and the batch request resumes
    and finishes; one of the same priority waits its turn instead."""
    scheduler = Scheduler(BlockManager(64, 4), 1, 64, policy="priority")
    batch = request("batch", 10, 0.0, out=20)
    scheduler.add(batch)
    step(scheduler)
    step(scheduler)
    scheduler.add(request("chat", 0, 1.0, out=3))
    scheduled, victims = step(scheduler)
    assert victims == ["batch"] and scheduled == ["chat"]
    trace = [step(scheduler)[0] for _ in range(30)]
    assert trace[:2] == [["chat"], ["chat"]] and ["batch"] in trace[2:]
    assert len(batch.output_ids) == 20  # resumed, and ran to its end
    scheduler.add(request("peer", 10, 2.0, out=3))
    scheduler.add(request("busy", 10, 1.5, out=30))
    step(scheduler)
    scheduled, victims = step(scheduler)
    assert victims == [] and scheduled == ["busy"]
