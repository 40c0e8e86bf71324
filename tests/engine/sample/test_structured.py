"""Structured outputs in the engine (llguidance): every output sampled at temperature 1
parses and validates against its JSON Schema, matches its regex, is one of its choices or
is in its grammar's language; constrained and unconstrained requests batched together
each stay correct; preemption and n > 1 keep the grammar's place; forced text jumped to
keeps a draft model's cache in step; a bad or unsupported constraint is refused naming the
parameter and what is wrong."""

import dataclasses
import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from model.demo import build_demo_model
from model.loader import load
from model.tokenizer import Tokenizer
from service.config import Settings
from service.engine.core.engine import LLMEngine
from service.engine.request import Constraint, SamplingParams
from service.engine.sample.structured import ConstraintError, Grammars
from service.engine.text.processor import Texts
from tests.api.json_schemas import SCHEMAS
from tests.engine.helpers import greedy, run_all, tokens_of
from tests.factories import write_llama, write_tokenizer


@pytest.fixture(scope="module")
def demo() -> LLMEngine:
    """The random demo model over cl100k (100k tokens)."""
    settings = Settings(num_kv_blocks=1024, max_num_seqs=16, max_num_batched_tokens=256)
    return LLMEngine.build(build_demo_model(torch.float32), Tokenizer.default(), settings.engine)


def sample(c: Constraint, seed: int, max_tokens: int = 200, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, constraint=c, **kw)


def texts(engine: LLMEngine, requests: dict) -> dict[str, tuple[str, str]]:
    out = {}
    for rid, outs in run_all(engine, requests).items():
        out[rid] = ("".join(o.text for o in outs), outs[-1].finish_reason.value)
    return out


def json_constraint(name: str) -> Constraint:
    return Constraint("json", json.dumps(SCHEMAS[name][0]), "response_format")


def test_every_schema_of_the_corpus_gives_valid_documents(demo: LLMEngine) -> None:
    prompt = demo.tokenizer.encode("Answer in JSON:")
    requests = {
        f"{name}/{seed}": (prompt, sample(json_constraint(name), seed))
        for name in SCHEMAS
        for seed in range(3)
    }
    for rid, (text, finish) in texts(demo, requests).items():
        assert finish == "stop", (rid, text)  # the grammar completed, not max_tokens
        jsonschema.validate(json.loads(text), SCHEMAS[rid.split("/")[0]][0])


