"""Speculative decoding (service/engine/exec/speculative.py): n-gram and draft-model proposals
give the non-speculative greedy tokens on every backend, keep the target distribution
when sampling (a probability-integral-transform test on a vocabulary of 8), stop where
the plain engine stops, and leave no block behind."""

import random

import numpy as np
import pytest
import torch

from model.config import ModelConfig
from model.demo import init_weights
from model.transformer import Transformer
from model.weights import load_model
from service.config import Settings
from service.engine.core.engine import LLMEngine
from service.engine.exec.speculative import Speculator, ngram_drafts
from service.engine.request import Request, SamplingParams
from tests.engine.helpers import greedy, run_all, tokens_of
from tests.factories import make_engine, write_gemma2, write_gemma3, write_qwen3
from tests.model.backends import BACKENDS, block_size_for, make_backend


def model(seed: int = 0, std: float = 0.3, vocab: int = 300, layers: int = 2) -> Transformer:
    cfg = ModelConfig(
        vocab_size=vocab,
        d_model=32,
        n_layers=layers,
        n_heads=4,
        n_kv_heads=2,
        d_ff=48,
        max_position=512,
    )
    m = Transformer(cfg)
    init_weights(m, seed, std=std)  # std 0.3: varied greedy output that also repeats itself
    return m.eval()


TARGET = model()
DRAFTS = {"self": TARGET, "other": model(seed=1, layers=1)}


def engine(target: Transformer = TARGET, draft: Transformer | None = None, **kw) -> LLMEngine:
    """block_size 4, 256 blocks, 16 sequences, 64 tokens a step; always speculating,
    whatever the clock says (the measured rule has its own test below)."""
    if draft is not None:
        kw = dict(speculative_method="draft", speculative_model="in-memory") | kw
    return make_engine(target, draft, speculative_min_speedup=0, **kw)


def copy_requests(n: int = 4, max_tokens: int = 40, **kw) -> dict:
    """Prompts that repeat a span (what the n-gram lookup finds), cut at different places."""
    rng = random.Random(1)
    span = [rng.randrange(300) for _ in range(12)]
    return {
        f"r{i}": (
            [rng.randrange(300) for _ in range(5)] + span * 3 + span[: 3 + i],
            greedy(max_tokens, **kw),
        )
        for i in range(n)
    }


def outputs(e: LLMEngine, requests: dict) -> dict[str, list[int]]:
    got = {rid: tokens_of(outs) for rid, outs in run_all(e, requests).items()}
    assert e.blocks.num_used == 0
    return got


