"""Prompt logprobs (SamplingParams.prompt_logprobs: echo with logprobs, vLLM's
prompt_logprobs): each prompt token's logprob, rank and the most likely alternatives are a
full forward's log-softmax, with the prompt in chunks, after its prefix was cached (the
cache is skipped: every position computed), on the first of n choices, and with
async scheduling."""

import random

import pytest
import torch

from tests.engine.helpers import greedy, run_all, tokens_of
from tests.factories import make_engine, small_model


@pytest.fixture(scope="module")
def model():
    return small_model()


def expected(model, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor(prompt)).float(), dim=-1)


def check(entries, prompt: list[int], lp: torch.Tensor, top: int) -> None:
    assert len(entries) == len(prompt) - 1
    for i, e in enumerate(entries):  # entry i: prompt token i + 1 after tokens 0..i
        want = lp[i, prompt[i + 1]].item()
        assert e.token_id == prompt[i + 1]
        assert abs(e.logprob - want) <= 1e-4, (i, e.logprob, want)
        assert e.rank == int((lp[i] > lp[i, prompt[i + 1]]).sum()) + 1
        values, ids = lp[i].topk(top)
        assert [t for t, _ in e.top] == ids.tolist()
        assert all(abs(v - w) <= 1e-4 for (_, v), w in zip(e.top, values.tolist(), strict=True))


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_prompt_logprobs_are_a_full_forwards(model, async_scheduling: str) -> None:
    rng = random.Random(0)
    prompt = [rng.randrange(1, 300) for _ in range(45)]
    lp = expected(model, prompt)
    e = make_engine(model, max_num_batched_tokens=16, async_scheduling=async_scheduling)
    plain = tokens_of(run_all(e, {"a": (prompt, greedy(4))})["a"])  # caches the prefix
    outs = run_all(e, {"b": (prompt, greedy(4, prompt_logprobs=3))})["b"]
    assert outs[-1].num_cached_tokens == 0  # computed, not read from the cache
    assert tokens_of(outs) == plain  # sampling unchanged
    carried = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
    assert len(carried) == 1 and outs[0].prompt_logprobs is not None
    check(carried[0], prompt, lp, 3)
    assert e.blocks.num_used == 0


def test_the_first_of_n_choices_carries_them(model) -> None:
    prompt = list(range(5, 30))
    e = make_engine(model)
    e.add_request("n", prompt, greedy(3, n=2, prompt_logprobs=0))
    outs = []
    while e.has_unfinished():
        outs += e.step()
    firsts = [o for o in outs if o.prompt_logprobs is not None]
    assert [o.index for o in firsts] == [0]
    check(firsts[0].prompt_logprobs, prompt, expected(model, prompt), 0)


def test_a_one_token_prompt_has_none(model) -> None:
    e = make_engine(model)
    outs = run_all(e, {"a": ([7], greedy(2, prompt_logprobs=1))})["a"]
    assert outs[0].prompt_logprobs == []


def test_a_long_rope_prompt_past_the_pretraining_length_is_transformers(tmp_path) -> None:
    """Phi-3's LongRoPE: a prompt longer than the pretraining length (128 here) turns by
    the long factors throughout, as transformers turns it, through the paged engine in
    chunks: every prompt token's logprob, and the greedy tokens after it, are
    transformers' (the short factors at its first 128 positions were 8e-3 away)."""
    from model.weights import load_model
    from tests.factories import write_phi3

    hf = write_phi3(tmp_path)
    engine = make_engine(load_model(tmp_path, torch.float32))
    prompt = torch.randint(
        3, hf.config.vocab_size, (160,), generator=torch.Generator().manual_seed(1)
    )
    with torch.inference_mode():
        lp = torch.log_softmax(hf(prompt[None]).logits[0].float(), dim=-1)
        hf.generation_config.eos_token_id = None
        want = hf.generate(prompt[None], max_new_tokens=8, do_sample=False, pad_token_id=0,
                           attention_mask=torch.ones(1, 160, dtype=torch.long))[0, 160:]  # fmt: skip
    out = run_all(engine, {"a": (prompt.tolist(), greedy(8, prompt_logprobs=2))})["a"]
    check(out[0].prompt_logprobs, prompt.tolist(), lp, 2)
    assert tokens_of(out) == want.tolist()
