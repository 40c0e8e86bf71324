"""The speculative draft model: a small model of the same tokenizer whose greedy choices
are a sequence's drafts (service/engine/exec/speculative.py verifies them)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from service.engine.batch import Step
from service.engine.exec.runner import ModelRunner
from service.engine.request import Request


def blocks_per_proposal(k: int, block_size: int) -> int:
    """Scratch blocks a k-token lookahead needs: it may start at a block's last slot."""
    return -(-(block_size - 1 + k) // block_size)


class DraftModel:
    """A small model of the same tokenizer proposing by its greedy choice. Its KV cache has
    the target's blocks (the same block tables address both) plus scratch blocks: the
    target runner mirrors every forward into it, so the draft's K/V of a sequence's
    computed tokens is always there; a proposal copies the sequence's last, partly filled
    block into scratch and writes its own lookahead there, never into a shared block."""

    def __init__(
        self, runner: ModelRunner, num_blocks: int, k: int, max_batch: int, target_vocab: int
    ) -> None:
        """runner: the draft's ModelRunner, its cache scratch_blocks(...) larger than the
        target's num_blocks; k: the most tokens a proposal has; max_batch: proposals at
        once; target_vocab: proposals stop at a token the target does not have."""
        self.runner = runner
        self.block_size = runner.block_size
        self.per_seq = blocks_per_proposal(k, self.block_size)
        self.scratch = list(range(num_blocks, num_blocks + self.per_seq * max_batch))
        self.target_vocab = target_vocab

    def mirror(self, step: Step) -> None:
        """Compute the draft's K/V of the target's step (no logits)."""
        self.runner.forward(Step(step.tokens, step.block_tables, step.starts, step.num_new, []))

    @torch.inference_mode()  # as the target's forwards (ModelRunner.run)
    def propose(self, requests: Sequence[Request], wanted: Sequence[int]) -> list[list[int]]:
        """Up to wanted[i] greedy tokens of the draft after request i's tokens, in
        max(wanted) batched forwards of one token per sequence."""
        ks = list(wanted)
        bs, data = self.block_size, self.runner.kv_cache.data
        tables, starts = [], []
        for i, r in enumerate(requests):
            pos = r.num_tokens - 1  # its last token: not in the cache yet
            full, own = pos // bs, self.scratch[i * self.per_seq : (i + 1) * self.per_seq]
            if pos % bs:  # the computed part of the block the lookahead starts in
                data[:, :, own[0]] = data[:, :, r.block_table[full]]
            tables.append(r.block_table[:full] + own)
            starts.append(pos)
        drafts: list[list[int]] = [[] for _ in requests]
        last = [(r.output_ids or r.prompt_ids)[-1] for r in requests]
        live = list(range(len(requests)))
        for j in range(max(ks, default=0)):
            live = [i for i in live if len(drafts[i]) < ks[i]]
            if not live:
                break
            logits = self.runner.forward(
                Step(
                    [last[i] for i in live],
                    [tables[i] for i in live],
                    [starts[i] + j for i in live],
                    [1] * len(live),
                    list(range(len(live))),
                )
            )
            assert logits is not None
            for i, token in zip(live, self.runner.backend.greedy(logits), strict=True):
                if 0 <= token < self.target_vocab:
                    drafts[i].append(token)
                    last[i] = token
                else:  # non-finite logits, or a token the target lacks: it stops here
                    ks[i] = len(drafts[i])
        return drafts
