"""After a step: each request's sampled tokens accepted (speculative drafts, jump-forward
over what a grammar forces), stop conditions checked (the token ones: stop strings are
the front's, service/engine/text/), finished requests released, and
every request's output handed out. The requests in flight are registered here."""

from __future__ import annotations

import logging
from collections.abc import Callable

from model.backends.base import NON_FINITE
from service.engine.batch import SchedulerOutput
from service.engine.core.scheduler import Scheduler
from service.engine.core.stats import EngineStats
from service.engine.exec.ranks import Clear
from service.engine.exec.runner import Launched, ModelRunner
from service.engine.exec.speculative import accepted_drafts
from service.engine.kv.blocks import BlockManager
from service.engine.output import RequestOutput, make_output
from service.engine.request import FinishReason, Request, Status

log = logging.getLogger("kvserve.engine")


class PostProcessor:
    def __init__(
        self,
        scheduler: Scheduler,
        blocks: BlockManager,
        runner: ModelRunner,
        stats: EngineStats,
        eos_ids: frozenset[int],
        max_model_len: int,
        jump_forward: bool,
        observe: Callable[..., None],
        clock: Callable[[], float],
    ) -> None:
        """observe(event, *args): tells the engine's observer (never raises)."""
        self.scheduler, self.blocks, self.runner, self.stats = scheduler, blocks, runner, stats
        self.eos_ids, self.max_model_len, self.jump_forward = eos_ids, max_model_len, jump_forward
        self.observe, self.clock = observe, clock
        self.requests: dict[str, Request] = {}
        # requests that need each step's tokens read before the next is scheduled
        self.read_each_step: set[str] = set()

    def update(self, launched: Launched, tokens: list[int], logprobs: list) -> list[RequestOutput]:
        now = self.clock()
        outputs: list[RequestOutput] = []
        intervals: list[float] = []
        k = 0
        for seq in launched.batch.seqs:
            request = seq.request
            rows = 1 + len(seq.drafts) if seq.sample else 0
            chosen, lps = tokens[k : k + rows], logprobs[k : k + rows]
            k += rows
            if seq.sample and launched.ids is not None:
                request.num_pending -= 1  # read now
            if request.finished:  # aborted, or finished by the step before (async)
                continue
            try:
                if not seq.sample:
                    self.blocks.cache_full_blocks(request)
                    if seq.pools:  # an embedding request's prompt is done: its answer
                        request.first_token_time = now
                        self.finish(request, FinishReason.STOP)
                        outputs.append(self.emit(request, [], []))
                    continue
                accepted = accepted_drafts(seq.drafts, chosen)
                self.stats.spec_draft_tokens += len(seq.drafts)
                self.stats.spec_accepted_tokens += accepted
                out = self._accept(request, chosen[: accepted + 1], lps, accepted, now, intervals)
                outputs.append(out)
            except Exception as exc:  # a bug hit by this request fails it alone
                log.exception("request %s failed in the engine", request.request_id)
                if request.request_id in self.requests:  # not handed out yet
                    outputs.append(self.fail(request, f"internal error: {type(exc).__name__}"))
        if intervals:
            self.observe("on_token_intervals", intervals)
        return outputs

    def _accept(
        self,
        request: Request,
        tokens: list[int],
        logprobs: list,
        drafts: int,
        now: float,
        intervals: list[float],
    ) -> RequestOutput:
        """The request's next tokens, appended in turn until one stops it, and handed out.
        More than one when speculative drafts were accepted: the first `drafts` of them,
        whose K/V this step computed (the last is the step's own choice, not computed yet).
        Also more than one when the request's grammar forces what follows (jump-forward,
        `_jumps`): those tokens' K/V are computed in its next step, with the token after
        them. They arrive together: the first after the time since the last step's, the
        rest at no interval."""
        taken: list[int] = []
        reason: FinishReason | None = None
        pending = list(tokens)
        while len(taken) < len(pending):
            token = pending[len(taken)]
            if token == NON_FINITE:  # this request alone fails; its K/V are not kept
                self.runner.apply(Clear(*self.blocks.uncache_owned(request)))
                message = "generation failed: the model produced non-finite logits (NaN or inf)"
                return self.fail(request, message)
            request.output_ids.append(token)
            taken.append(token)
            self.stats.generation_tokens += 1
            if request.guide is not None and not request.guide.accept(token):
                why = request.guide.error or f"token {token} is outside its grammar"
                return self.fail(request, f"structured output failed: {why}")
            reason = self._stop_reason(request, token)
            if reason is not None:
                break
            if len(taken) == len(pending) and self._jumps(request):
                pending.extend(request.guide.forced())  # type: ignore[union-attr]
            if len(taken) == len(pending) and self._thought_enough(request, token):
                pending.append(request.params.think_ids[1])
        request.num_computed += min(drafts, len(taken))
        self.blocks.cache_full_blocks(request)
        if request.first_token_time is None:
            request.first_token_time = now
        else:
            intervals.append(now - request.last_token_time)  # type: ignore[operator]
        intervals.extend([0.0] * (len(taken) - 1))
        request.last_token_time = now
        if reason is not None:
            self.finish(request, reason)
        lps = [lp for lp in logprobs[: len(taken)] if lp is not None]
        return self.emit(request, taken, lps)

    def _jumps(self, request: Request) -> bool:
        """Whether the tokens a request's grammar forces are appended at once (jump-forward):
        they take no step of their own, and their K/V are computed with the request's
        next token. Not for requests that ask for logprobs (forced tokens have none)."""
        return self.jump_forward and request.guide is not None and request.params.logprobs is None

    @staticmethod
    def _thought_enough(request: Request, token: int) -> bool:
        """Whether the request's think block has spent its budget with this token: its
        end marker is then appended as the next token (its K/V computed in the next step,
        as a jump-forward's)."""
        p = request.params
        if p.thinking_budget is None or request.thought:
            return False
        start, end = p.think_ids
        if token == end:
            request.thought = True
        elif request.thinking_since is None:
            if p.thinking_open or (token == start and len(request.output_ids) == 1):
                request.thinking_since = 0 if p.thinking_open else 1
            else:
                request.thought = True  # no block: nothing to budget
        if request.thought or request.thinking_since is None:
            return False
        if len(request.output_ids) - request.thinking_since >= p.thinking_budget:
            request.thought = True
            return True
        return False

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        p = request.params
        if token in p.stop_token_ids or (token in self.eos_ids and not p.ignore_eos):
            return FinishReason.STOP
        if request.guide is not None and request.guide.done:  # the grammar is complete
            return FinishReason.STOP
        if len(request.output_ids) >= p.max_tokens or request.num_known >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def finish(self, request: Request, reason: FinishReason, error: str | None = None) -> None:
        request.status = Status.FINISHED
        request.finish_reason = reason
        request.error = error
        request.finish_time = self.clock()
        self.scheduler.remove(request)
        self.runner.release(request.request_id)
        self.stats.finished[reason.value] += 1

    def emit(self, request: Request, tokens: list[int], logprobs: list) -> RequestOutput:
        output = make_output(request, tokens, logprobs)
        if request.finished:
            self.forget(request.request_id)
            self.observe("on_finished", output)
        return output

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self.read_each_step.discard(request_id)

    def fail_batch(self, batch: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        message = f"generation failed: {type(exc).__name__}: {exc}"
        # not those finished since it was scheduled (async scheduling: by the step before)
        return [self.fail(s.request, message) for s in batch.seqs if not s.request.finished]

    def fail(self, request: Request, message: str) -> RequestOutput:
        """Finish the request as failed and hand out its last output."""
        if request.finished:  # it failed while being handed out
            request.finish_reason, request.error = FinishReason.ERROR, message
        else:
            self.finish(request, FinishReason.ERROR, message)
        output = make_output(request, [], [])
        self.forget(request.request_id)
        self.observe("on_finished", output)
        return output
