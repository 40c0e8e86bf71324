"""What one engine step carries: the scheduler's choice (SchedulerOutput, the only thing
the runner sees of it) and the forward's inputs in plain ints (Step, what every rank and
the draft model's mirror run)."""

from __future__ import annotations

from dataclasses import dataclass, field

from service.engine.request import Request


@dataclass(slots=True)
class ScheduledSeq:
    request: Request
    start: int  # tokens already cached before this step
    num_new: int  # tokens computed this step
    sample: bool  # the chunk reaches the last token: sample the next one
    drafts: list[int] = field(default_factory=list)  # proposed tokens computed after it
    pools: bool = False  # it ends an embedding request's prompt: pool instead of sampling


@dataclass(slots=True)
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    prefix_queried: int = 0  # prompt tokens looked up in the prefix cache this step
    prefix_hits: int = 0  # ... and found there
    loading: int = 0  # waiting requests whose cached blocks are being read from disk

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new + len(s.drafts) for s in self.seqs)


@dataclass(frozen=True, slots=True)
class Step:
    """One forward's inputs, in plain ints: what every rank needs to run it."""

    tokens: list[int]
    block_tables: list[list[int]]
    starts: list[int]  # tokens each sequence already has in the cache
    num_new: list[int]
    logit_rows: list[int]  # rows of `tokens` whose logits are sampled
    # the windowed layers' own pool's tables (PagedKVCache.window_data), where it has one
    window_tables: list[list[int]] | None = None
    # each sequence's prompt length (LongRoPE turns a prompt past the model's pretraining
    # length by its long factors throughout: Transformer.rope_rows); None: not given
    prompt_lens: list[int] | None = None
    # each sequence's LoRA adapter slot (-1: the base model); None: no sequence has one
    lora_slots: list[int] | None = None
