"""The batched sampler's logit transforms against a plain per-request reference."""

import pytest
import torch

from service.engine.request import Request, SamplingParams
from service.engine.sample.draws import TOP_P_CANDIDATES, top_p_filter
from service.engine.sample.sampler import Sampler

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


def test_penalties_count_a_token_not_read_yet() -> None:
    """pick's pending tokens (async scheduling: a row's last token still on the device)
    count as output: the same logits as with the token in output_ids, the same choice,
    the same logprobs; -1 counts nothing."""
    torch.manual_seed(1)
    logits = torch.randn(3, V) * 3
    kw = dict(frequency_penalty=0.9, presence_penalty=0.4, repetition_penalty=1.3, logprobs=2)
    read = [request([1], [4, 4, 9], **kw), request([5], [5], **kw), request([7], [2], **kw)]
    unread = [request([1], [4, 4], **kw), request([5], [], **kw), request([7], [2], **kw)]
    pending = torch.tensor([9, 5, -1])
    sampler = Sampler(V, torch.device("cpu"))
    want = sampler._apply_penalties(logits.clone(), read)
    torch.testing.assert_close(sampler._apply_penalties(logits.clone(), unread, pending), want)
    ids, lp = sampler.pick(logits.clone(), unread, [None] * 3, pending)
    result = sampler.sample(logits.clone(), read, [None] * 3)
    assert ids.tolist() == result.token_ids == want.argmax(dim=-1).tolist()
    assert lp is not None and lp.per_row(ids.tolist()) == result.logprobs


def test_logprobs_skip_rows_whose_logits_are_not_finite() -> None:
    logits = torch.randn(3, V)
    logits[1, 3] = float("nan")
    reqs = [request([1], [], logprobs=1) for _ in range(3)]
    result = Sampler(V, torch.device("cpu")).sample(logits, reqs, [None] * 3)
    assert result.token_ids[1] == -1  # NON_FINITE
    assert result.logprobs[1] is None
    assert [lp.token_id for lp in (result.logprobs[0], result.logprobs[2])] == [
        int(logits[0].argmax()),
        int(logits[2].argmax()),
    ]


def draws(logits: torch.Tensor, n: int, **params: object) -> torch.Tensor:
    """n draws from one row's distribution: n rows in one batch, the default generator."""
    sampler = Sampler(logits.shape[0], torch.device("cpu"))
    sampler.default_generator.manual_seed(1)
    reqs = [Request(f"r{i}", [1], SamplingParams(**params), 0.0) for i in range(n)]
    out = sampler.sample(logits.expand(n, -1).clone(), reqs, [None] * n)
    return torch.tensor(out.token_ids)


def test_draws_follow_the_distribution_and_its_filters() -> None:
    """The CDF draw gives each token its probability (within 4 standard errors over 40,000
    draws), never a token top_k, top_p or min_p removed, and temperature reshapes it."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -30.0, 1.5, 0.25])
    n = 40_000

    def check(got: torch.Tensor, probs: torch.Tensor) -> None:
        freq = torch.bincount(got, minlength=len(probs)).double() / n
        se = (probs * (1 - probs) / n).sqrt()
        assert ((freq - probs).abs() <= 4 * se + 1e-9).all(), (freq, probs)

    check(draws(logits, n, temperature=1.0), torch.softmax(logits.double(), -1))
    check(draws(logits, n, temperature=0.5), torch.softmax(logits.double() / 0.5, -1))
    top2 = torch.softmax(logits.double()[[0, 6]], -1)
    check(draws(logits, n, temperature=1.0, top_k=2), torch.zeros(8).double().index_put_(
        (torch.tensor([0, 6]),), top2))  # fmt: skip
    p = torch.softmax(logits.double(), -1)
    kept = p >= 0.2 * p.max()  # min_p 0.2
    check(draws(logits, n, temperature=1.0, min_p=0.2), torch.where(kept, p, 0) / p[kept].sum())
    got = draws(logits, n, temperature=1.0, top_p=0.5)
    assert set(got.tolist()) <= {0, 6}  # the smallest set reaching half the mass


def test_a_seeded_draw_is_the_same_alone_and_in_a_batch() -> None:
    logits = torch.randn(3, V)
    seeded = Request("s", [1], SamplingParams(temperature=1.0, seed=5), 0.0)
    other = [Request(f"o{i}", [1], SamplingParams(temperature=1.0), 0.0) for i in range(2)]

    def gen() -> torch.Generator:
        return torch.Generator().manual_seed(5)

    sampler = Sampler(V, torch.device("cpu"))
    # clones: the sampler consumes the logits it is given
    alone = [sampler.sample(logits[1:2].clone(), [seeded], [gen()]).token_ids[0] for _ in range(5)]
    batched = [
        sampler.sample(logits.clone(), [other[0], seeded, other[1]], [None, gen(), None]).token_ids[
            1
        ]
        for _ in range(5)
    ]
    assert alone == batched and len(set(alone)) == 1


def test_top_p_among_the_candidates_keeps_what_a_full_sort_keeps() -> None:
    """top_p_filter looks among each row's most likely tokens first, and sorts the whole row
    only when their mass falls short: both give the full sort's set."""

    def by_sorting(probs: torch.Tensor, top_p: float) -> torch.Tensor:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(dim=-1) - sorted_p
        return torch.zeros_like(probs).scatter_(1, order, sorted_p * (before < top_p))

    logits = torch.randn(4, 20_000, dtype=torch.float64)
    for scale, inside in ((8.0, True), (1.0, False)):  # peaked: the set is in the top 256
        probs = torch.softmax(logits * scale, dim=-1)
        assert bool((probs.topk(TOP_P_CANDIDATES[0]).values.sum(-1) >= 0.9).all()) == inside
        top_p = torch.full((4, 1), 0.9, dtype=probs.dtype)
        assert torch.equal(top_p_filter(probs, top_p), by_sorting(probs, 0.9))