def test_json_object_regex_choice_and_grammars(demo: LLMEngine) -> None:
    prompt = demo.tokenizer.encode("Go:")
    cases = {
        "regex": (Constraint("regex", r"[A-Z]{2}-\d{3}( ok)?", "guided_regex"), r"[A-Z]{2}-\d{3}( ok)?"),
        "choice": (Constraint("choice", json.dumps(["yes", "no", "N/A (n.b.)"]), "guided_choice"),
                   r"yes|no|N/A \(n\.b\.\)"),
        "lark": (Constraint("grammar", 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/', "guided_grammar"),
                 r"\(\d{1,3}(\+\d{1,3})*\)"),
        "gbnf": (Constraint("grammar", 'root ::= "on" | "off" | "auto"', "guided_grammar"), r"on|off|auto"),
    }  # fmt: skip
    requests = {
        f"{k}/{seed}": (prompt, sample(c, seed, max_tokens=64)) for k, (c, _) in cases.items()
        for seed in range(4)
    }  # fmt: skip
    requests |= {
        f"object/{seed}": (prompt, sample(Constraint("json_object", "", "response_format"), seed, max_tokens=400))
        for seed in range(2)
    }  # fmt: skip
    for rid, (text, finish) in texts(demo, requests).items():
        kind = rid.split("/")[0]
        if kind == "object":  # any JSON object; a random model may not close it in time
            if finish == "stop":
                assert isinstance(json.loads(text), dict)
            else:
                assert text.startswith("{") and finish == "length"
            continue
        assert finish == "stop"
        assert re.fullmatch(cases[kind][1], text), (rid, text)


def test_constrained_and_unconstrained_requests_batched_together(demo: LLMEngine) -> None:
    """An unconstrained greedy request gives the same tokens beside constrained ones as
    alone (it pays nothing and is masked by nothing)."""
    tok = demo.tokenizer
    free = (tok.encode("Once upon a time"), greedy(24))
    alone = tokens_of(run_all(demo, {"free": free})["free"])
    mixed = {"free": free} | {
        f"json/{i}": (tok.encode("JSON:"), sample(json_constraint("array_of_objects"), i))
        for i in range(5)
    }
    outs = run_all(demo, mixed)
    assert tokens_of(outs["free"]) == alone
    for i in range(5):
        text = "".join(o.text for o in outs[f"json/{i}"])
        jsonschema.validate(json.loads(text), SCHEMAS["array_of_objects"][0])


def test_preemption_and_n_keep_each_sequences_place_in_the_grammar() -> None:
    """A pool too small for the batch preempts (and recomputes) constrained sequences;
    n > 1 siblings each have their own matcher."""
    settings = Settings(num_kv_blocks=24, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    engine = LLMEngine.build(build_demo_model(torch.float32), Tokenizer.default(), settings.engine)
    prompt = engine.tokenizer.encode("Answer in JSON: " * 3)
    requests = {
        f"r{i}": (prompt, sample(json_constraint("nested_object"), i, max_tokens=80, n=2))
        for i in range(4)
    }
    outs = run_all(engine, requests)
    assert engine.stats.preemptions > 0
    assert len(outs) == 8  # 4 requests x n=2
    for rid, seq in outs.items():
        text = "".join(o.text for o in seq)
        assert seq[-1].finish_reason.value == "stop", (rid, text)
        jsonschema.validate(json.loads(text), SCHEMAS["nested_object"][0])
    assert engine.blocks.num_used == 0


def test_guides_of_one_constraint_are_independent(demo: LLMEngine) -> None:
    """Every guide of a constraint starts at the grammar's start, however far the others
    have gone (each is a copy of one never-advanced matcher)."""
    c = Constraint("choice", json.dumps(["12", "34"]), "guided_choice")
    tok = demo.tokenizer
    one, two = tok.encode("1", add_bos=False)[0], tok.encode("3", add_bos=False)[0]
    first = demo.grammars.guide(c)
    assert first.accept(one) and not first.allows(two)
    second = demo.grammars.guide(c)
    assert second.allows(one) and second.allows(two)
    assert second.accept(two) and not first.done and not second.done
    assert demo.grammars.guide(c).allows(one)


def test_a_parity_checkpoint_with_its_own_tokenizer(tmp_path: Path) -> None:
    """The small Llama checkpoint with a 300-token byte-level BPE of its own."""
    write_llama(tmp_path, tied=True)
    write_tokenizer(tmp_path)
    loaded = load(tmp_path, torch.float32, torch.device("cpu"))
    engine = LLMEngine.build(loaded.model, loaded.tokenizer, Settings(num_kv_blocks=256).engine)
    prompt = [5, 6, 7, 8]
    requests = {
        f"{name}/{seed}": (prompt, sample(json_constraint(name), seed, max_tokens=250))
        for name in ("number_bounds", "enum_and_const", "any_of")
        for seed in range(2)
    }
    for rid, (text, finish) in texts(engine, requests).items():
        assert finish == "stop", (rid, text)
        jsonschema.validate(json.loads(text), SCHEMAS[rid.split("/")[0]][0])


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (Constraint("json", '{"type": "objekt"}', "response_format"), "objekt"),
        (
            Constraint("json", '{"type": "array", "uniqueItems": true}', "guided_json"),
            "uniqueItems",
        ),
        (Constraint("json", '{"not": {"type": "string"}}', "response_format"), '"not"'),
        (Constraint("regex", "([a-z", "guided_regex"), "unclosed character class"),
        (Constraint("grammar", 'start: "a" | b', "guided_grammar"), "unknown name"),
        (Constraint("grammar", "\u00d05\x12", "guided_grammar"), "Expected ::="),  # the fuzzer's
    ],
)
def test_a_bad_or_unsupported_constraint_is_refused_naming_it(
    demo: LLMEngine, constraint: Constraint, message: str
) -> None:
    with pytest.raises(ConstraintError, match=re.escape(message)) as err:
        demo.validate([1, 2, 3], sample(constraint, 0))
    assert err.value.param == constraint.param
    assert not demo.requests  # nothing was queued


def test_forced_text_takes_no_steps_of_its_own(demo: LLMEngine) -> None:
    """Jump-forward: once the first token of a single choice is sampled, the grammar
    forces the rest, which arrives without a step per token; logprobs requests (forced
    tokens have none) and --disable-jump-forward sample every token."""
    choice = "supercalifragilisticexpialidocious, said the quick brown fox"
    c = Constraint("choice", json.dumps([choice]), "guided_choice")
    prompt = demo.tokenizer.encode("Say it:")
    settings = Settings(num_kv_blocks=1024, max_num_seqs=16, max_num_batched_tokens=256)
    sampled_every_token = LLMEngine.build(
        demo.runner.model,
        demo.tokenizer,
        dataclasses.replace(settings, disable_jump_forward=True).engine,
    )
    cases = {
        "jump": (demo, sample(c, 0, max_tokens=64)),
        "logprobs": (demo, sample(c, 0, max_tokens=64, logprobs=1)),
        "off": (sampled_every_token, sample(c, 0, max_tokens=64)),
    }
    steps = {}
    for name, (engine, params) in cases.items():
        texts = Texts(engine.tokenizer, engine.stop)
        engine.add_request(name, prompt, params)
        texts.add(name, params)
        outs = []
        while engine.has_unfinished():
            outs += texts.process(engine.step())
        text, tokens = "".join(o.text for o in outs), tokens_of(outs)
        assert text == choice and outs[-1].finish_reason.value == "stop", (name, text)
        steps[name] = (len(outs), len(tokens))
        if name == "logprobs":
            assert sum(len(o.logprobs or []) for o in outs) == len(tokens)
    assert steps["jump"][0] <= 3 < steps["jump"][1], steps
    assert steps["logprobs"][0] == steps["logprobs"][1] > 5, steps
    assert steps["off"][0] == steps["off"][1] > 5, steps


