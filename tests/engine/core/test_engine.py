"""The engine end to end on small random models (CPU)."""

import random
from collections.abc import Callable

import pytest
import torch

from service.engine.batch import SchedulerOutput
from service.engine.core.checks import ContextLengthError
from service.engine.core.engine import LLMEngine
from service.engine.request import ParamError, SamplingParams
from tests.engine.helpers import greedy, run_all, tokens_of
from tests.factories import make_engine, small_model
from tests.model.backends import generate_auto

MODEL = small_model()
# the engine reading each step's tokens before the next is scheduled, and queueing the next
# first (async scheduling, which CUDA runs by default): the same outputs
ASYNC = pytest.mark.parametrize("async_scheduling", ["off", "on"])


def mixed_requests(n: int, seed: int = 0) -> dict[str, tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    return {
        f"r{i}": (
            [rng.randrange(300) for _ in range(rng.randint(1, 70))],
            greedy(rng.randint(1, 40)),
        )
        for i in range(n)
    }


def alone(requests: dict) -> dict[str, list[int]]:
    return {
        rid: generate_auto(MODEL, p, params.max_tokens) for rid, (p, params) in requests.items()
    }


def stepped(engine: LLMEngine, on_batch: Callable[[SchedulerOutput], None]) -> dict[str, list[int]]:
    """Step the engine until it is done, calling on_batch with each batch as it is
    scheduled (before it runs); every request's tokens."""
    schedule = engine.scheduler.schedule

    def recorded() -> SchedulerOutput:
        batch = schedule()
        on_batch(batch)
        return batch

    engine.scheduler.schedule = recorded  # type: ignore[method-assign]
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.token_ids)
    return outputs


@ASYNC
def test_sixteen_mixed_requests_batched_equal_each_alone(async_scheduling: str) -> None:
    requests = mixed_requests(16)
    engine = make_engine(MODEL, async_scheduling=async_scheduling)
    steps = []
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outputs = stepped(
        engine, lambda batch: steps.append([(s.request.in_prefill, s.num_new) for s in batch.seqs])
    )
    assert outputs == alone(requests)
    # budgets held, and prefill chunks were mixed with decodes in the same step
    assert all(sum(n for _, n in s) <= 64 and len(s) <= 16 for s in steps)
    assert any(any(p for p, _ in s) and any(not p for p, _ in s) for s in steps)
    assert engine.blocks.num_used == 0


@ASYNC
def test_steps_with_decodes_cap_their_prompt_tokens(async_scheduling: str) -> None:
    """With mixed_prefill_tokens, a step that carries decodes computes at most that many
    prompt tokens (new prompts and mid-prompt chunks alike); a step without decodes still
    fills the whole budget; the tokens are those of each request alone."""
    requests = mixed_requests(16, seed=2)
    engine = make_engine(MODEL, mixed_prefill_tokens=8, async_scheduling=async_scheduling)
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    counts = {"mixed": 0, "prefill_only": 0}

    def check(batch: SchedulerOutput) -> None:
        decodes = [s for s in batch.seqs if not s.request.in_prefill and s.num_new == 1]
        chunks = sum(s.num_new for s in batch.seqs if s.num_new > 1)
        assert batch.num_tokens <= 64
        if decodes:
            assert chunks <= 8, [(s.request.request_id, s.num_new) for s in batch.seqs]
            counts["mixed"] += bool(chunks)
        elif chunks > 8:
            counts["prefill_only"] += 1

    outputs = stepped(engine, check)
    mixed, prefill_only = counts["mixed"], counts["prefill_only"]
    assert mixed and prefill_only  # both kinds of step happened
    assert outputs == alone(requests)
    assert engine.blocks.num_used == 0
    with pytest.raises(ValueError, match="mixed_prefill_tokens"):
        make_engine(
            MODEL, mixed_prefill_tokens=-1, async_scheduling=async_scheduling
        )  # 0 is no cap


