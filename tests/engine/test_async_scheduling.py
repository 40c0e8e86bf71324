"""Async scheduling on the CPU: the engine queues step N + 1 before it reads step N's
tokens (what it does on CUDA by default). Forced on here, where nothing overlaps, it must
give what reading every step gives: the same tokens, finish reasons, logprobs and freed
blocks, whatever the requests ask for."""

import random

import pytest

from service.config import Settings
from service.engine.engine import LLMEngine
from service.engine.request import PENDING, Request, SamplingParams
from tests.engine.helpers import greedy, make_engine, small_model

MODEL = small_model()


def workload(seed: int) -> dict[str, tuple[list[int], SamplingParams]]:
    """Greedy and sampled (seeded) requests, stop ids that end some early, logit bias,
    n > 1, prompts that share prefixes, lengths from one token to a few blocks."""
    rng = random.Random(seed)
    shared = [rng.randrange(300) for _ in range(12)]
    requests = {}
    for i in range(14):
        prompt = [rng.randrange(300) for _ in range(rng.randint(1, 30))]
        if i % 3 == 0:
            prompt = shared + prompt
        kind = i % 5
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
        else:
            params = SamplingParams(max_tokens=9, temperature=1.0, n=2, seed=i, ignore_eos=True)
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
    assert not engine.requests and not engine.texts
    return got, chained


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
    assert outputs["on"] == outputs["off"]
    reasons = {reason for _, reason, _ in outputs["on"].values()}
    assert reasons == {"stop", "length"}  # both ends happened


def test_requests_that_need_each_steps_tokens_are_read_each_step() -> None:
    """Penalties (which read the output on the host), logprobs and grammars need the
    tokens before the next step: while such a request runs no step stays in flight,
    and the engine chains again once it is gone."""
    reads = {
        "p": ([1, 2, 3], greedy(20, presence_penalty=1.5, repetition_penalty=1.3)),
        "l": ([4, 5, 6], greedy(8, logprobs=3)),
    }
    assert all(params.reads_each_step for _, params in reads.values())
    requests = workload(2) | reads
    off, _ = run(make_engine(MODEL, async_scheduling="off"), dict(requests))
    engine = make_engine(MODEL, async_scheduling="on")
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    got: dict[str, list[int]] = {}
    chained_after = 0
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
        if {"p", "l"} & engine.requests.keys():
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
    assert Settings().async_steps("cuda") and not Settings().async_steps("cpu")
    assert Settings(async_scheduling="on").async_steps("cpu")
    assert not Settings(async_scheduling="off").async_steps("cuda")
    assert not Settings(speculative_method="ngram").async_steps("cuda")  # auto: off
    with pytest.raises(ValueError, match="async_scheduling"):
        Settings(async_scheduling="on", speculative_method="ngram")
    with pytest.raises(ValueError, match="async_scheduling must be one of"):
        Settings(async_scheduling="yes")
    engine = make_engine(MODEL, speculative_method="ngram")
    assert not engine.async_scheduling