def test_forced_text_beside_a_draft_model(demo: LLMEngine) -> None:
    """Jump-forward in an engine whose draft model mirrors every forward: the step that
    computes a constrained request's forced tokens (several at once, with the token after
    them) is mirrored into the draft's cache like any other. The model drafting for
    itself, every draft is accepted: for the unconstrained requests decoding beside the
    constrained one, and for a later request that continues its text through the prefix
    cache (its drafts read the draft's K/V of the forced tokens); all get the plain
    engine's greedy tokens."""
    forced = ", supercalifragilisticexpialidocious said the quick brown fox "
    c = Constraint("regex", f"(yes|no){forced}[a-z]{{8,60}}", "guided_regex")
    tok = demo.tokenizer
    prompt = tok.encode("Say it:")
    settings = Settings(num_kv_blocks=1024, max_num_seqs=16, max_num_batched_tokens=256)
    drafting = LLMEngine.build(
        demo.runner.model,
        tok,
        settings.replace(
            speculative_method="draft", speculative_model="in-memory", speculative_min_speedup=0
        ).engine,
        draft=demo.runner.model,
    )
    plain = LLMEngine.build(demo.runner.model, tok, settings.engine)
    beside = {f"u{i}": (tok.encode(f"Count to {i + 3}:"), greedy(24)) for i in range(2)}
    got = run_all(drafting, {"c": (prompt, sample(c, 0, max_tokens=40))} | beside)
    text = "".join(o.text for o in got["c"])
    assert re.fullmatch(f"(yes|no){forced}[a-z]+", text), text
    assert max(len(o.token_ids) for o in got["c"]) > 5  # the forced text came at once
    want = run_all(plain, beside)
    assert {r: tokens_of(got[r]) for r in beside} == {r: tokens_of(want[r]) for r in beside}
    follow = {"f": (prompt + tokens_of(got["c"]) + tok.encode(" and then"), greedy(24))}
    hits = drafting.stats.prefix_hit_tokens
    after = run_all(drafting, follow)
    assert drafting.stats.prefix_hit_tokens - hits >= len(tok.encode(forced))
    assert tokens_of(after["f"]) == tokens_of(run_all(plain, follow)["f"])
    drafted, accepted = drafting.stats.spec_draft_tokens, drafting.stats.spec_accepted_tokens
    assert drafted > 0 and accepted == drafted
    assert drafting.blocks.num_used == 0


THOUGHT = "Let me think: {not json} and <b>tags</b>, then answer.</think>\n\n"


@pytest.mark.parametrize(
    ("c", "answer", "wrong"),
    [
        (json_constraint("nested_object"), None, "hello"),
        (Constraint("regex", "[0-9]{3}", "guided_regex"), "123", "12a"),
        (Constraint("choice", '["yes", "no"]', "guided_choice"), "no", "maybe"),
        (Constraint("grammar", 'start: "a" ("b" | "c")', "guided_grammar"), "ac", "ca"),
    ],
)
def test_a_constraint_holds_from_the_end_of_the_thinking(
    demo: LLMEngine, c: Constraint, answer: str | None, wrong: str
) -> None:
    """think "open": any text up to the first end marker, the answer held from there;
    "maybe": a think block may come first, or the answer at once; "": the answer alone."""
    grammars = demo.grammars
    tok = demo.tokenizer
    if answer is None:
        answer = json.dumps(SCHEMAS["nested_object"][1], separators=(",", ":"))

    def takes(think: str, text: str) -> bool:
        guide = grammars.guide(dataclasses.replace(c, think=think))
        ok = all(guide.accept(t) for t in tok.encode(text, add_bos=False))
        return ok and guide.done

    assert takes("open", THOUGHT + answer) and not takes("open", THOUGHT + wrong)
    assert not takes("open", answer)  # the block is open: its end comes first
    assert takes("maybe", answer) and takes("maybe", "<think>" + THOUGHT + answer)
    assert not takes("maybe", "<think>" + THOUGHT + wrong) and not takes("maybe", wrong)
    assert takes("", answer) and not takes("", THOUGHT + answer)


def test_a_grammar_the_front_checked_is_not_validated_again(monkeypatch) -> None:
    """A checked request carries its compiled grammar; an engine in another process takes
    it (adopt) and builds its matcher without validating it once more."""
    import llguidance

    tok = Tokenizer.default()
    front = Grammars(tok, 100277, tok.eos_ids)
    c = json_constraint("nested_object")
    grammar = front.compiled(c)
    core = Grammars(tok, 100277, tok.eos_ids)

    def refuse(*_: object) -> None:
        raise AssertionError("validated again")

    monkeypatch.setattr(llguidance.LLMatcher, "validate_grammar_with_warnings", refuse)
    core.adopt(c, grammar)
    core.check(c)
    assert core.compiled(c) == grammar and core.guide(c).allows(tok.encode("{")[0])