@ASYNC
def test_small_pool_preempts_and_outputs_are_unchanged(async_scheduling: str) -> None:
    requests = mixed_requests(16, seed=1)
    engine = make_engine(MODEL, num_kv_blocks=40, async_scheduling=async_scheduling)
    outputs = run_all(engine, requests)
    assert engine.stats.preemptions > 0
    assert {rid: tokens_of(o) for rid, o in outputs.items()} == alone(requests)
    assert engine.blocks.num_used == 0


@ASYNC
def test_shared_prefix_is_computed_once(async_scheduling: str) -> None:
    prefix = list(range(10, 18))  # two blocks of 4
    a, b = [*prefix, 1, 2, 3], [*prefix, 4, 5]
    engine = make_engine(MODEL, async_scheduling=async_scheduling)
    first = run_all(engine, {"a": (a, greedy(6))})
    assert engine.stats.prefix_hit_tokens == 0
    second = run_all(engine, {"b": (b, greedy(6))})
    assert engine.stats.prefix_hit_tokens == 8
    assert second["b"][-1].num_cached_tokens == 8
    cold = make_engine(MODEL, disable_prefix_caching=True, async_scheduling=async_scheduling)
    ref = run_all(cold, {"a": (a, greedy(6)), "b": (b, greedy(6))})
    assert tokens_of(first["a"]) == tokens_of(ref["a"])
    assert tokens_of(second["b"]) == tokens_of(ref["b"])


@ASYNC
def test_seeded_sampling_is_the_same_alone_and_in_a_busy_batch(async_scheduling: str) -> None:
    params = SamplingParams(
        max_tokens=20, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True
    )
    prompt = [5, 6, 7, 8, 9]
    solo = tokens_of(
        run_all(make_engine(MODEL, async_scheduling=async_scheduling), {"s": (prompt, params)})["s"]
    )
    busy_requests = mixed_requests(10, seed=3)
    busy_requests["s"] = (prompt, params)
    busy_requests |= {
        f"x{i}": ([1, 2, 3], SamplingParams(max_tokens=15, temperature=1.0)) for i in range(5)
    }
    busy = run_all(
        make_engine(MODEL, num_kv_blocks=60, async_scheduling=async_scheduling), busy_requests
    )
    assert tokens_of(busy["s"]) == solo
    other_seed = SamplingParams(max_tokens=20, temperature=0.9, seed=99, ignore_eos=True)
    assert (
        tokens_of(
            run_all(
                make_engine(MODEL, async_scheduling=async_scheduling), {"s": (prompt, other_seed)}
            )["s"]
        )
        != solo
    )


def test_logprobs_equal_log_softmax_of_a_full_forward() -> None:
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    out = run_all(make_engine(MODEL), {"l": (prompt, greedy(6, logprobs=5))})["l"]
    generated = tokens_of(out)
    with torch.no_grad():
        full = torch.log_softmax(MODEL(torch.tensor(prompt + generated)), dim=-1)
    lps = [lp for o in out for lp in o.logprobs]
    assert len(lps) == 6
    for i, lp in enumerate(lps):
        row = full[len(prompt) - 1 + i]
        assert abs(lp.logprob - row[lp.token_id].item()) < 1e-4
        values, ids = row.topk(5)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert all(abs(a - b) < 1e-4 for (_, a), b in zip(lp.top, values.tolist()))