def test_ngram_drafts_continue_the_latest_longest_match() -> None:
    assert ngram_drafts([5, 6, 7, 8, 9, 1, 5, 6, 7], 3) == [8, 9, 1]
    # the latest occurrence wins; the 4-gram before a shorter one
    assert ngram_drafts([1, 2, 3, 4, 0, 2, 3, 5, 0, 2, 3], 2) == [5, 0]
    assert ngram_drafts([9, 2, 3, 4, 8, 1, 2, 3, 4, 7, 2, 3, 4], 1) == [7]
    # a span of period 2 continues into the drafts themselves
    assert ngram_drafts([4, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]
    assert ngram_drafts([1, 2, 3, 4], 4) == []  # nothing repeats
    assert ngram_drafts([1, 2, 3, 1], 4) == []  # one token is not a match (NGRAM_MIN 2)
    assert ngram_drafts([7], 4) == []


METHODS = ["ngram", "draft-self", "draft-other"]
CASES = [(b, m) for b in BACKENDS for m in METHODS if (b, m) != ("triton", "draft-other")]


@pytest.mark.parametrize("name,method", CASES)
def test_greedy_tokens_are_the_plain_engines_on_every_backend(name: str, method: str) -> None:
    """Drafts accepted in part (n-gram), all (the model drafting for itself) and almost
    never (another model): the same tokens as without speculation, on every backend
    (Triton's interpreter takes seconds a step: two short requests, and the draft model
    that is rarely right only on the others)."""
    make_backend(name, TARGET.cfg)  # skips, or fails where required, if it cannot run
    bs = block_size_for(name, 4)
    n, max_tokens = (2, 12) if name == "triton" else (4, 40)
    requests = copy_requests(n, max_tokens)
    want = outputs(engine(block_size=bs, attention_backend=name), requests)
    kw = dict(block_size=bs, attention_backend=name)
    if method == "ngram":
        e = engine(speculative_method="ngram", **kw)
    else:
        e = engine(draft=DRAFTS[method.removeprefix("draft-")], **kw)
    assert outputs(e, requests) == want
    drafted, accepted = e.stats.spec_draft_tokens, e.stats.spec_accepted_tokens
    assert drafted > 0 and e.snapshot().spec_draft_tokens == drafted
    if method == "draft-self":
        assert accepted == drafted
    elif method == "ngram":
        assert 0 < accepted < drafted
    else:
        assert accepted < drafted / 2


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_seeded_sampling_gives_the_plain_engines_tokens(method: str) -> None:
    """A seeded draw depends on the seed and the output position alone, so a seeded
    sampled request gets the same tokens with speculation as without it."""
    target = model(vocab=8)  # a vocabulary of 8: drafts are often drawn
    base = [1, 2, 3, 4, 5, 6]
    requests = {
        f"s{i}": (
            base * 3,
            SamplingParams(max_tokens=24, temperature=0.8, seed=i, top_p=0.95, ignore_eos=True),
        )
        for i in range(8)
    }
    want = outputs(engine(target), requests)
    e = engine(
        target,
        target if method == "draft" else None,
        speculative_method=method,
        speculative_max_batch=8,
    )
    assert outputs(e, requests) == want
    assert e.stats.spec_accepted_tokens > 0


def test_bf16_kernels_give_the_plain_tokens() -> None:
    """bf16 on the cpu backend runs kvserve's C linears and stack: the rows a sequence's
    drafts add to a step must not change its own row's bits."""
    bf16 = model().to(torch.bfloat16)
    requests = copy_requests()
    want = outputs(engine(bf16), requests)
    e = engine(bf16, speculative_method="ngram")
    assert outputs(e, requests) == want
    assert e.stats.spec_accepted_tokens > 0


@pytest.mark.parametrize("quantization", ["none", "int8"])
@pytest.mark.parametrize("family", ["qwen3", "gemma3", "gemma2"])
def test_families_speculate_in_bf16_and_int8(family: str, quantization: str, tmp_path) -> None:
    """Qwen3 (q/k norms), Gemma 3 (windowed layers with a RoPE base of their own,
    sandwich norms, GeGLU) and Gemma 2 (soft-capped scores) in bf16 and with int8
    weights: the n-gram path's greedy tokens are the plain engine's. Gemma's windows (8)
    are far shorter than the requests: the windowed layers attend in the C kernel, whose
    bits do not depend on the batch, soft-capped or not."""
    if family == "qwen3":
        write_qwen3(tmp_path)
    elif family == "gemma3":
        write_gemma3(tmp_path, sliding_window=8)
    else:
        write_gemma2(tmp_path)
    target = load_model(tmp_path, torch.bfloat16)
    kw = dict(quantization=quantization)
    requests = copy_requests()
    want = outputs(engine(target, **kw), requests)
    e = engine(target, speculative_method="ngram", **kw)
    assert outputs(e, requests) == want
    assert e.stats.spec_accepted_tokens > 0


def test_stops_max_tokens_logprobs_and_preemption_are_the_plain_engines() -> None:
    requests = copy_requests(4, 30)
    plain = outputs(engine(), requests)
    stop = plain["r1"][9]  # a stop token met inside a step's accepted drafts, or not
    requests = copy_requests(4, 30, logprobs=2) | {
        "s": (requests["r1"][0], greedy(30, stop_token_ids=(stop,)))
    }
    want = run_all(engine(), requests)
    # 20 blocks of 4 tokens: the four requests preempt one another
    for e in (
        engine(speculative_method="ngram"),
        engine(speculative_method="ngram", num_kv_blocks=40),
    ):
        got = run_all(e, requests)
        assert {r: tokens_of(o) for r, o in got.items()} == {
            r: tokens_of(o) for r, o in want.items()
        }
        assert e.blocks.num_used == 0 and e.stats.spec_accepted_tokens > 0
        for rid in requests:
            assert got[rid][-1].finish_reason == want[rid][-1].finish_reason
            mine = [lp for o in got[rid] for lp in o.logprobs]
            theirs = [lp for o in want[rid] for lp in o.logprobs]
            assert [lp.token_id for lp in mine] == [lp.token_id for lp in theirs]
            assert np.allclose(
                [lp.logprob for lp in mine], [lp.logprob for lp in theirs], atol=1e-5
            )
    assert len(tokens_of(got["s"])) == plain["r1"].index(stop) + 1
    assert all(len(tokens_of(got[f"r{i}"])) == 30 for i in range(4))


def test_prefix_cache_keeps_only_accepted_tokens() -> None:
    """A request whose prompt is an earlier speculative request's prompt and output reuses
    its blocks, and those hold the accepted tokens' K/V: the same greedy tokens as an
    engine without a prefix cache."""
    ((prompt, params),) = copy_requests(1, 40).values()
    e = engine(speculative_method="ngram")
    first = outputs(e, {"a": (prompt, params)})["a"]
    follow = {"b": (prompt + first[:33], greedy(12))}
    got = outputs(e, follow)
    assert e.stats.prefix_hit_tokens >= 64
    assert got == outputs(engine(disable_prefix_caching=True), follow)


def test_speculation_turns_off_above_its_batch_size() -> None:
    requests = copy_requests(4, 20)  # one step prefills all four; they decode together
    e = engine(speculative_method="ngram", speculative_max_batch=3, max_num_batched_tokens=256)
    assert outputs(e, requests) == outputs(engine(), requests)
    assert e.stats.spec_draft_tokens == 0
    e = engine(speculative_method="ngram", speculative_max_batch=4, max_num_batched_tokens=256)
    outputs(e, requests)
    assert e.stats.spec_draft_tokens > 0


@pytest.mark.parametrize("drafted_rate,want", [(60.0, [1, 15, 31]), (250.0, None)])
def test_speculation_follows_what_it_measures(drafted_rate: float, want: list | None) -> None:
    """A first step without drafts (the baseline, 100 tok/s here), then with; slower with
    drafts: only a probe every 16th step; faster: drafts but for one plain step in 16."""
    spec = Speculator(Settings(speculative_method="ngram"), 512, None)
    r = Request("a", [1, 2, 3, 1, 2], greedy(50), 0.0)
    r.num_computed = 4  # decoding
    steps = []
    for _ in range(40):
        spec.propose([r])
        drafted = bool(r.draft_ids)
        steps.append(drafted)
        rate = drafted_rate if drafted else 100.0
        spec.observe(drafted, tokens=3, seqs=1, seconds=3 / rate)
    drafted_at = [i for i, d in enumerate(steps) if d]
    if want is not None:
        assert drafted_at == want
    else:
        assert [i for i, d in enumerate(steps) if not d] == [0, 15, 31]


def test_constrained_and_penalised_requests_do_not_speculate() -> None:
    ((prompt, _),) = copy_requests(1).values()
    e = engine(speculative_method="ngram")
    outputs(e, {"p": (prompt, greedy(30, presence_penalty=0.5))})
    assert e.stats.spec_draft_tokens == 0


def _conditional(target: Transformer, context: list[int], temp: float, top_k: int) -> np.ndarray:
    """The next token's distribution as the sampler draws it (temperature, then top_k)."""
    with torch.inference_mode():
        logits = target(torch.tensor(context)).float()[-1] / temp
    if top_k:
        logits = logits.masked_fill(logits < logits.topk(top_k).values[-1], float("-inf"))
    return torch.softmax(logits, dim=-1).double().numpy()


def _joint(target: Transformer, prompt: list[int], length: int, temp: float, top_k: int) -> dict:
    """The exact probability of every output of `length` tokens (vocabulary 8: 8^length)."""
    joint = {(): 1.0}
    for _ in range(length):
        joint = {
            (*seq, t): p * q
            for seq, p in joint.items()
            for t, q in enumerate(_conditional(target, prompt + list(seq), temp, top_k))
        }
    return joint


def _chi_square(counts: dict, joint: dict, n: int) -> tuple[float, float]:
    """Pearson's statistic of the observed outputs against the exact joint (outputs
    expected fewer than 5 times pooled into one cell) and its 0.1% critical value
    (Wilson-Hilferty)."""
    cells = [(counts.get(seq, 0), p * n) for seq, p in joint.items() if p * n >= 5]
    rest = n - sum(o for o, _ in cells), n - sum(e for _, e in cells)
    cells.append(rest)
    stat = sum((o - e) ** 2 / e for o, e in cells if e > 0)
    df = len(cells) - 1
    return stat, df * (1 - 2 / (9 * df) + 3.09 * np.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("temp,top_k", [(1.0, 0), (0.7, 4)])
def test_sampled_output_keeps_the_target_distribution(method: str, temp: float, top_k: int) -> None:
    """2,000 seeded requests of 4 tokens on a vocabulary of 8 (the most likely token at
    0.4-0.9): the outputs' frequencies fit the exact joint distribution of the 4,096
    possible outputs (chi-square at 0.1%), while over 5% of the tokens were accepted
    drafts. The draft model is the target itself: its greedy proposal is kept at the
    rate p(argmax); the prompt repeats its start after the greedy continuation of it,
    which n-grams propose."""
    target = model(vocab=8)
    draft = target if method == "draft" else None
    e = engine(target, draft, max_num_seqs=64, speculative_max_batch=64, speculative_method=method)
    base = [1, 2, 3, 4, 5, 6]
    # the model's own likely continuation, then the start again: n-grams propose it
    (cont,) = outputs(engine(target), {"g": (base, greedy(8))}).values()
    prompt, n, length = base + cont + base, 2000, 4
    requests = {
        f"q{i}": (
            prompt,
            SamplingParams(
                max_tokens=length, temperature=temp, top_k=top_k, seed=i, ignore_eos=True
            ),
        )
        for i in range(n)
    }
    counts: dict = {}
    for out in outputs(e, requests).values():
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    stat, critical = _chi_square(counts, _joint(target, prompt, length, temp, top_k), n)
    assert stat < critical, f"chi-square {stat:.1f} above {critical:.1f}"
    assert e.stats.spec_accepted_tokens > 0.05 * n * length


def test_settings_and_engine_refuse_a_draft_method_without_its_model() -> None:
    with pytest.raises(ValueError, match="speculative_model"):
        Settings(speculative_method="draft")
    with pytest.raises(ValueError, match="speculative_model"):
        Settings(speculative_model="some/model")
    with pytest.raises(ValueError, match="speculative_model: a draft model runs on one rank"):
        Settings(speculative_method="draft", speculative_model="m", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="speculative_method must be one of"):
        Settings(speculative_method="eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens must be > 0"):
        Settings(speculative_method="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="speculative_model"):
        engine(speculative_method="draft", speculative_model="m")
