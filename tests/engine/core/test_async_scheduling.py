"""Async scheduling on the CPU: the engine queues step N + 1 before it reads step N's
tokens (what it does on CUDA by default). Forced on here, where nothing overlaps, it must
give what reading every step gives: the same tokens, finish reasons, logprobs and freed
blocks, whatever the requests ask for."""

import random

import pytest

from service.config import Settings
from service.engine.core.engine import LLMEngine
from service.engine.request import PENDING, Constraint, Request, SamplingParams
from tests.engine.helpers import greedy
from tests.factories import make_engine, small_model

MODEL = small_model()


def workload(seed: int) -> dict[str, tuple[list[int], SamplingParams]]:
    """Greedy and sampled (seeded) requests, stop ids that end some early, logit bias,
    n > 1, penalties (which count the token not read yet), logprobs, prompts that share
    prefixes, lengths from one token to a few blocks."""
    rng = random.Random(seed)
    shared = [rng.randrange(300) for _ in range(12)]
    requests = {}
    for i in range(18):
        prompt = [rng.randrange(300) for _ in range(rng.randint(1, 30))]
        if i % 3 == 0:
            prompt = shared + prompt
        kind = i % 8
        if kind == 0:
            params = greedy(rng.randint(1, 30))
        elif kind == 1:  # stops at whatever the model draws first among these
            params = greedy(30, stop_token_ids=tuple(rng.sample(range(300), 150)))
        elif kind == 2:
            params = SamplingParams(
                max_tokens=rng.randint(5, 25), temperature=0.8, top_p=0.9, top_k=40,
                seed=seed * 100 + i, ignore_eos=True,
            )  # fmt: skip
        elif kind == 3:
            params = greedy(12, logit_bias=((7, 5.0), (8, -100.0)))
        elif kind == 4:
            params = SamplingParams(max_tokens=9, temperature=1.0, n=2, seed=i, ignore_eos=True)
        elif kind == 5:  # a greedy row that repeats itself unless its last token counts
            params = greedy(rng.randint(10, 30), frequency_penalty=2.0, presence_penalty=0.5)
        elif kind == 6:
            params = SamplingParams(
                max_tokens=rng.randint(5, 25), temperature=0.9, seed=seed * 100 + i,
                repetition_penalty=1.4, logprobs=3, ignore_eos=True,
            )  # fmt: skip
        else:
            params = greedy(rng.randint(3, 20), logprobs=0)
        requests[f"r{i}"] = (prompt, params)
    return requests


