"""What a prompt token counts for against the cap of a step that carries decodes
(--mixed-prefill-tokens): a plain one 1, one whose logprobs are asked for 4, one under a
LoRA adapter 1.25, one that is both 5; a step without decodes takes the whole budget."""

import pytest

from service.engine.core.scheduler import Scheduler
from service.engine.kv.blocks import BlockManager
from service.engine.request import Request, SamplingParams

CAP = 40


def first_chunk(params: SamplingParams, decoding: bool) -> int:
    """The prompt tokens a 100-token request under `params` gets on the step it is
    admitted, beside a decoding request or alone."""
    scheduler = Scheduler(
        BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=256, mixed_prefill_tokens=CAP
    )
    if decoding:
        running = Request("R", list(range(7)), SamplingParams(max_tokens=20), 0.0)
        scheduler.add(running)
        for seq in scheduler.schedule().seqs:  # R's prompt; R then decodes
            seq.request.num_computed += seq.num_new
            seq.request.output_ids.append(1)
    scheduler.add(Request("W", list(range(100, 200)), params, 0.0))
    out = scheduler.schedule()
    return next(s.num_new for s in out.seqs if s.request.request_id == "W")


@pytest.mark.parametrize(
    ("params", "tokens"),
    [
        (SamplingParams(max_tokens=4), CAP),
        (SamplingParams(max_tokens=4, prompt_logprobs=1), CAP // 4),
        (SamplingParams(max_tokens=4, lora="sql"), 32),  # 40 / 1.25
        (SamplingParams(max_tokens=4, lora="sql", prompt_logprobs=1), CAP // 5),
    ],
    ids=["plain", "scored", "adapted", "both"],
)
def test_a_prompt_token_counts_its_cost_against_a_decoding_steps_cap(
    params: SamplingParams, tokens: int
) -> None:
    assert first_chunk(params, decoding=True) == tokens
    assert first_chunk(params, decoding=False) == 100