def test_top_p_rows_of_one_batch_go_as_far_as_each_needs() -> None:
    """A batch whose rows' sets lie within the top 256 (x8), within the top 4,096 (x3) and
    beyond it (x1): each row gets the full sort's set, and only the last row is sorted."""
    logits = torch.randn(3, 20_000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    probs = torch.softmax(logits * torch.tensor([[8.0], [3.0], [1.0]], dtype=torch.float64), -1)
    mass = [probs.topk(k).values.sum(-1) for k in TOP_P_CANDIDATES]
    assert (
        mass[0].tolist()[0] >= 0.9 > mass[0].tolist()[1]
        and mass[1].tolist()[1] >= 0.9 > mass[1].tolist()[2]
    )
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(dim=-1) - sorted_p
    want = torch.zeros_like(probs).scatter_(1, order, sorted_p * (before < 0.9))
    widths = []
    real_topk = torch.Tensor.topk

    def topk(t, k, *a, **kw):  # type: ignore[no-untyped-def]
        widths.append((len(t), k))
        return real_topk(t, k, *a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "topk", topk)
        got = top_p_filter(probs, torch.full((3, 1), 0.9, dtype=probs.dtype))
    assert torch.equal(got, want)
    assert widths == [(3, 256), (2, 4096), (1, 20_000)]


def test_a_top_p_below_float32s_range_keeps_the_most_likely_token() -> None:
    """top_p = 5e-324 passes the API's > 0 and is 0 in the sampler's float32 column: the
    row keeps its most likely token (it kept none, and the draw fell past the row's end)."""
    logits = torch.randn(V, generator=torch.Generator().manual_seed(3))
    logits[V - 1] = -50.0  # the last id, where an empty row's draw landed
    got = draws(logits, 8, temperature=1.0, top_p=5e-324)
    assert got.tolist() == [int(logits.argmax())] * 8
    probs = torch.softmax(logits, -1)[None].expand(2, -1)
    kept = top_p_filter(probs, torch.zeros(2, 1))
    assert (kept > 0).sum(-1).tolist() == [1, 1] and kept.argmax(-1).tolist() == [
        int(logits.argmax())
    ] * 2


def test_top_k_in_a_batch_filters_its_own_rows_only() -> None:
    """Rows with top_k and rows without, in one batch: each keeps its own distribution."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -30.0, 1.5, 0.25])
    n = 20_000
    sampler = Sampler(len(logits), torch.device("cpu"))
    sampler.default_generator.manual_seed(2)
    reqs = [
        Request(f"r{i}", [1], SamplingParams(temperature=1.0, top_k=2 if i % 2 else 0), 0.0)
        for i in range(n)
    ]
    got = torch.tensor(sampler.sample(logits.expand(n, -1).clone(), reqs, [None] * n).token_ids)
    assert set(got[1::2].tolist()) == {0, 6}
    plain = torch.bincount(got[0::2], minlength=len(logits)).double() / (n // 2)
    p = torch.softmax(logits.double(), -1)
    assert ((plain - p).abs() <= 4 * (p * (1 - p) / (n // 2)).sqrt() + 1e-9).all(), plain


def test_a_tiny_repetition_penalty_draws_an_allowed_token() -> None:
    """repetition_penalty 5e-324 (valid: > 0) divides a seen token's positive logit past
    float32's range; the draw must still pick among the tokens a structured-output mask
    allows (an infinite logit made the row's CDF NaN, and a forbidden token was drawn:
    a 500 from the grammar, found by tests/reliability/test_fuzz.py)."""
    torch.manual_seed(0)
    logits = torch.randn(1, V).abs() + 0.5  # every logit positive
    allowed = torch.zeros(1, V, dtype=torch.bool)
    allowed[0, [3, 17]] = True
    for seed in range(20):
        r = Request("r", [3, 17, 40], SamplingParams(temperature=1.0, repetition_penalty=5e-324,
                                                      seed=seed), 0.0)  # fmt: skip
        sampler = Sampler(V, torch.device("cpu"))
        out = sampler.sample(logits.clone(), [r], [torch.Generator().manual_seed(seed)],
                             mask=([0], allowed))  # fmt: skip
        assert out.token_ids[0] in (3, 17), out.token_ids
