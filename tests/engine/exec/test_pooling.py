"""Embedding requests (SamplingParams.pooling) in the engine: a prompt's final hidden
states pooled (the last token's, or the mean) and normalised equal a dense forward's, with
the prompt in chunks, beside requests that generate, with async scheduling, after a
prefix-cache hit (last-token pooling reads the cache; the mean computes every token), and
every block released."""

import random

import pytest
import torch

from service.engine.request import SamplingParams
from tests.engine.helpers import greedy, run_all, tokens_of
from tests.factories import make_engine, small_model


@pytest.fixture(scope="module")
def model():
    return small_model()


def dense(model, prompt: list[int], pooling: str) -> torch.Tensor:
    with torch.inference_mode():
        h = model.hidden(torch.tensor(prompt)).float()
    pooled = h.mean(dim=0) if pooling == "mean" else h[-1]
    return torch.nn.functional.normalize(pooled, dim=0)


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_pooled_states_are_a_dense_forwards(model, pooling: str, async_scheduling: str) -> None:
    rng = random.Random(1)
    prompts = [[rng.randrange(1, 300) for _ in range(n)] for n in (45, 9, 33)]
    e = make_engine(model, max_num_batched_tokens=16, async_scheduling=async_scheduling)
    embed = SamplingParams(max_tokens=1, pooling=pooling)
    requests = {f"e{i}": (p, embed) for i, p in enumerate(prompts)}
    requests["g"] = (prompts[0], greedy(6))  # a generation beside them
    outs = run_all(e, requests)
    for i, p in enumerate(prompts):
        [out] = outs[f"e{i}"]
        assert out.finished and out.token_ids == [] and out.finish_reason.value == "stop"
        got = torch.tensor(out.embedding)
        assert (got - dense(model, p, pooling)).abs().max().item() <= 1e-5
    alone = make_engine(model)
    assert tokens_of(outs["g"]) == tokens_of(run_all(alone, {"g": (prompts[0], greedy(6))})["g"])
    again = run_all(e, {"again": (prompts[0], embed)})["again"][0]
    if pooling == "last":
        assert again.num_cached_tokens > 0
    else:
        assert again.num_cached_tokens == 0
    assert (torch.tensor(again.embedding) - dense(model, prompts[0], pooling)).abs().max() <= 1e-5
    assert e.blocks.num_used == 0


def test_a_preempted_mean_starts_over(model) -> None:
    """Preempted mid-prompt, a mean-pooling request computes its prompt again from the
    start: its rows are summed once."""
    prompt = list(range(3, 48))
    e = make_engine(model, max_num_batched_tokens=16)
    e.add_request("m", prompt, SamplingParams(max_tokens=1, pooling="mean"))
    e.step()  # the first chunk
    [request] = e.scheduler.running
    assert 0 < request.num_computed < len(prompt) and request.pool_sum is not None
    e.scheduler.running.remove(request)
    e.scheduler.preempt(request)
    outs = []
    while e.has_unfinished():
        outs += e.step()
    [out] = outs
    assert (torch.tensor(out.embedding) - dense(model, prompt, "mean")).abs().max() <= 1e-5
