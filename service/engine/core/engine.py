"""LLMEngine.step(): schedule -> run -> update. Deterministic and testable; with async
scheduling (on CUDA) a step is queued before the previous step's tokens are read."""

from __future__ import annotations

import dataclasses
import logging
import time

from model.backends import Backend
from model.tokenizer import Tokenizer
from model.transformer import Transformer
from service.config import EngineConfig
from service.engine.batch import SchedulerOutput
from service.engine.core.checks import Checked, Limits, check_request
from service.engine.core.parts import EngineParts, assemble
from service.engine.core.postprocess import PostProcessor
from service.engine.core.stats import EngineObserver, EngineSnapshot, EngineStats, ExpertLoad
from service.engine.exec.ranks import RankError
from service.engine.exec.runner import Launched
from service.engine.output import RequestOutput
from service.engine.request import FinishReason, ParamError, Request, SamplingParams, sequence_ids

log = logging.getLogger("kvserve.engine")
LOAD_WAIT_S = 0.005  # how long a step with nothing to run waits for a disk read to end


class LLMEngine:
    def __init__(
        self, parts: EngineParts, config: EngineConfig, observer: EngineObserver | None = None
    ) -> None:
        """The engine over its parts, assembled once from the model and the config
        (service/engine/core/parts.py: `build`), or a test's own."""
        self.model, self.tokenizer, self.config = parts.model, parts.tokenizer, config
        self.observer = observer
        self.max_num_seqs, self.max_model_len = parts.max_num_seqs, parts.max_model_len
        self.backend, self.ranks, self.kv_cache = parts.backend, parts.ranks, parts.kv_cache
        self.blocks, self.scheduler, self.runner = parts.blocks, parts.scheduler, parts.runner
        self.eos_ids, self.grammars = parts.eos_ids, parts.grammars
        self.speculator = parts.speculator
        self.adapters = parts.adapters
        # async scheduling (parts.py decides): the step in flight, whose tokens are read
        # after the next step is queued (unless a request in PostProcessor.read_each_step
        # needs each step's tokens before the next is scheduled)
        self.async_scheduling = parts.async_scheduling
        self.in_flight: Launched | None = None
        self.stats = EngineStats()
        self.clock = time.monotonic
        self.expert_load = ExpertLoad(parts.expert_load, self.clock)
        self.post = PostProcessor(
            self.scheduler,
            self.blocks,
            self.runner,
            self.stats,
            self.eos_ids,
            self.max_model_len,
            not config.scheduler.disable_jump_forward,
            self._observe,
            self.clock,
        )
        self.requests = self.post.requests

    @classmethod
    def build(
        cls,
        model: Transformer,
        tokenizer: Tokenizer,
        config: EngineConfig,
        draft: Transformer | None = None,
        observer: EngineObserver | None = None,
        backend: Backend | None = None,
    ) -> LLMEngine:
        """The engine for `model`, its parts assembled from `config`; draft: the
        speculative draft model (--speculative-method draft); backend: the one the load
        prepared the layers for (parts.engine_backend)."""
        return cls(assemble(model, tokenizer, config, draft, backend), config, observer)

    # ---- admission -------------------------------------------------------------------

    @property
    def block_bytes(self) -> int:
        return self.kv_cache.block_nbytes

    @property
    def limits(self) -> Limits:
        """What a request is checked against (a front process checks with them too)."""
        vocab = self.model.cfg.vocab_size
        return Limits(vocab, self.max_model_len, self.blocks.num_blocks, self.blocks.block_size)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> Checked:
        """The request checked, else ParamError / ContextLengthError
        (service/engine/core/checks.py)."""
        return check_request(prompt_ids, params, self.limits, self.grammars)

    def add_request(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> list[str]:
        """Check a request and queue it (add)."""
        return self.add(request_id, self.validate(prompt_ids, params))

    def add(self, request_id: str, checked: Checked) -> list[str]:
        """Queue a checked request; n > 1 adds n sequences `{id}.{i}` whose siblings wait
        for the first one's prompt and then reuse its blocks through the prefix cache."""
        prompt_ids, params = checked.prompt_ids, checked.params
        if params.lora is not None and self.adapters is None:
            raise ParamError("model", f"no LoRA adapter {params.lora!r} is served")
        ids = sequence_ids(request_id, params.n)
        parent = request_id if params.n > 1 else None
        if any(i in self.requests for i in ids):
            raise ParamError("request_id", f"request {request_id!r} already exists")
        first: Request | None = None
        now = self.clock()
        self.stats.prompt_tokens += len(prompt_ids)
        for i, rid in enumerate(ids):
            p = params
            if params.seed is not None and i:
                p = dataclasses.replace(params, seed=params.seed + i)
            request = Request(rid, list(prompt_ids), p, now, i, parent, wait_for=first)
            if self.adapters is not None:
                self.adapters.enter(request)
            if p.constraint is not None:
                request.guide = self.grammars.guide(p.constraint)
            first = first or request
            self.requests[rid] = request
            if p.reads_each_step:
                self.post.read_each_step.add(rid)
            self.scheduler.add(request)
        return ids

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.post.finish(request, FinishReason.ABORT)
        return self.post.emit(request, [], [])

    def stop(self, request_id: str, kept: int) -> RequestOutput | None:
        """A stop string, found by the front (service/engine/text/), ended the sequence
        with its `kept`-th output token: it finishes as stopped, its output counted to
        there (the tokens the engine ran past the stop are not counted)."""
        request = self.requests.get(request_id)
        if request is None:  # it finished first (its length, an end-of-text token)
            return None
        del request.output_ids[kept:]
        self.post.finish(request, FinishReason.STOP)
        return self.post.emit(request, [], [])

    def drop(self, request_id: str) -> None:
        """Remove a request whose add failed part way, handing nothing out."""
        request = self.requests.get(request_id)
        self.post.forget(request_id)
        if request is not None:
            self.scheduler.remove(request)

    def snapshot(self) -> EngineSnapshot:
        sched, blocks, windows = self.scheduler, self.blocks, self.blocks.windows
        used, total, each = blocks.num_used, blocks.num_blocks, self.block_bytes
        window_bytes = (0, 0)
        if windows is not None:
            w_used, w_each = (
                windows.num_blocks - windows.num_free,
                self.kv_cache.window_block_nbytes,
            )
            if self.kv_cache.window_only:  # the window pool is the KV pool
                used, total, each = w_used, windows.num_blocks, w_each
            else:
                window_bytes = (w_used * w_each, windows.num_blocks * w_each)
        snap = self.stats.snapshot(
            len(sched.running), len(sched.waiting), used, total, each, window_bytes
        )
        events = blocks.events
        snap = dataclasses.replace(
            snap,
            kv_events_replay_up=events.replay_up,
            kv_events_malformed=events.malformed,
            expert_tokens=self.expert_load.sample(),
        )
        if self.adapters is not None:
            snap = dataclasses.replace(snap, **self.adapters.gauges(sched.running, sched.waiting))
        if sched.priority:
            snap = dataclasses.replace(snap, priorities=sched.by_priority())
        tier = blocks.tier
        if tier is None:
            return snap
        s, disk = tier.stats, tier.disk
        if disk is not None:
            d = disk.stats
            snap = dataclasses.replace(
                snap, kv_disk_blocks=disk.num_blocks, kv_disk_bytes=disk.num_bytes,
                kv_disk_written_blocks=d.written, kv_disk_read_blocks=d.read,
                kv_disk_corrupt_blocks=d.corrupt,
            )  # fmt: skip
        return dataclasses.replace(
            snap, kv_host_blocks_total=tier.num_slots, kv_host_blocks_used=tier.num_used,
            kv_host_block_bytes=each, kv_host_stored_blocks=s.stored,
            kv_host_restored_blocks=s.restored, kv_host_dropped_blocks=s.dropped,
            kv_host_copy_seconds=self.stats.host_copy_seconds,
        )  # fmt: skip

    def has_unfinished(self) -> bool:
        """Requests to step, or a step in flight whose tokens someone still waits for."""
        if self.scheduler.has_work:
            return True
        flight = self.in_flight
        return flight is not None and not all(s.request.finished for s in flight.batch.seqs)

    # ---- tensor-parallel ranks (model/parallel.py, service/engine/exec/ranks.py) ------------

    def idle(self) -> None:
        """Called while there is no work: rank 0 keeps the other ranks answering."""
        if self.ranks is not None:
            self.ranks.keepalive()

    def close(self) -> None:
        """Rank 0 shutting down: the other ranks leave follow(); the cached blocks of the
        pool and the host tier go to the disk tier, where there is one, for the next run
        to find."""
        if self.ranks is not None:
            self.ranks.stop()
        self.blocks.events.close()
        if self.blocks.tier is not None:
            if copies := self.blocks.last_copies():  # with a disk tier (on one rank)
                self.runner.apply(copies)
            self.blocks.tier.close()

    def follow(self) -> None:
        """A rank other than 0: run rank 0's forwards until it stops (or fails)."""
        self.runner.follow()

    # ---- the step ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step: schedule -> run -> postprocess. With async scheduling the step is
        queued on the device before the previous step's tokens are read: the host
        schedules and prepares step N + 1, and hands out step N's tokens, while the device
        computes. A request's token still on the device is pending (Request.num_pending):
        the next step feeds it from the device, and a request that it finishes has
        computed one token in vain."""
        t0 = self.clock()
        prev, self.in_flight = self.in_flight, None
        chain = self.async_scheduling and not self.post.read_each_step
        outputs: list[RequestOutput] = []
        if prev is not None and not chain:  # a request now needs the tokens first
            outputs, prev = self._collect(prev), None
        batch = self._schedule(t0)
        tier = self.blocks.tier
        if tier is not None and batch.loading and not batch.seqs and prev is None:
            tier.wait_for_reads(LOAD_WAIT_S)  # nothing to run but reads from disk to wait for
        launched = self._launch(batch, prev, chain, outputs) if batch.seqs else None
        if prev is not None:
            outputs += self._collect(prev)
        self.blocks.events.publish()  # what this step stored in the prefix cache, or evicted
        if launched is None:
            return outputs
        if chain:
            self.in_flight = launched
        else:
            own = self._collect(launched)
            outputs += own
            self._observe_speculation(batch, own, t0)
            self.blocks.events.publish()
        self._observe("on_step", self.clock() - t0, batch.num_tokens, len(batch.seqs))
        return outputs

    def _schedule(self, now: float) -> SchedulerOutput:
        """The speculator's drafts, then the scheduler's batch, counted."""
        self.speculator.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        if self.adapters is not None:  # the LoRA slots this batch fills
            for fill in self.adapters.take_due():
                self.runner.apply(fill)
        tier = self.blocks.tier
        if tier is not None and (copies := tier.drain()):  # before the step's forward
            t0 = self.clock()
            self.runner.apply(copies)
            self.stats.host_copy_seconds += self.clock() - t0
        self.stats.preemptions += len(batch.preempted)
        self.stats.prefix_queried_tokens += batch.prefix_queried
        self.stats.prefix_hit_tokens += batch.prefix_hits
        for seq in batch.seqs:
            if seq.request.first_scheduled_time is None:
                seq.request.first_scheduled_time = now
        return batch

    def _launch(
        self, batch: SchedulerOutput, prev: Launched | None, chain: bool, outputs: list
    ) -> Launched | None:
        """Queue the batch's forward (after `prev`'s, whose pending tokens it reads on the
        device); a failed forward fails this batch's requests only, into `outputs`."""
        try:
            launched = self.runner.launch(batch, prev, read_later=chain)
        except RankError:  # the ranks are out of step: nothing can run any more
            raise
        except Exception as exc:
            outputs += self.post.fail_batch(batch, exc)
            return None
        for seq in batch.seqs:  # counted now: the next step is scheduled after them
            seq.request.num_computed += seq.num_new
            if chain and seq.sample:
                seq.request.num_pending += 1
        return launched

    def _observe_speculation(
        self, batch: SchedulerOutput, outputs: list[RequestOutput], t0: float
    ) -> None:
        """A step of decodes only tells the speculator what it gave and took."""
        if all(s.sample and s.num_new == 1 for s in batch.seqs):
            drafted = any(s.drafts for s in batch.seqs)
            tokens = sum(len(o.token_ids) for o in outputs)
            self.speculator.observe(drafted, tokens, len(batch.seqs), self.clock() - t0)

    def _collect(self, launched: Launched) -> list[RequestOutput]:
        """Read a launched step's tokens and hand them out."""
        try:
            result = self.runner.read(launched)
        except Exception as exc:  # the device failed the step: its requests fail
            return self.post.fail_batch(launched.batch, exc)
        return self.post.update(launched, result.token_ids, result.logprobs)

    def _observe(self, event: str, *args: object) -> None:
        """Tell the observer; a failing observer is logged, never fatal to the step."""
        if self.observer is None:
            return
        try:
            getattr(self.observer, event)(*args)
        except Exception:
            log.exception("metrics observer failed in %s", event)
