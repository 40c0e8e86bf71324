"""Scheduled batch -> tensors -> one forward over the paged cache -> sampled tokens."""

from __future__ import annotations

from collections.abc import Callable

import torch

from model.attention import PagedKVCache
from model.transformer import Transformer
from service.engine.cuda_graphs import DecodeGraphs
from service.engine.guided import GuidedSampler
from service.engine.ranks import Clear, RankError, Ranks, Step
from service.engine.request import Request
from service.engine.sampler import Sampler, SampleResult
from service.engine.scheduler import SchedulerOutput
from service.engine.speculative import DraftModel
from service.engine.structured import Masks


class ModelRunner:
    def __init__(
        self,
        model: Transformer,
        kv_cache: PagedKVCache,
        graphs: Callable[[], DecodeGraphs] | None = None,
        quantization: str = "none",
        ranks: Ranks | None = None,
        masks: Masks | None = None,
        draft: DraftModel | None = None,
    ) -> None:
        """graphs: builds the CUDA graphs of decode steps (after the weights are
        prepared); None runs every step eagerly. quantization: of the linear weights, as
        the backend's prepare() takes it. ranks: the tensor-parallel step channel (rank 0
        sends every forward's inputs, the others follow()). masks: the allowed tokens of
        constrained requests (structured outputs). draft: the speculative draft model,
        whose cache each forward is mirrored into."""
        self.model, self.ranks, self.draft = model, ranks, draft
        self.backend = kv_cache.backend
        # the weight layouts its linears read
        self.packed = self.backend.prepare(model, quantization)
        self.kv_cache = kv_cache
        self.device = model.device
        self.block_size = kv_cache.block_size
        self.sampler = Sampler(model.cfg.vocab_size, self.device, self.backend)
        self.guided = GuidedSampler(self.sampler, masks) if masks is not None else None
        self.generators: dict[str, list[torch.Generator]] = {}  # seeded request's rows
        self._pin = self.device.type == "cuda"
        self.graphs = graphs() if graphs is not None else None

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
        pool[row].manual_seed(_mix(seed, len(request.output_ids) + row))
        return pool[row]

    def clear_blocks(self, blocks: list[int]) -> None:
        """Zero these blocks' K and V in every layer (on every rank)."""
        if blocks:
            if self.ranks is not None:
                self.ranks.send(Clear(blocks))
            self.kv_cache.data.index_fill_(2, self._to_device(blocks), 0)

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    @torch.inference_mode()
    def run(self, batch: SchedulerOutput) -> SampleResult:
        """Forward every scheduled chunk; sample for the sequences whose chunk ends at
        their last token. Results are in the order of those sequences in the batch, one per
        sampled row: a sequence with k drafts has k + 1 (service/engine/speculative.py)."""
        tokens: list[int] = []
        logit_rows: list[int] = []
        sampled: list[Request] = []  # a request once per row it samples
        gens: list[torch.Generator | None] = []
        for seq in batch.seqs:
            tokens.extend(seq.request.tokens(seq.start, seq.start + seq.num_new))
            tokens.extend(seq.drafts)  # speculative: each draft's position samples too
            if seq.sample:
                rows = 1 + len(seq.drafts)
                logit_rows.extend(range(len(tokens) - rows, len(tokens)))
                sampled.extend([seq.request] * rows)
                gens.extend(self.generator_for(seq.request, j) for j in range(rows))
        step = Step(
            tokens,
            [s.request.block_table for s in batch.seqs],
            [s.start for s in batch.seqs],
            [s.num_new + len(s.drafts) for s in batch.seqs],
            logit_rows,
        )
        if self.ranks is None:
            logits = self.forward(step)
        else:  # more than one rank: a failed forward may leave them out of step
            self.ranks.send(step)
            try:
                logits = self.forward(step)
            except Exception as exc:
                raise RankError(f"a tensor-parallel forward failed: {exc}") from exc
        if self.draft is not None:  # the draft model's K/V follow the target's
            self.draft.mirror(step)
        if logits is None:
            return SampleResult([], [])
        guided = [i for i, r in enumerate(sampled) if r.guide is not None]
        if not guided or self.guided is None:
            return self.sampler.sample(logits, sampled, gens)
        return self.guided.sample(logits, sampled, gens, guided, self._busy(logits))

    @staticmethod
    def _busy(logits: torch.Tensor) -> Callable[[], bool] | None:
        """Whether the device is still computing the logits (a GPU: an event recorded
        after the forward's work); None on the CPU, whose forward returns finished."""
        if logits.device.type != "cuda":
            return None
        done = torch.cuda.Event()
        done.record()
        return lambda: not done.query()

    def forward(self, step: Step) -> torch.Tensor | None:
        """The logits (S, V) of the step's sampled rows (None: it samples none)."""
        meta = self.backend.metadata(
            step.block_tables,
            step.starts,
            step.num_new,
            self.block_size,
            self.device,
            self.kv_cache.null_block,
        )
        tokens = self._to_device(step.tokens)
        if not step.logit_rows:  # a prompt chunk (or a draft model's mirror): K/V only
            self.model(tokens, meta, self.kv_cache, self._to_device([]))
            return None
        # every sequence decodes one token (drafts sample at every row too: not a graph's)
        decodes = len(step.logit_rows) == len(step.tokens) == len(step.num_new)
        if decodes and self.graphs is not None and self.graphs.bucket(len(step.tokens)):
            return self.graphs.run(tokens, meta)  # (S, V)
        # decodes: every row is a logit row, in order, so no rows to pick
        rows = None if decodes else self._to_device(step.logit_rows)
        return self.model(tokens, meta, self.kv_cache, rows)

    @torch.inference_mode()
    def follow(self) -> None:
        """A rank other than 0: run the forwards rank 0 sends until it says stop."""
        assert self.ranks is not None and not self.ranks.leader
        while not Ranks.is_stop(message := self.ranks.receive()):
            if isinstance(message, Step):
                self.forward(message)
            elif isinstance(message, Clear):
                self.kv_cache.data.index_fill_(2, self._to_device(message.blocks), 0)
        self.ranks.leave()


def _mix(seed: int, position: int) -> int:
    """A 63-bit generator seed from a request's seed and an output position (splitmix64's
    finaliser, so that neighbouring seeds and positions give unrelated streams)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (z ^ (z >> 31)) >> 1