@ASYNC
def test_stop_string_across_token_boundary(async_scheduling: str) -> None:
    model = small_model(vocab=100277, d_model=32)
    engine = make_engine(model, async_scheduling=async_scheduling)
    prompt = [791, 4062, 14198, 39935]
    free_run = run_all(engine, {"f": (prompt, greedy(30))})["f"]
    tokens = tokens_of(free_run)
    tok = engine.tokenizer
    pieces = [tok.decode([t]) for t in tokens]
    full_text = "".join(o.text for o in free_run)
    # a stop string made of the end of one token and the start of the next
    k = next(
        i
        for i in range(3, len(pieces) - 1)
        if len(pieces[i]) >= 2
        and len(pieces[i + 1]) >= 2
        and "\ufffd" not in pieces[i] + pieces[i + 1]
    )
    stop = pieces[k][-2:] + pieces[k + 1][:2]
    expected = full_text[: full_text.find(stop)]
    out = run_all(engine, {"s": (prompt, greedy(30, stop=(stop,)))})["s"]
    assert "".join(o.text for o in out) == expected
    assert out[-1].finish_reason.value == "stop"
    assert engine.blocks.num_used == 0


@ASYNC
def test_abort_mid_generation_returns_every_block(async_scheduling: str) -> None:
    engine = make_engine(MODEL, async_scheduling=async_scheduling)
    idle = engine.blocks.num_used
    engine.add_request("a", list(range(30)), greedy(50))
    engine.add_request("b", list(range(40, 60)), greedy(50))
    for _ in range(5):
        engine.step()
    assert engine.blocks.num_used > idle
    out = engine.abort("a")
    assert out is not None and out.finished and out.finish_reason.value == "abort"
    engine.abort("b")
    assert engine.blocks.num_used == idle and not engine.has_unfinished()
    assert engine.requests == {}


@ASYNC
def test_n_siblings_share_prompt_blocks(async_scheduling: str) -> None:
    engine = make_engine(MODEL, async_scheduling=async_scheduling)
    prompt = list(range(1, 22))  # 5 full blocks of 4
    params = SamplingParams(max_tokens=8, temperature=1.0, n=3, seed=7, ignore_eos=True)
    ids = engine.add_request("n", prompt, params)
    assert ids == ["n.0", "n.1", "n.2"]
    outputs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outputs.setdefault(o.index, []).extend(o.token_ids)
    assert sorted(outputs) == [0, 1, 2] and all(len(v) == 8 for v in outputs.values())
    assert engine.stats.prefix_hit_tokens == 2 * 20  # two siblings reuse the 5 full blocks
    assert len({tuple(v) for v in outputs.values()}) > 1


def test_stop_eos_max_tokens_and_penalties() -> None:
    engine = make_engine(MODEL)
    free = tokens_of(run_all(engine, {"f": ([1, 2, 3], greedy(10))})["f"])
    out = run_all(engine, {"t": ([1, 2, 3], greedy(10, stop_token_ids=(free[3],)))})["t"]
    assert (
        tokens_of(out) == free[: free.index(free[3]) + 1] and out[-1].finish_reason.value == "stop"
    )
    # logit_bias forces a token; a strong presence penalty forbids repeats
    forced = run_all(engine, {"b": ([1, 2, 3], greedy(5, logit_bias=((42, 100.0),)))})["b"]
    assert tokens_of(forced) == [42] * 5
    params = SamplingParams(
        max_tokens=5, temperature=0, presence_penalty=2.0, logit_bias=((42, 3.0),), ignore_eos=True
    )
    varied = tokens_of(run_all(engine, {"p": ([1, 2, 3], params)})["p"])
    assert varied.count(42) <= 1
    # top_k=1 sampling is greedy
    topk1 = SamplingParams(max_tokens=10, temperature=1.5, top_k=1, ignore_eos=True)
    assert tokens_of(run_all(engine, {"k": ([1, 2, 3], topk1)})["k"]) == free
    assert run_all(engine, {"m": ([1, 2, 3], greedy(4))})["m"][-1].finish_reason.value == "length"


