"""Continuous batching under one token budget per step.

Each step: running requests first (decodes, and prefills that are mid-chunk), then prefill
chunks of waiting requests, mixed into the same batch. A step that carries decodes
computes at most `mixed_prefill_tokens` prompt tokens besides them (when set), so running
streams wait one short step for a new prompt, not one step of the whole token budget.
When blocks run out a running request is preempted: its blocks are freed and it
re-queues, to be recomputed from its prompt plus what it has generated.

The policy orders both queues. fcfs: waiting requests by arrival (a preempted one at the
front), the newest running request preempted first. priority: by each request's priority
(lower first, vLLM's), then arrival; the running request of the lowest priority is
preempted first, and a waiting request that does not fit preempts running ones of a
lower priority than its own (an interactive request takes the room of a batch's).
A request under a LoRA adapter holds the adapter's slot while it runs (adapter_slots.py);
one whose adapter finds no slot waits, and the requests behind it go first.
"""

from __future__ import annotations

from collections import Counter, deque

from service.engine.batch import ScheduledSeq, SchedulerOutput
from service.engine.core.adapter_slots import AdapterSlots
from service.engine.kv.blocks import BlockManager
from service.engine.kv.prefix_keys import Hits
from service.engine.request import Request, Status

# Against the cap of a step that carries decodes, what a prompt token costs beside a
# plain one (the costs multiply; docs/decisions.md has the measurements): one whose
# logprobs are asked for (echo, prompt_logprobs), a row of the vocabulary-wide
# log-softmax, rank and top-k besides its forward; one under a LoRA adapter, its deltas
# at every linear
SCORED_TOKEN_COST = 4
ADAPTED_TOKEN_COST = 1.25


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        mixed_prefill_tokens: int | None = None,
        adapters: AdapterSlots | None = None,
        policy: str = "fcfs",
    ) -> None:
        if max_num_seqs <= 0 or max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be > 0")
        if mixed_prefill_tokens is not None and mixed_prefill_tokens <= 0:
            raise ValueError("mixed_prefill_tokens must be > 0 (or None: no cap)")
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.mixed_prefill_tokens = mixed_prefill_tokens
        self.adapters = adapters
        self.priority = policy == "priority"
        self.waiting: deque[Request] = deque()
        # fcfs: admission order, the last the newest; priority: by _rank, sorted each step
        self.running: list[Request] = []
        self.mixed = False  # whether this step carries decodes (its prompt tokens: _cost)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = prefill = self.max_num_batched_tokens
        cap = self.mixed_prefill_tokens
        self.mixed = cap is not None and any(
            r.remaining == 1 and not r.last_is_pending for r in self.running
        )
        if self.mixed:
            prefill = min(prefill, cap)  # decodes ride in this step: keep it short
        if self.priority:
            self.running.sort(key=_rank)  # the lowest priority last: preempted first
            self._make_room_for_urgent(out)
        made_room = len(out.preempted)  # preempted for a waiting request: admit it
        budget, prefill = self._schedule_running(out, budget, prefill)
        if len(out.preempted) == made_room:  # else running work found no room: admit none
            allowed = min(budget, prefill)
            budget -= allowed - self._schedule_waiting(out, allowed)
        assert budget >= 0 and out.num_tokens <= self.max_num_batched_tokens
        assert len(out.seqs) <= self.max_num_seqs and len(self.running) <= self.max_num_seqs
        return out

    def _schedule_running(
        self, out: SchedulerOutput, budget: int, prefill: float
    ) -> tuple[int, float]:
        """Decodes and mid-prompt chunks; `prefill` caps the chunks (more than one token).
        Returns what is left of both budgets."""
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.last_is_pending:  # async scheduling: nothing comes after it
                i += 1
                continue
            chunk = request.remaining > 1
            cost = self._cost(request) if chunk else 1
            n = min(request.remaining, budget, int(prefill // cost) if chunk else budget)
            if n == 0:  # no prefill allowance left this step: it continues next step
                i += 1
                continue
            drafts = self._drafts(request, budget) if not chunk else []
            if not self._make_room(request, n, out):
                break  # the request itself was preempted; everything after it too
            self.blocks.append(request, n + len(drafts))
            seq = _seq(request, request.num_computed, n, n == request.remaining, drafts)
            out.seqs.append(seq)
            n += len(drafts)
            budget -= n
            prefill -= n * cost if chunk else 0
            i += 1
        return budget, prefill

    def _drafts(self, request: Request, budget: int) -> list[int]:
        """The proposed tokens a decode verifies this step: as many as the token budget
        leaves room for, and none where they would need blocks that are not free (a
        speculation never preempts anyone)."""
        drafts = request.draft_ids[: budget - 1]
        if drafts and not self.blocks.can_append(request, 1 + len(drafts)):
            return []
        return drafts

    def _make_room(self, request: Request, n: int, out: SchedulerOutput) -> bool:
        """Preempt the newest running requests until `request` can grow by n tokens."""
        while not self.blocks.can_append(request, n):
            victim = self.running.pop()
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        return True

    def preempt(self, request: Request) -> None:
        self.blocks.free_request(request)
        if self.adapters is not None:
            self.adapters.release(request)
        request.num_computed = 0
        request.pool_sum = None  # a mean pooled so far: its rows are computed again
        request.num_preemptions += 1
        request.status = Status.WAITING
        self.waiting.appendleft(request)

    def by_priority(self) -> tuple[tuple[int, int, int], ...]:
        """(priority, waiting, running) requests of each priority that has any."""
        waiting = Counter(r.params.priority for r in self.waiting)
        running = Counter(r.params.priority for r in self.running)
        return tuple((p, waiting[p], running[p]) for p in sorted(waiting | running))

    def _queue(self) -> list[Request]:
        """The waiting requests that may start, in the policy's order."""
        ready = [r for r in self.waiting if r.ready]
        return sorted(ready, key=_rank) if self.priority else ready

    def _make_room_for_urgent(self, out: SchedulerOutput) -> None:
        """Preempt running requests of a lower priority than the most urgent waiting one,
        the lowest first, until that one can start (a sequence free, blocks for its first
        block of new tokens)."""
        queue = self._queue()
        if not queue:
            return
        urgent = queue[0]
        while self.running and self.running[-1].params.priority > urgent.params.priority:
            if self._can_start(urgent):
                return
            victim = self.running.pop()
            self.preempt(victim)
            out.preempted.append(victim)

    def _can_start(self, request: Request) -> bool:
        if len(self.running) >= self.max_num_seqs:
            return False
        hits = Hits() if request.computes_prompt else self.blocks.lookup(request)
        cached = len(hits) * self.blocks.block_size
        n = min(request.num_tokens - cached, self.blocks.block_size)
        return self.blocks.can_allocate(hits, cached + n, self._watermark())

    def _schedule_waiting(self, out: SchedulerOutput, budget: float) -> float:
        """Waiting requests in the policy's order while the budget lasts (n > 1 siblings
        once the first's prompt is in; one whose cached blocks are being read from disk
        waits, and those after it may go first)."""
        for request in self._queue():
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            # prompt logprobs and mean pooling need every prompt token: no cache hits
            hits = Hits() if request.computes_prompt else self.blocks.lookup(request)
            if hits.loading:
                out.loading += 1
                continue
            cached = len(hits) * self.blocks.block_size
            cost = self._cost(request)
            n = min(request.num_tokens - cached, int(budget // cost))
            if n == 0 or not self.blocks.can_allocate(hits, cached + n, self._watermark()):
                break
            if self.adapters is not None and not self.adapters.acquire(request):
                continue
            self.blocks.allocate(request, hits, cached + n)
            self.waiting.remove(request)
            request.num_computed = cached
            request.status = Status.RUNNING
            if request.num_preemptions == 0:
                request.num_cached_prompt = cached
            out.prefix_queried += request.num_tokens
            out.prefix_hits += cached
            self.running.append(request)
            out.seqs.append(_seq(request, cached, n, n == request.num_tokens - cached))
            budget -= n * cost
        return budget

    def _cost(self, request: Request) -> float:
        """What a prompt token of `request` counts for against this step's allowance."""
        if not self.mixed:
            return 1
        scored = SCORED_TOKEN_COST if request.params.prompt_logprobs is not None else 1
        return scored * (ADAPTED_TOKEN_COST if request.params.lora is not None else 1)

    def _watermark(self) -> int:
        """Blocks a new prompt must leave free while others run (1% of the pool, at least
        one), so that admitting it does not preempt a running request on the next step,
        when a decode crosses into a new block (vLLM keeps the same watermark)."""
        return max(1, self.blocks.num_blocks // 100) if self.running else 0

    def remove(self, request: Request) -> None:
        """Take a finished or aborted request out of the queues and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.blocks.free_request(request)
        self.blocks.forget(request)
        if self.adapters is not None:
            self.adapters.leave(request)


def _seq(
    request: Request, start: int, n: int, last: bool, drafts: list[int] | None = None
) -> ScheduledSeq:
    """A scheduled chunk; one that reaches the last token samples the next, or for an
    embedding request pools its prompt instead."""
    pools = last and request.params.pooling is not None
    return ScheduledSeq(request, start, n, last and not pools, drafts or [], pools)


def _rank(request: Request) -> tuple[int, float]:
    """The priority policy's order: priority (lower first), then arrival."""
    return request.params.priority, request.arrival_time
