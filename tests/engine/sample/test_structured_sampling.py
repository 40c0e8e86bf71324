"""Constrained rows choose from the masked distribution on each of their paths
(service/engine/sample/structured_sampling.py): further choices from the first draw's distribution, a choice
among a small mask's tokens alone, a second draw over the whole vocabulary under the
mask. The grammar is the regex [0-9] over cl100k: ten single-digit tokens allowed out of
100k; the logits put the digits' share of the mass where each path is taken."""

import math
from collections import Counter

import numpy as np
import pytest
import torch

from model.tokenizer import Tokenizer
from service.engine.request import Constraint, Request, SamplingParams
from service.engine.sample import structured_sampling
from service.engine.sample.sampler import Sampler
from service.engine.sample.structured import Grammars, Masks, unpack
from service.engine.sample.structured_sampling import StructuredSampler

DIGIT = Constraint("regex", "[0-9]", "guided_regex")
ROWS, ROUNDS = 16, 125  # 2,000 draws a case
CHI2_9DOF_P001 = 27.88  # chi-square critical value, 9 degrees of freedom, p = 0.001
CHI2_6DOF_P001 = 22.46


@pytest.fixture(scope="module")
def setup() -> tuple[Grammars, StructuredSampler, list[int]]:
    tok = Tokenizer.default()
    grammars = Grammars(tok, tok.vocab_size, tok.eos_ids)
    sampler = Sampler(tok.vocab_size, torch.device("cpu"))
    digits = [tok.encode(str(d), add_bos=False)[0] for d in range(10)]
    assert len(set(digits)) == 10
    return grammars, StructuredSampler(sampler, Masks(grammars)), digits


def row(vocab: int, digits: list[int], digit_share: float) -> torch.Tensor:
    """Logits: the digits' probabilities proportional to 1..10, carrying `digit_share` of
    the mass; every other token alike."""
    weights = torch.arange(1, 11, dtype=torch.float64)
    others = (1 - digit_share) / (vocab - 10)
    logits = torch.full((vocab,), math.log(others), dtype=torch.float64)
    logits[digits] = torch.log(weights / weights.sum() * digit_share)
    return logits.float()


def draws(setup, logits: torch.Tensor, params: SamplingParams, busy_rows: int = 0) -> Counter:
    """Counts of each token over ROUNDS batches of ROWS rows. busy_rows: the device is
    "still computing" while that many masks are computed (a GPU's forward); 0: the CPU."""
    grammars, sampler, digits = setup
    sampler.sampler.default_generator.manual_seed(7)  # the same draws every run
    counts: Counter = Counter()
    for _ in range(ROUNDS):
        requests = [Request(f"r{i}", [1], params, 0.0) for i in range(ROWS)]
        for r in requests:
            r.guide = grammars.guide(DIGIT)
        batch = logits.repeat(ROWS, 1)
        busy = iter([True] * busy_rows + [False] * ROWS).__next__ if busy_rows else None
        result = sampler.sample(batch, requests, [None] * ROWS, list(range(ROWS)), busy)
        counts.update(result.token_ids)
    assert set(counts) <= set(digits), "a token outside the grammar"
    return counts


def chi2(counts: Counter, digits: list[int], expected: list[float]) -> float:
    n = sum(counts.values())
    return sum((counts[t] - n * p) ** 2 / (n * p) for t, p in zip(digits, expected, strict=True))


@pytest.mark.parametrize(
    ("case", "share", "sparse"),
    [
        ("further draws from the first's CDF", 0.5, structured_sampling.SPARSE),
        ("a draw among the mask's ten tokens", 1e-9, structured_sampling.SPARSE),
        ("a second draw over the vocabulary under the mask", 1e-9, 0),
    ],
)
def test_a_sampled_row_draws_from_the_masked_distribution(
    setup, monkeypatch: pytest.MonkeyPatch, case: str, share: float, sparse: int
) -> None:
    grammars, _, digits = setup
    monkeypatch.setattr(structured_sampling, "SPARSE", sparse)
    calls: Counter = Counter()
    for name in ("_candidates", "_choose_among"):
        real = getattr(StructuredSampler, name)

        def spy(*a, _real=real, _name=name, **kw):  # type: ignore[no-untyped-def]
            out = _real(*a, **kw)
            calls[_name] += len(out)  # rows that chose this way
            return out

        monkeypatch.setattr(StructuredSampler, name, spy)
    counts = draws(setup, row(grammars.vocab_size, digits, share), SamplingParams(temperature=1.0))
    expected = [w / 55 for w in range(1, 11)]
    assert chi2(counts, digits, expected) < CHI2_9DOF_P001, (case, counts)
    draws_total = ROWS * ROUNDS
    if share == 0.5:  # about half rejected first, nearly all found among 8 more draws
        assert calls["_candidates"] > draws_total // 4 and calls["_choose_among"] < 20
    elif sparse:
        assert calls["_candidates"] == 0 and calls["_choose_among"] > draws_total * 0.99
    else:
        assert calls["_candidates"] == 0 and calls["_choose_among"] == 0


def test_a_hot_row_at_temperature_and_top_k(setup) -> None:
    """Temperature 0.5 squares the weights; top_k 3 (a filter: always the dense path,
    where the mask comes first) keeps the three most likely digits, 8, 9 and 10."""
    grammars, _, digits = setup
    logits = row(grammars.vocab_size, digits, 1e-3)
    counts = draws(setup, logits, SamplingParams(temperature=0.5))
    sq = [w * w for w in range(1, 11)]
    assert chi2(counts, digits, [w / sum(sq) for w in sq]) < CHI2_9DOF_P001, counts
    top3 = draws(setup, logits, SamplingParams(temperature=1.0, top_k=3))
    assert set(top3) == set(digits[7:]) and min(top3.values()) > 300, top3