def test_validation_names_the_parameter() -> None:
    engine = make_engine(MODEL)
    with pytest.raises(ContextLengthError, match="maximum context length is 512"):
        engine.add_request("c", [1] * 500, greedy(20))
    with pytest.raises(ParamError, match="outside the vocabulary"):
        engine.add_request("v", [1, 300], greedy(2))
    with pytest.raises(ParamError, match="prompt"):
        engine.add_request("e", [], greedy(2))
    with pytest.raises(ParamError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ParamError, match="top_p"):
        SamplingParams(top_p=0)
    small = make_engine(MODEL, num_kv_blocks=4)
    with pytest.raises(ContextLengthError, match="KV cache capacity of 16 tokens"):
        small.add_request("k", [1] * 10, greedy(10))


@pytest.mark.parametrize("block_size", [4, 16])  # 16 with head size 32: AMX where the CPU has it
def test_bf16_batched_chunked_and_preempted_equal_each_alone(block_size: int) -> None:
    """In bf16 (packed weights, C attention kernel) a request's tokens do not depend on
    what it is batched with, how its prompt is chunked, or whether it was preempted and
    recomputed: every row is computed the same way (tile linears, one attention kernel)."""
    model = small_model(vocab=320, d_model=128, d_ff=128).to(torch.bfloat16)
    requests = mixed_requests(12, seed=5)
    solo = make_engine(model, block_size=block_size)
    assert solo.runner.packed == (model.device.type == "cpu")
    alone = {rid: tokens_of(run_all(solo, {rid: spec})[rid]) for rid, spec in requests.items()}
    batched = run_all(make_engine(model, block_size=block_size), requests)
    assert {rid: tokens_of(out) for rid, out in batched.items()} == alone
    tight = make_engine(model, block_size=block_size, num_kv_blocks=160 // block_size)
    preempted = run_all(tight, requests)
    assert tight.stats.preemptions > 0
    assert {rid: tokens_of(out) for rid, out in preempted.items()} == alone


def test_sampled_id_the_tokenizer_does_not_define() -> None:
    """cl100k leaves ids below its vocabulary size unassigned; a model that samples one
    gets no text for it, and the engine carries on."""
    model = small_model(vocab=100277, d_model=32)
    engine = make_engine(model)
    params = greedy(4, logit_bias=((100256, 100.0),))
    out = run_all(engine, {"u": ([791, 4062], params)})["u"]
    assert tokens_of(out) == [100256] * 4 and "".join(o.text for o in out) == ""
    assert out[-1].finish_reason.value == "length"
    assert tokens_of(run_all(engine, {"v": ([791], greedy(3))})["v"])  # still serving


@ASYNC
def test_non_finite_logits_fail_that_request_alone(async_scheduling: str) -> None:
    """A NaN in the model's path for one request fails it with an error; the others in
    the same batch get exactly their clean outputs, and its blocks leave nothing behind.
    (Untied head: a NaN embedding row then touches only sequences containing that token.)"""
    model = small_model(tie_embeddings=False)
    requests = {k: v for k, v in mixed_requests(8, seed=7).items() if 13 not in v[0]}
    clean = {
        rid: generate_auto(model, p, params.max_tokens) for rid, (p, params) in requests.items()
    }
    with torch.no_grad():
        model.embed.weight[13] = float("nan")
    requests["bad"] = ([5, 13, 7, 9] * 5, greedy(10))
    engine = make_engine(model, async_scheduling=async_scheduling)
    outputs = run_all(engine, requests)
    bad = outputs["bad"][-1]
    assert bad.finished and bad.finish_reason.value == "error" and "non-finite" in bad.error
    assert {rid: tokens_of(outputs[rid]) for rid in clean} == clean
    assert engine.blocks.num_used == 0
    assert torch.isfinite(engine.kv_cache.data).all()  # its blocks were cleared
    assert engine.stats.finished["error"] == 1
    # and the engine serves the clean prompts again, identically
    again = run_all(
        engine, {rid + "-again": spec for rid, spec in requests.items() if rid != "bad"}
    )
    assert {rid.removesuffix("-again"): tokens_of(o) for rid, o in again.items()} == clean