def run(engine: LLMEngine, requests: dict) -> tuple[dict, int]:
    """Every sequence's (tokens, finish reason, logprobs) and how many steps ended with
    a step in flight."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    got: dict[str, tuple[list[int], str | None, list]] = {}
    chained = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens, _, lps = got.get(out.request_id, ([], None, []))
            reason = out.finish_reason.value if out.finish_reason else None
            got[out.request_id] = (tokens + out.token_ids, reason, lps + list(out.logprobs))
        chained += engine.in_flight is not None
    assert engine.blocks.num_used == 0  # nothing leaked
    assert not engine.requests
    return got, chained


def same_outputs(a: dict, b: dict) -> bool:
    """The same tokens, finish reasons, logprob ids, and logprobs to float32's last bits
    (a step of another size can round a logit differently: async scheduling computes a
    token in vain for a request that stopped on a token not read yet)."""
    assert a.keys() == b.keys()
    for rid in a:
        (tokens, reason, lps), (tokens_b, reason_b, lps_b) = a[rid], b[rid]
        assert (tokens, reason) == (tokens_b, reason_b), rid
        assert len(lps) == len(lps_b), rid
        for x, y in zip(lps, lps_b, strict=True):
            assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-5)
            assert [t for t, _ in x.top] == [t for t, _ in y.top], rid
            assert [v for _, v in x.top] == pytest.approx([v for _, v in y.top], abs=1e-5)
    return True


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("pool", [256, 48])  # 48 blocks of 4: preemptions
def test_async_gives_every_steps_outputs(seed: int, pool: int) -> None:
    outputs = {}
    for mode in ("off", "on"):
        engine = make_engine(MODEL, num_kv_blocks=pool, async_scheduling=mode)
        outputs[mode], chained = run(engine, workload(seed))
        assert (chained > 0) == (mode == "on")
        if pool == 48:
            assert engine.stats.preemptions > 0
    assert same_outputs(outputs["on"], outputs["off"])
    reasons = {reason for _, reason, _ in outputs["on"].values()}
    assert reasons == {"stop", "length"}  # both ends happened


def test_penalties_and_logprobs_keep_the_steps_chained() -> None:
    """Penalties count the token still on the device and logprobs come back with the ids:
    requests with them do not make the engine read each step."""
    requests = {
        f"r{i}": ([i, i + 1, i + 2], greedy(20, frequency_penalty=1.0, logprobs=2))
        for i in range(4)
    }
    engine = make_engine(MODEL, async_scheduling="on")
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    steps = chained = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        chained += engine.in_flight is not None
    assert chained == steps - 1  # every step but the last left one in flight


def test_grammars_are_read_each_step() -> None:
    """A grammar's mask for the next step needs this step's token on the host: while a
    constrained request runs no step stays in flight, and the engine chains again once it
    is gone."""
    grammar = SamplingParams(
        max_tokens=12,
        temperature=1.0,
        seed=3,
        constraint=Constraint("regex", "[0-9]{4,9}", "regex"),
    )
    assert grammar.reads_each_step
    requests = workload(2) | {"g": ([1, 2, 3], grammar)}
    off, _ = run(make_engine(MODEL, async_scheduling="off"), dict(requests))
    engine = make_engine(MODEL, async_scheduling="on")
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    got: dict[str, list[int]] = {}
    chained_after = 0
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
        if "g" in engine.requests:
            assert engine.in_flight is None
        else:
            chained_after += engine.in_flight is not None
    assert chained_after > 0
    assert got == {rid: tokens for rid, (tokens, _, _) in off.items()}


def test_abort_while_a_step_is_in_flight() -> None:
    """An aborted request's queued step is computed and dropped: no token of it comes out
    after the abort's final output, its blocks come back, the others are unchanged."""
    requests = {"a": (list(range(30)), greedy(40)), "b": (list(range(40, 60)), greedy(40))}
    off, _ = run(make_engine(MODEL, async_scheduling="off"), requests)
    engine = make_engine(MODEL, async_scheduling="on")
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    got: dict[str, list[int]] = {"a": [], "b": []}
    for _ in range(6):
        for out in engine.step():
            got[out.request_id].extend(out.token_ids)
    assert engine.in_flight is not None
    assert any(s.request.request_id == "a" for s in engine.in_flight.batch.seqs)
    final = engine.abort("a")
    assert final is not None and final.finish_reason.value == "abort"
    got["a"].extend(final.token_ids)
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == "b"
            got["b"].extend(out.token_ids)
    assert got["b"] == off["b"][0]
    assert got["a"] == off["a"][0][: len(got["a"])]
    assert engine.blocks.num_used == 0 and not engine.requests
    engine.abort("b")  # finished already: nothing in flight keeps the engine busy
    assert not engine.has_unfinished()


def test_pending_tokens_read_as_placeholders() -> None:
    r = Request("x", [1, 2, 3], greedy(5), 0.0, output_ids=[4], num_pending=1)
    assert r.num_tokens == 5 and r.num_known == 4 and r.num_generated == 2
    assert r.tokens(0, 5) == [1, 2, 3, 4, PENDING]
    assert r.tokens(4, 5) == [PENDING] and r.tokens(2, 4) == [3, 4]
    assert not r.last_is_pending
    r.output_ids += [5, 6, 7]
    assert r.last_is_pending  # 4 read + 1 pending = max_tokens: nothing to schedule after


def test_async_scheduling_setting() -> None:
    assert Settings().engine.async_steps("cuda") and not Settings().engine.async_steps("cpu")
    assert Settings(async_scheduling="on").engine.async_steps("cpu")
    assert not Settings(async_scheduling="off").engine.async_steps("cuda")
    assert not Settings(speculative_method="ngram").engine.async_steps("cuda")  # auto: off
    with pytest.raises(ValueError, match="async_scheduling"):
        Settings(async_scheduling="on", speculative_method="ngram")
    with pytest.raises(ValueError, match="async_scheduling must be one of"):
        Settings(async_scheduling="yes")
    engine = make_engine(MODEL, speculative_method="ngram")
    assert not engine.async_scheduling