@pytest.mark.parametrize("above", [3, 100_000])
def test_a_greedy_row_takes_the_most_likely_allowed_token(setup, above: int) -> None:
    """Three tokens more likely than the best digit: found among the next most likely;
    every other token more likely: from the mask."""
    grammars, _, digits = setup
    logits = row(grammars.vocab_size, digits, 0.5)
    hot = [t for t in range(grammars.vocab_size) if t not in digits][:above]
    logits[hot] = 1.0 + torch.arange(len(hot)) * 1e-4  # above every digit's, no ties
    counts = draws(setup, logits, SamplingParams(temperature=0))
    assert counts == Counter({digits[9]: ROWS * ROUNDS})


@pytest.mark.parametrize("share", [0.5, 1e-6])
def test_rows_masked_while_the_device_computes(
    setup, monkeypatch: pytest.MonkeyPatch, share: float
) -> None:
    """While the forward is still running (a GPU), the first rows' masks are computed and
    those rows sampled under them in the one pass; the rest choose as on the CPU. The
    rows of both kinds draw from the masked distribution."""
    grammars, _, digits = setup
    early: list[int] = []
    real = StructuredSampler._masks_while

    def spy(*a, **kw):  # type: ignore[no-untyped-def]
        out = real(*a, **kw)
        early.append(len(out))
        return out

    monkeypatch.setattr(StructuredSampler, "_masks_while", spy)
    counts = draws(
        setup,
        row(grammars.vocab_size, digits, share),
        SamplingParams(temperature=1.0),
        busy_rows=ROWS // 2,
    )
    assert early == [ROWS // 2] * ROUNDS
    assert chi2(counts, digits, [w / 55 for w in range(1, 11)]) < CHI2_9DOF_P001, counts
    every = draws(
        setup,
        row(grammars.vocab_size, digits, share),
        SamplingParams(temperature=0.7, top_p=0.9),
        busy_rows=ROWS,
    )
    w = [
        x ** (1 / 0.7) for x in range(1, 11)
    ]  # top_p 0.9 after the mask: drops the least likely digits
    keep = [i for i in range(10) if sum(w[i + 1 :]) / sum(w) < 0.9]
    expected = [w[i] / sum(w[k] for k in keep) if i in keep else 0 for i in range(10)]
    assert all(every[digits[i]] == 0 for i in range(10) if i not in keep), every
    kept = [digits[i] for i in keep]
    assert len(kept) == 7  # digits 4..10 (their mass before digit 3 is 0.93)
    assert chi2(every, kept, [expected[i] for i in keep]) < CHI2_6DOF_P001, every


def test_masks_unpack_alike_on_the_host_and_on_a_device(setup) -> None:
    """A GPU unpacks the packed words itself (structured.unpack); the CPU with numpy."""
    grammars, _, _ = setup
    masks = Masks(grammars)
    words = torch.randint(-(2**31), 2**31 - 1, (3, grammars.words), dtype=torch.int32).numpy()
    spare = 32 * grammars.words - grammars.vocab_size  # bits past the vocabulary: never set
    words[:, -1] &= np.int32((1 << (32 - spare)) - 1)
    host = masks.dense(words, torch.device("cpu"))
    assert torch.equal(unpack(torch.from_numpy(words), grammars.vocab_size), host)
    row, ids = Masks.pairs(words)
    assert torch.equal(host.nonzero(), torch.from_numpy(np.stack([row, ids], axis=1)))
    assert Masks.counts(words) == host.sum(dim=1).tolist()


def test_a_seeded_row_does_not_depend_on_the_devices_timing(setup) -> None:
    """A seeded row never takes a mask computed while the forward runs: its tokens are the
    same however long the device was busy."""
    grammars, sampler, digits = setup
    logits = row(grammars.vocab_size, digits, 0.2).repeat(ROWS, 1)
    got = []
    for busy_rows in (0, ROWS):
        requests = [
            Request(f"r{i}", [1], SamplingParams(temperature=1.0, seed=i), 0.0) for i in range(ROWS)
        ]
        gens = []
        for i, r in enumerate(requests):
            r.guide = grammars.guide(DIGIT)
            gens.append(torch.Generator().manual_seed(i))
        busy = iter([True] * busy_rows + [False] * ROWS).__next__ if busy_rows else None
        got.append(
            sampler.sample(logits.clone(), requests, gens, list(range(ROWS)), busy).token_ids
        )
    assert got[0] == got[1] and set(got[0]) <= set(digits)


def test_empty_masks_do_not_fail_the_step(setup, monkeypatch: pytest.MonkeyPatch) -> None:
    """Masks allowing nothing (grammars in error) do not fail the step: those rows get
    some token (which their grammars then refuse: the engine fails those requests alone)
    and an unconstrained row in the batch its own."""
    grammars, sampler, digits = setup
    monkeypatch.setattr(
        Masks, "compute", lambda self, guides: np.zeros((len(guides), grammars.words), np.int32)
    )
    logits = row(grammars.vocab_size, digits, 1e-9).repeat(5, 1)
    for temperature in (0.0, 1.0):
        requests = [
            Request(f"r{i}", [1], SamplingParams(temperature=temperature), 0.0) for i in range(5)
        ]
        for r in requests[:4]:
            r.guide = grammars.guide(DIGIT)
        tokens = sampler.sample(logits.clone(), requests, [None] * 5, list(range(4))).token_ids
        assert len(tokens) == 5 and tokens[4] not in digits, tokens
