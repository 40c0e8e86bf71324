"""LLMEngine.step(): schedule -> run -> update. Deterministic and testable; with async
scheduling (on CUDA) a step is queued before the previous step's tokens are read."""

from __future__ import annotations

import dataclasses
import logging
import time

from model.backends.base import NON_FINITE
from model.tokenizer import Tokenizer
from model.transformer import Transformer
from service.config import Settings
from service.engine.batch import SchedulerOutput
from service.engine.output import RequestOutput, TextState, make_output
from service.engine.parts import assemble
from service.engine.ranks import RankError
from service.engine.request import FinishReason, ParamError, Request, SamplingParams, Status
from service.engine.runner import Launched
from service.engine.speculative import accepted_drafts
from service.engine.stats import EngineObserver, EngineSnapshot, EngineStats

log = logging.getLogger("kvserve.engine")


class ContextLengthError(ParamError):
    """Prompt + max_tokens exceed the context (the API answers context_length_exceeded)."""


class LLMEngine:
    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        settings: Settings,
        observer: EngineObserver | None = None,
        draft: Transformer | None = None,
    ) -> None:
        """settings: what the engine reads of them (the sizes, budgets, backend,
        quantization and speculation); its parts are assembled from them once
        (service/engine/parts.py). draft: the speculative draft model
        (--speculative-method draft)."""
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.observer = observer
        parts = assemble(model, tokenizer, settings, draft)
        self.max_num_seqs, self.max_model_len = parts.max_num_seqs, parts.max_model_len
        self.backend, self.ranks, self.kv_cache = parts.backend, parts.ranks, parts.kv_cache
        self.blocks, self.scheduler, self.runner = parts.blocks, parts.scheduler, parts.runner
        self.eos_ids, self.grammars = parts.eos_ids, parts.grammars
        self.speculator = parts.speculator
        # async scheduling (parts.py decides): the step in flight, whose tokens are read
        # after the next step is queued; and the requests that need each step's tokens
        # read before the next is scheduled (while one is running, every step is read)
        self.async_scheduling = parts.async_scheduling
        self.in_flight: Launched | None = None
        self._read_each_step: set[str] = set()
        self.jump_forward = not settings.disable_jump_forward
        self.requests: dict[str, Request] = {}
        self.texts: dict[str, TextState] = {}
        self.stats = EngineStats()
        self.clock = time.monotonic

    # ---- admission -------------------------------------------------------------------

    @property
    def block_bytes(self) -> int:
        return self.kv_cache.block_nbytes

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ParamError("prompt", "must not be empty")
        vocab = self.model.cfg.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ParamError("prompt", f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ContextLengthError(
                "max_tokens" if len(prompt_ids) < self.max_model_len else "prompt",
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"request has {len(prompt_ids)} prompt tokens and max_tokens "
                f"{params.max_tokens} ({total} in total)",
            )
        if params.constraint is not None:
            self.grammars.check(params.constraint)  # ConstraintError: a 400 naming the param
        if self.blocks.blocks_for(total) > self.blocks.num_blocks:
            capacity = self.blocks.num_blocks * self.blocks.block_size
            raise ContextLengthError(
                "max_tokens",
                f"prompt + max_tokens ({total}) exceed the KV cache capacity of {capacity} tokens",
            )

    def add_request(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> list[str]:
        """Queue a request; n > 1 adds n sequences `{id}.{i}` whose siblings wait for the
        first one's prompt and then reuse its blocks through the prefix cache."""
        self.validate(prompt_ids, params)
        ids = [request_id] if params.n == 1 else [f"{request_id}.{i}" for i in range(params.n)]
        if any(i in self.requests for i in ids):
            raise ParamError("request_id", f"request {request_id!r} already exists")
        first: Request | None = None
        now = self.clock()
        self.stats.prompt_tokens += len(prompt_ids)
        for i, rid in enumerate(ids):
            p = params
            if params.seed is not None and i:
                p = dataclasses.replace(params, seed=params.seed + i)
            request = Request(rid, list(prompt_ids), p, now, index=i, wait_for=first)
            if p.constraint is not None:
                request.guide = self.grammars.guide(p.constraint)
            first = first or request
            self.requests[rid] = request
            if p.reads_each_step:
                self._read_each_step.add(rid)
            self.texts[rid] = TextState(self.tokenizer, p.stop, p.skip_special_tokens)
            self.scheduler.add(request)
        return ids

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._finish(request, FinishReason.ABORT)
        return self._emit(request, [], [])

    def drop(self, request_id: str) -> None:
        """Remove a request whose add failed part way, handing nothing out."""
        request = self.requests.get(request_id)
        self._forget(request_id)
        if request is not None:
            self.scheduler.remove(request)

    def snapshot(self) -> EngineSnapshot:
        sched, blocks = self.scheduler, self.blocks
        return self.stats.snapshot(
            len(sched.running),
            len(sched.waiting),
            blocks.num_used,
            blocks.num_blocks,
            self.block_bytes,
        )

    def has_unfinished(self) -> bool:
        """Requests to step, or a step in flight whose tokens someone still waits for."""
        if self.scheduler.has_work:
            return True
        flight = self.in_flight
        return flight is not None and not all(s.request.finished for s in flight.batch.seqs)

    # ---- tensor-parallel ranks (model/parallel.py, service/engine/ranks.py) ------------

    def idle(self) -> None:
        """Called while there is no work: rank 0 keeps the other ranks answering."""
        if self.ranks is not None:
            self.ranks.keepalive()

    def close(self) -> None:
        """Rank 0 shutting down: the other ranks leave follow()."""
        if self.ranks is not None:
            self.ranks.stop()

    def follow(self) -> None:
        """A rank other than 0: run rank 0's forwards until it stops (or fails)."""
        self.runner.follow()

    # ---- the step ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step. With async scheduling the step is queued on the device before the
        previous step's tokens are read: the host schedules and prepares step N + 1, and
        hands out step N's tokens, while the device computes. A request's token still on
        the device is pending (Request.num_pending): the next step feeds it from the
        device, and a request that it finishes has computed one token in vain."""
        t0 = self.clock()
        prev, self.in_flight = self.in_flight, None
        chain = self.async_scheduling and not self._read_each_step
        outputs: list[RequestOutput] = []
        if prev is not None and not chain:  # a request now needs the tokens first
            outputs, prev = self._collect(prev), None
        self.speculator.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        self.stats.preemptions += len(batch.preempted)
        self.stats.prefix_queried_tokens += batch.prefix_queried
        self.stats.prefix_hit_tokens += batch.prefix_hits
        launched = None
        if batch.seqs:
            for seq in batch.seqs:
                if seq.request.first_scheduled_time is None:
                    seq.request.first_scheduled_time = t0
            try:
                launched = self.runner.launch(batch, prev, read_later=chain)
            except RankError:  # the ranks are out of step: nothing can run any more
                raise
            except Exception as exc:  # a failed forward fails this batch's requests only
                outputs += self._fail_batch(batch, exc)
        if launched is not None:
            for seq in batch.seqs:  # counted now: the next step is scheduled after them
                seq.request.num_computed += seq.num_new
                if chain and seq.sample:
                    seq.request.num_pending += 1
        if prev is not None:
            outputs += self._collect(prev)
        if launched is not None and chain:
            self.in_flight = launched
        elif launched is not None:
            own = self._collect(launched)
            outputs += own
            if all(s.sample and s.num_new == 1 for s in batch.seqs):  # decodes only
                drafted = any(s.drafts for s in batch.seqs)
                tokens = sum(len(o.token_ids) for o in own)
                self.speculator.observe(drafted, tokens, len(batch.seqs), self.clock() - t0)
        if launched is not None:
            self._observe("on_step", self.clock() - t0, batch.num_tokens, len(batch.seqs))
        return outputs

    def _collect(self, launched: Launched) -> list[RequestOutput]:
        """Read a launched step's tokens and hand them out."""
        try:
            result = self.runner.read(launched)
        except Exception as exc:  # the device failed the step: its requests fail
            return self._fail_batch(launched.batch, exc)
        return self._update(launched, result.token_ids, result.logprobs)

    def _observe(self, event: str, *args: object) -> None:
        """Tell the observer; a failing observer is logged, never fatal to the step."""
        if self.observer is None:
            return
        try:
            getattr(self.observer, event)(*args)
        except Exception:
            log.exception("metrics observer failed in %s", event)

    def _update(self, launched: Launched, tokens: list[int], logprobs: list) -> list[RequestOutput]:
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
                    continue
                accepted = accepted_drafts(seq.drafts, chosen)
                self.stats.spec_draft_tokens += len(seq.drafts)
                self.stats.spec_accepted_tokens += accepted
                out = self._accept(request, chosen[: accepted + 1], lps, accepted, now, intervals)
                outputs.append(out)
            except Exception as exc:  # a bug hit by this request fails it alone
                log.exception("request %s failed in the engine", request.request_id)
                if request.request_id in self.requests:  # not handed out yet
                    outputs.append(self._fail(request, f"internal error: {type(exc).__name__}"))
        if intervals:
            self._observe("on_token_intervals", intervals)
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
                self.runner.clear_blocks(self.blocks.uncache_owned(request))
                message = "generation failed: the model produced non-finite logits (NaN or inf)"
                return self._fail(request, message)
            request.output_ids.append(token)
            taken.append(token)
            self.stats.generation_tokens += 1
            if request.guide is not None and not request.guide.accept(token):
                why = request.guide.error or f"token {token} is outside its grammar"
                return self._fail(request, f"structured output failed: {why}")
            reason = self._stop_reason(request, token)
            if reason is not None:
                break
            if len(taken) == len(pending) and self._jumps(request):
                pending.extend(request.guide.forced())  # type: ignore[union-attr]
        request.num_computed += min(drafts, len(taken))
        self.blocks.cache_full_blocks(request)
        if request.first_token_time is None:
            request.first_token_time = now
        else:
            intervals.append(now - request.last_token_time)  # type: ignore[operator]
        intervals.extend([0.0] * (len(taken) - 1))
        request.last_token_time = now
        if reason is not None:
            self._finish(request, reason)
        lps = [lp for lp in logprobs[: len(taken)] if lp is not None]
        return self._emit(request, taken, lps)

    def _jumps(self, request: Request) -> bool:
        """Whether the tokens a request's grammar forces are appended at once (jump-forward):
        they take no step of their own, and their K/V are computed with the request's
        next token. Not for requests that ask for logprobs (forced tokens have none)."""
        return self.jump_forward and request.guide is not None and request.params.logprobs is None

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        p = request.params
        if token in p.stop_token_ids or (token in self.eos_ids and not p.ignore_eos):
            return FinishReason.STOP
        if self.texts[request.request_id].push(token):
            return FinishReason.STOP
        if request.guide is not None and request.guide.done:  # the grammar is complete
            return FinishReason.STOP
        if len(request.output_ids) >= p.max_tokens or request.num_known >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, request: Request, reason: FinishReason, error: str | None = None) -> None:
        request.status = Status.FINISHED
        request.finish_reason = reason
        request.error = error
        request.finish_time = self.clock()
        self.scheduler.remove(request)
        self.runner.release(request.request_id)
        self.stats.finished[reason.value] += 1

    def _emit(self, request: Request, tokens: list[int], logprobs: list) -> RequestOutput:
        text_state = self.texts[request.request_id]
        text = text_state.take(final=request.finished)
        output = make_output(request, tokens, text, logprobs)
        if request.finished:
            self._forget(request.request_id)
            self._observe("on_finished", output)
        return output

    def _forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self.texts.pop(request_id, None)
        self._read_each_step.discard(request_id)

    def _fail_batch(self, batch: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        message = f"generation failed: {type(exc).__name__}: {exc}"
        # not those finished since it was scheduled (async scheduling: by the step before)
        return [self._fail(s.request, message) for s in batch.seqs if not s.request.finished]

    def _fail(self, request: Request, message: str) -> RequestOutput:
        """Finish the request as failed and hand out its last output (held-back text is
        dropped: the text state may be what failed)."""
        if request.finished:  # it failed while being handed out
            request.finish_reason, request.error = FinishReason.ERROR, message
        else:
            self._finish(request, FinishReason.ERROR, message)
        output = make_output(request, [], "", [])
        self._forget(request.request_id)
        self._observe("on_finished", output)
        return output
