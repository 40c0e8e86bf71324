"""The batched sampler's logit transforms against a plain per-request reference."""

import torch

from service.engine.request import Request, SamplingParams
from service.engine.sampler import Sampler

V = 50


def request(prompt, output, **params) -> Request:
    r = Request("r", list(prompt), SamplingParams(temperature=0, **params), 0.0)
    r.output_ids = list(output)
    return r


def reference(logits: torch.Tensor, r: Request) -> torch.Tensor:
    """One request's logits after logit_bias, then repetition / frequency / presence
    penalties, element by element."""
    x = logits.clone()
    p = r.params
    for token, bias in p.logit_bias:
        x[token] += bias
    for t in range(V):
        n = r.output_ids.count(t)
        if p.repetition_penalty != 1 and (n or t in r.prompt_ids):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        x[t] -= p.frequency_penalty * n + p.presence_penalty * (n > 0)
    return x


def test_bias_and_penalties_batched_equal_each_request_alone() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, V) * 3
    requests = [
        request([1, 2, 3], [4, 4, 9], logit_bias=((7, 5.0), (8, -2.0))),
        request([5, 60, 5], [5, 11], repetition_penalty=1.7),  # 60: outside the vocabulary
        request([0], [3, 3, 3, 12], frequency_penalty=0.8, presence_penalty=0.5),
        request([2], [], logit_bias=((49, 1.5),), repetition_penalty=0.6, presence_penalty=1.0),
    ]
    sampler = Sampler(V, torch.device("cpu"))
    got = sampler._apply_penalties(sampler._apply_bias(logits.clone(), requests), requests)
    for i, r in enumerate(requests):
        torch.testing.assert_close(got[i], reference(logits[i], r), atol=1e-6, rtol=0)
    result = sampler.sample(logits, requests, [None] * 4)
    assert result.token_ids == [
        int(reference(logits[i], r).argmax()) for i, r in enumerate(requests)
    ]
