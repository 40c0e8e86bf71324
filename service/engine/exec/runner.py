"""Scheduled batch -> tensors -> one forward over the paged cache -> sampled tokens."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from model.kv_cache import PagedKVCache
from model.metadata import AttentionMetadata
from model.transformer import Transformer
from service.engine.batch import SchedulerOutput, Step
from service.engine.exec.cuda_graphs import DecodeGraphs
from service.engine.exec.prompt_outputs import Pooled, Scored, pool, prompt_work, score_prompts
from service.engine.exec.ranks import Clear, RankError, Ranks, SlotFill
from service.engine.kv.disk_tier import DiskTier
from service.engine.kv.host_tier import Copies, run_copies
from service.engine.request import PENDING, Request
from service.engine.sample.draws import seed_for
from service.engine.sample.logprobs import LogprobRows, token_logprobs
from service.engine.sample.sampler import Sampler, SampleResult
from service.engine.sample.structured import Masks
from service.engine.sample.structured_sampling import StructuredSampler


@dataclass(slots=True)
class Launched:
    """A step queued on the device: its sampled tokens, read (result), or not yet read
    (async scheduling): ids on the device, where the next step's inputs come from, with
    each sampling request's row, and their copy on the way to the host (copied, an event
    recorded after the copy: reading it waits for this step alone, not for the step
    queued after it), with the logprobs of the rows that ask for them."""

    batch: SchedulerOutput
    result: SampleResult | None
    ids: torch.Tensor | None = None
    rows: dict[str, int] | None = None
    host_ids: torch.Tensor | None = None
    copied: torch.cuda.Event | None = None
    logprobs: LogprobRows | None = None  # on their way to the host with the ids


@dataclass(slots=True)
class StepInputs:
    """A step's forward inputs and who samples from which of its logit rows."""

    step: Step
    scored: list[Scored]  # the prompt rows whose logprobs are wanted
    pooled: list[Pooled]  # the rows of the embedding requests
    sampled: list[Request]  # a request once per row it samples
    gens: list[torch.Generator | None]
    fill: list[tuple[int, int]]  # (row of tokens, row of prev's ids)
    unread: dict[str, int]  # request -> its pending token's row of prev's ids


class ModelRunner:
    def __init__(
        self,
        model: Transformer,
        kv_cache: PagedKVCache,
        graphs: Callable[[], DecodeGraphs] | None = None,
        quantization: str = "none",
        ranks: Ranks | None = None,
        masks: Masks | None = None,
        mirror: Callable[[Step], None] | None = None,
        disk: DiskTier | None = None,
    ) -> None:
        """graphs: builds the CUDA graphs of decode steps (after the weights are
        prepared); None runs every step eagerly. quantization: of the linear weights, as
        the backend's prepare() takes it. ranks: the tensor-parallel step channel (rank 0
        sends every forward's inputs, the others follow()). masks: the allowed tokens of
        constrained requests (structured outputs). mirror: runs after each forward with
        its inputs (the speculative draft model computes its own K/V of them). disk: the
        host tier's disk tier, whose reads and writes a step's copies include."""
        self.model, self.ranks, self.mirror = model, ranks, mirror
        self.backend = kv_cache.backend
        # the weight layouts its linears read
        self.packed = self.backend.prepare(model, quantization)
        self.kv_cache = kv_cache
        self.device = model.device
        self.block_size = kv_cache.block_size
        self.sampler = Sampler(model.cfg.vocab_size, self.device, self.backend)
        self.structured = StructuredSampler(self.sampler, masks) if masks is not None else None
        self.generators: dict[str, list[torch.Generator]] = {}  # seeded request's rows
        self._pin = self.device.type == "cuda"
        self.graphs = graphs() if graphs is not None else None
        self.disk = disk

    def _to_device(self, values: list[int]) -> torch.Tensor:
        t = torch.tensor(values, dtype=torch.long, pin_memory=self._pin)
        return t.to(self.device, non_blocking=True)

    def generator_for(self, request: Request, row: int) -> torch.Generator | None:
        """A seeded request's generator for the `row`-th token it samples this step, seeded
        by its seed and that token's place in its output: a draw depends on the seed and
        the position alone, never on the batch, on preemption or on how many drafts a
        step verifies, so speculation gives a seeded request the very tokens it gets
        without it."""
        seed = request.params.seed
        if seed is None:
            return None
        pool = self.generators.setdefault(request.request_id, [])
        while len(pool) <= row:
            pool.append(torch.Generator(device=self.device))
        pool[row].manual_seed(seed_for(seed, request.num_generated + row))
        return pool[row]

    def apply(self, message: Clear | Copies | SlotFill) -> None:
        """Work outside a forward, on every rank: zero blocks whose K/V must not be
        reused (Clear), the host tier's copies a step owes (before it), or a LoRA
        adapter put into a slot of the bank (SlotFill)."""
        if self.ranks is not None:
            self.ranks.send(message)
        self._apply(message)

    def _apply(self, message: Clear | Copies | SlotFill) -> None:
        if isinstance(message, Clear):
            blocks, window = self._to_device(message.blocks), self._to_device(message.window_blocks)
            self.kv_cache.clear(blocks, window)
        elif isinstance(message, SlotFill):
            assert self.model.adapters is not None, "a LoRA slot filled on a model without adapters"
            self.model.adapters.fill(message.name, message.slot)
        else:
            run_copies(message, self.kv_cache, self.disk)

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def run(self, batch: SchedulerOutput) -> SampleResult:
        """Forward every scheduled chunk; sample for the sequences whose chunk ends at
        their last token. Results are in the order of those sequences in the batch, one per
        sampled row: a sequence with k drafts has k + 1 (service/engine/exec/speculative.py)."""
        return self.read(self.launch(batch))

    @torch.inference_mode()
    def launch(
        self, batch: SchedulerOutput, prev: Launched | None = None, read_later: bool = False
    ) -> Launched:
        """Queue the batch's forward and sampling on the device. prev: the step still in
        flight whose sampled ids are this batch's PENDING input tokens (async scheduling:
        they go from its ids to this forward's inputs on the device, never through the
        host). read_later: leave the sampled ids on the device (Sampler.pick) for read()
        to fetch after the next step is queued; else they are read now."""
        inputs = self._inputs(batch, prev)
        filled = (inputs.fill, prev.ids) if inputs.fill else None  # type: ignore[union-attr]
        logits = self._forward_all(inputs.step, filled, inputs.pooled)
        sampled_rows = len(inputs.sampled)
        if inputs.scored and logits is not None:
            score_prompts(logits[sampled_rows:], inputs.scored)
            logits = logits[:sampled_rows] if sampled_rows else None
        if logits is None:
            return Launched(batch, SampleResult([], []))
        if read_later:
            return self._pick(batch, logits, inputs, prev)
        return Launched(batch, self._sample(logits, inputs.sampled, inputs.gens))

    def _inputs(self, batch: SchedulerOutput, prev: Launched | None) -> StepInputs:
        """The forward's inputs in plain ints, and who samples from which of its rows."""
        tokens: list[int] = []
        logit_rows: list[int] = []
        sampled: list[Request] = []
        gens: list[torch.Generator | None] = []
        fill: list[tuple[int, int]] = []
        unread: dict[str, int] = {}
        scored, pooled = prompt_work(batch.seqs)
        for seq in batch.seqs:
            rid = seq.request.request_id
            tokens.extend(seq.request.tokens(seq.start, seq.start + seq.num_new))
            if tokens[-1] == PENDING:  # its one unread token: the last, a decode's input
                assert prev is not None and prev.ids is not None, "a pending token, no step"
                unread[rid] = prev.rows[rid]  # type: ignore[index]
                fill.append((len(tokens) - 1, unread[rid]))
            tokens.extend(seq.drafts)  # speculative: each draft's position samples too
            if seq.sample:
                rows = 1 + len(seq.drafts)
                logit_rows.extend(range(len(tokens) - rows, len(tokens)))
                sampled.extend([seq.request] * rows)
                gens.extend(self.generator_for(seq.request, j) for j in range(rows))
        logit_rows += [
            r for _, first, targets in scored for r in range(first, first + len(targets))
        ]
        windowed = self.kv_cache.window_data is not None
        slots = [s.request.lora_slot for s in batch.seqs]
        step = Step(
            tokens,
            [s.request.block_table for s in batch.seqs],
            [s.start for s in batch.seqs],
            [s.num_new + len(s.drafts) for s in batch.seqs],
            logit_rows,
            [s.request.window_table for s in batch.seqs] if windowed else None,
            [s.request.num_prompt for s in batch.seqs],
            slots if any(slot >= 0 for slot in slots) else None,
        )
        return StepInputs(step, scored, pooled, sampled, gens, fill, unread)

    def _forward_all(
        self,
        step: Step,
        filled: tuple[list[tuple[int, int]], torch.Tensor] | None,
        pooled: list[Pooled],
    ) -> torch.Tensor | None:
        """The forward on this rank and every other; the draft model's K/V follow."""
        if self.ranks is None:
            logits = self.forward(step, filled, pooled)
        else:  # more than one rank: a failed forward may leave them out of step
            assert filled is None, "async scheduling sends no pending tokens to other ranks"
            self.ranks.send(step)
            try:  # the other ranks run the same collectives (model.forward)
                logits = self.forward(step, None, pooled)
            except Exception as exc:
                raise RankError(f"a tensor-parallel forward failed: {exc}") from exc
        if self.mirror is not None:  # the draft model's K/V follow the target's
            self.mirror(step)
        return logits

    def _pick(
        self,
        batch: SchedulerOutput,
        logits: torch.Tensor,
        inputs: StepInputs,
        prev: Launched | None,
    ) -> Launched:
        """Sample, leaving the ids on the device (async scheduling: read after the next
        step is queued), their copy to the host on its way."""
        sampled, unread = inputs.sampled, inputs.unread
        rows = {r.request_id: i for i, r in enumerate(sampled)}
        pending = None
        if unread and any(r.params.needs_penalties for r in sampled):
            pending = self._unread_ids(sampled, unread, prev.ids)  # type: ignore[union-attr]
        ids, lp = self.sampler.pick(logits, sampled, inputs.gens, pending)
        if not self._pin:  # the CPU: computed already
            return Launched(batch, None, ids, rows, ids, logprobs=lp)
        host, host_lp = _to_host(ids), lp.moved(_to_host) if lp is not None else None
        copied = torch.cuda.Event()
        copied.record()
        return Launched(batch, None, ids, rows, host, copied, host_lp)

    def _sample(
        self, logits: torch.Tensor, sampled: list[Request], gens: list[torch.Generator | None]
    ) -> SampleResult:
        """Sample now: under their grammars where requests have one."""
        constrained = [i for i, r in enumerate(sampled) if r.guide is not None]
        if not constrained or self.structured is None:
            return self.sampler.sample(logits, sampled, gens)
        return self.structured.sample(logits, sampled, gens, constrained, self._busy(logits))

    @staticmethod
    def read(launched: Launched) -> SampleResult:
        """The launched step's sampled tokens on the host (waits for the device)."""
        if launched.result is not None:
            return launched.result
        assert launched.host_ids is not None
        if launched.copied is not None:
            launched.copied.synchronize()
        ids = launched.host_ids.tolist()
        return SampleResult(ids, token_logprobs(launched.logprobs, ids))

    def _unread_ids(
        self, sampled: list[Request], unread: dict[str, int], ids: torch.Tensor
    ) -> torch.Tensor:
        """Each sampled row's token not read yet, from the step in flight's ids (B,), -1
        for none (and for a NON_FINITE id, whose request fails when it is read)."""
        index = self._to_device([unread.get(r.request_id, -1) for r in sampled])
        return torch.where(index < 0, -1, ids[index.clamp(min=0)])

    @staticmethod
    def _busy(logits: torch.Tensor) -> Callable[[], bool] | None:
        """Whether the device is still computing the logits (a GPU: an event recorded
        after the forward's work); None on the CPU, whose forward returns finished."""
        if logits.device.type != "cuda":
            return None
        done = torch.cuda.Event()
        done.record()
        return lambda: not done.query()

    def forward(
        self,
        step: Step,
        fill: tuple[list[tuple[int, int]], torch.Tensor] | None = None,
        pooled: list[Pooled] | None = None,
    ) -> torch.Tensor | None:
        """The logits (S, V) of the step's sampled rows (None: it samples none). fill:
        the rows of step.tokens that are PENDING and, for each, its row in the ids (the
        previous step's samples, on the device) that holds it. pooled: embedding
        requests' rows (prompt_outputs.pool_rows), whose final hidden states they pool.
        A step with LoRA rows gives the model each row's adapter slot for its run."""
        adapters = self.model.adapters
        if step.lora_slots is None or adapters is None:
            return self._forward(step, fill, pooled)
        slots = torch.tensor(step.lora_slots, dtype=torch.long)
        rows = slots.repeat_interleave(torch.tensor(step.num_new))
        adapters.rows = rows.to(self.device, non_blocking=True)
        try:
            return self._forward(step, fill, pooled)
        finally:
            adapters.rows = None

    def _forward(
        self,
        step: Step,
        fill: tuple[list[tuple[int, int]], torch.Tensor] | None,
        pooled: list[Pooled] | None,
    ) -> torch.Tensor | None:
        meta = self.backend.metadata(
            step.block_tables,
            step.starts,
            step.num_new,
            self.block_size,
            self.device,
            self.kv_cache.null_block,
            step.window_tables,
            self.kv_cache.window_null_block,
        )
        meta.prompt_lens = step.prompt_lens
        tokens = self._to_device(step.tokens)
        if fill is not None:
            tokens = self._fill(tokens, *fill)
        if pooled:
            return self._pool(tokens, meta, step, pooled)
        if not step.logit_rows:  # a prompt chunk (or a draft model's mirror): K/V only
            self.model(tokens, meta, self.kv_cache, self._to_device([]))
            return None
        # every sequence decodes one token (drafts sample at every row too: not a graph's)
        decodes = len(step.logit_rows) == len(step.tokens) == len(step.num_new)
        if decodes and self.graphs is not None and self.graphs.bucket(len(step.tokens)):
            adapters = self.model.adapters
            return self.graphs.run(tokens, meta, adapters.rows if adapters else None)  # (S, V)
        # decodes: every row is a logit row, in order, so no rows to pick
        rows = None if decodes else self._to_device(step.logit_rows)
        return self.model(tokens, meta, self.kv_cache, rows)

    def _pool(
        self, tokens: torch.Tensor, meta: AttentionMetadata, step: Step, pooled: list[Pooled]
    ) -> torch.Tensor | None:
        """A step with embedding requests: the final hidden states, pooled into theirs,
        then the logits of the sampled rows from the same states."""
        hidden = self.model.hidden(tokens, meta, self.kv_cache)
        pool(hidden, pooled)
        if not step.logit_rows:
            return None
        rows = hidden.index_select(0, self._to_device(step.logit_rows))
        return self.model.head(rows, self.kv_cache.backend)

    def _fill(
        self, tokens: torch.Tensor, rows: list[tuple[int, int]], ids: torch.Tensor
    ) -> torch.Tensor:
        """tokens with its PENDING rows taken from ids (a NON_FINITE id reads as token 0:
        its request fails when the ids are read; the row only has to be a valid index)."""
        ids = ids.clamp(min=0)
        if len(rows) == len(ids) == len(tokens) and all(a == b for a, b in rows):
            return ids  # every sequence decodes its pending token, in the same order
        dst, src = zip(*rows, strict=True)
        tokens[self._to_device(list(dst))] = ids[self._to_device(list(src))]
        return tokens

    @torch.inference_mode()
    def follow(self) -> None:
        """A rank other than 0: run the forwards rank 0 sends until it says stop."""
        assert self.ranks is not None and not self.ranks.leader
        while not Ranks.is_stop(message := self.ranks.receive()):
            if isinstance(message, Step):
                self.forward(message)
            elif isinstance(message, Clear | Copies | SlotFill):
                self._apply(message)
        self.ranks.leave()


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A non-blocking copy of a device tensor into pinned host memory (complete once an
    event recorded after it has)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)
