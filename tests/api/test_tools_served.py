"""Tool calling over HTTP with the official openai client, on a Qwen3 checkpoint behind a
Hermes-style template (Qwen's tools section, `<tool_call>` blocks, `<tool_response>`
turns) with random weights: `tool_choice` required and named are held to valid calls by
a grammar (arguments validate against each tool's schema at temperature 1), parallel or
one; streamed calls equal the whole response's for the same seed; "none" renders no
tools; a multi-turn exchange with tool results renders; bad tools are 400s."""

import enum
import itertools
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import jsonschema
import openai
import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.api.test_chatml_served import QWEN3_TEMPLATE
from tests.factories import start_server, write_qwen3, write_qwen_tokenizer
from tests.require import missing

pytestmark = pytest.mark.slow

TOOLS_HEADER = """\
{%- if tools %}
    {{- '<|im_start|>system\\n# Tools\\n\\n<tools>' }}
    {%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
    {{- '\\n</tools>\\n\\nFor each call, return <tool_call>\\n{"name": <function-name>, \
"arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- endif %}
"""
CALLS_AND_RESULTS = """\
{%- for message in messages %}
    {%- if message.role == 'assistant' and message.tool_calls %}
        {{- '<|im_start|>assistant\\n' + (message.content or '') }}
        {%- for call in message.tool_calls %}
            {%- set call = call.function if call.function else call %}
            {{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
            {{- call.arguments | tojson if call.arguments is not string else call.arguments }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + \
'\\n</tool_response><|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
"""
TEMPLATE = TOOLS_HEADER + QWEN3_TEMPLATE + CALLS_AND_RESULTS

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12},
            "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "minimum": -999, "maximum": 999},
            "b": {"type": "integer", "minimum": -999, "maximum": 999}},
            "required": ["a", "b"], "additionalProperties": False}}},
]  # fmt: skip
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ID = re.compile(r"call_[0-9a-f]{24}|[A-Za-z0-9]{9}")  # OpenAI's form; Mistral's


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3-tools")
    write_qwen3(path, max_position_embeddings=2048)
    # a model that does not reason (tools after thinking: test_reasoning_served.py)
    corpus = '{"name": "add", "arguments": {"a": 1}}'
    write_qwen_tokenizer(path, TEMPLATE, corpus, thinks=False)
    return path


@pytest.fixture(scope="module")
def served(checkpoint: Path):
    server = start_server(str(checkpoint), "--model", str(checkpoint))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    yield client, client.models.list().data[0].id
    assert server.stop() == 0


@pytest.fixture(scope="module")
def opening(checkpoint: Path) -> int:
    """The id of the `<tool_call>` token (an added token the text keeps)."""
    added = json.loads((checkpoint / "tokenizer.json").read_text())["added_tokens"]
    return next(t["id"] for t in added if t["content"] == "<tool_call>")


def check_calls(calls, names: set[str]) -> list[tuple[str, dict]]:
    out = []
    for call in calls:
        assert call.type == "function" and ID.fullmatch(call.id)
        assert call.function.name in names
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    return out


def streamed_calls(client, **kw) -> tuple[list[tuple[str, dict]], str | None]:
    """A stream's calls: each call's first delta entry (index, id, name), then fragments
    of its arguments, gathered by index."""
    calls: list[list] = []
    reason = None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            for call in c.delta.tool_calls or []:
                if call.id is not None:
                    assert call.index == len(calls) and ID.fullmatch(call.id)
                    calls.append([call.function.name, ""])
                calls[call.index][1] += call.function.arguments or ""
            reason = c.finish_reason or reason
    return [(name, json.loads(arguments)) for name, arguments in calls], reason


@pytest.mark.parametrize("seed", [1, 3, 4])
def test_required_calls_are_valid_and_streamed_alike(served, seed: int) -> None:
    client, model = served
    kw = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
              temperature=1.0, seed=seed, max_tokens=600)  # fmt: skip
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    calls = check_calls(whole.message.tool_calls, set(SCHEMAS))
    assert calls
    assert streamed_calls(client, **kw) == (calls, "tool_calls")


def test_a_named_call_and_one_call_only(served) -> None:
    client, model = served
    named = {"type": "function", "function": {"name": "add"}}
    kw = dict(model=model, messages=ASK, tools=TOOLS, temperature=1.0, seed=4, max_tokens=200)
    one = client.chat.completions.create(**kw, tool_choice=named).choices[0]
    assert [n for n, _ in check_calls(one.message.tool_calls, {"add"})] == ["add"]
    single = client.chat.completions.create(
        **kw, tool_choice="required", parallel_tool_calls=False
    ).choices[0]
    assert len(check_calls(single.message.tool_calls, set(SCHEMAS))) == 1


def test_none_auto_and_a_multi_turn_exchange(served) -> None:
    client, model = served
    base = client.chat.completions.create(model=model, messages=ASK, max_tokens=1)
    none = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=1, tools=TOOLS, tool_choice="none"
    )
    assert none.usage.prompt_tokens == base.usage.prompt_tokens  # no tools rendered
    auto = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert auto.usage.prompt_tokens > base.usage.prompt_tokens  # the tools section
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
    turns = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type":
         "function", "function": {"name": "get_weather",
         "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    ]  # fmt: skip
    reply = client.chat.completions.create(model=model, messages=turns, tools=TOOLS, max_tokens=4)
    assert reply.usage.prompt_tokens > auto.usage.prompt_tokens  # the call and its result


@pytest.mark.parametrize("seed", [1, 2])
def test_auto_calls_are_held_to_the_grammar_from_their_opening_marker(
    served, opening: int, seed: int
) -> None:
    """ "auto": the model opens a call when it chooses (here pushed to, by a logit bias on
    the opening marker); from there the grammar holds it, so the call is valid at
    temperature 1 (unheld, random weights write no JSON), and alike streamed."""
    client, model = served
    kw = dict(model=model, messages=ASK, tools=TOOLS, temperature=1.0, seed=seed,
              max_tokens=200, logit_bias={str(opening): 100}, parallel_tool_calls=False)  # fmt: skip
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls"
    calls = check_calls(whole.message.tool_calls, set(SCHEMAS))
    assert len(calls) == 1
    assert streamed_calls(client, **kw) == (calls, "tool_calls")


def test_bad_tools_are_400s(served) -> None:
    client, model = served
    cases = [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
         "tools[0].function.name"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1]"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ]  # fmt: skip
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=model, messages=ASK, **extra)
        assert err.value.body["param"] == param, (extra, err.value.body)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(cuts=st.lists(st.integers(min_value=0), max_size=40))
def test_any_split_of_a_streams_bytes_gives_the_same_calls(raw_stream, cuts: list[int]) -> None:
    """The SSE bytes of a streamed response cut at arbitrary points (as a network may
    deliver them) and read back as events give the calls of the whole response (how many
    deltas carry them depends on the reader's pace: one that falls behind gets the steps
    since its last read in one, service/engine/process/streams.py; test_tool_split.py
    checks the fragments of any chunking)."""
    raw, want = raw_stream
    points = sorted({c % (len(raw) + 1) for c in cuts} | {0, len(raw)})
    buffer, calls = b"", {}
    for a, b in itertools.pairwise(points):
        buffer += raw[a:b]
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            data = event.removeprefix(b"data: ")
            if data == b"[DONE]":
                continue
            for choice in json.loads(data)["choices"]:
                for call in choice["delta"].get("tool_calls") or []:
                    name, arguments = calls.get(call["index"], (None, ""))
                    name = call["function"].get("name", name)
                    calls[call["index"]] = (name, arguments + call["function"]["arguments"])
    calls = [(n, json.loads(a)) for _, (n, a) in sorted(calls.items())]
    assert buffer == b"" and calls == want


@pytest.fixture(scope="module")
def raw_stream(served):
    client, model = served
    kw = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
              temperature=1.0, seed=7, max_tokens=600)  # fmt: skip
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    want = [(c.function.name, json.loads(c.function.arguments)) for c in whole]
    with httpx.stream("POST", f"{client.base_url}chat/completions",
                      json={**kw, "stream": True}, timeout=120) as r:  # fmt: skip
        raw = b"".join(r.iter_bytes())
    return raw, want


NODE_CLIENT = """
import OpenAI from "openai";
const [base, body] = process.argv.slice(1);
const client = new OpenAI({ baseURL: base, apiKey: "x", maxRetries: 0 });
const req = JSON.parse(body);
const whole = await client.chat.completions.create(req);
const calls = [];
let reason = null;
for await (const chunk of await client.chat.completions.create({ ...req, stream: true })) {
  for (const c of chunk.choices) {
    for (const t of c.delta.tool_calls ?? []) {
      calls[t.index] ??= { name: t.function.name, arguments: "" };
      calls[t.index].arguments += t.function.arguments ?? "";
    }
    reason = c.finish_reason ?? reason;
  }
}
const helper = await client.chat.completions.stream(req).finalChatCompletion();
console.log(JSON.stringify({
  whole: whole.choices[0], calls, reason, helper: helper.choices[0].message.tool_calls,
}));
"""


def test_the_node_sdk_reads_the_same_calls(served) -> None:
    """The official Node SDK: a required call, whole, streamed by hand, and through the
    SDK's own stream helper (which accumulates the deltas): the same calls."""
    node, npm = shutil.which("node"), Path(sys.prefix) / "npm"
    if node is None or not (npm / "node_modules/openai").is_dir():
        missing("openai-node", f"node and the openai package in {npm}")
    client, model = served
    body = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                parallel_tool_calls=False, temperature=1.0, seed=5, max_tokens=200)  # fmt: skip
    run = subprocess.run(
        [node, "--input-type=module", "-e", NODE_CLIENT, str(client.base_url), json.dumps(body)],
        cwd=npm, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout)
    whole = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
             for c in got["whole"]["message"]["tool_calls"]]  # fmt: skip
    assert whole and got["whole"]["finish_reason"] == "tool_calls"
    for name, arguments in whole:
        jsonschema.validate(arguments, SCHEMAS[name])
    assert [(c["name"], json.loads(c["arguments"])) for c in got["calls"]] == whole
    assert got["reason"] == "tool_calls"
    helper = [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got["helper"]
    ]
    assert helper == whole


class Unit(enum.StrEnum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


class Strict(pydantic.BaseModel):
    """additionalProperties false, as strict tools have (the OpenAI Agents SDK's)"""

    model_config = pydantic.ConfigDict(extra="forbid")


class Place(Strict):
    city: str = pydantic.Field(max_length=8)
    country: str | None = pydantic.Field(default=None, max_length=4)


class Stop(Strict):
    place: Place
    days: int = pydantic.Field(ge=1, le=9)


class Trip(Strict):
    """A model as pydantic writes it: nested models and a list of them under `$defs`
    (Stop refers to Place there), an optional field, an enum."""

    stops: list[Stop] = pydantic.Field(min_length=1, max_length=2)
    unit: Unit
    note: str | None = pydantic.Field(default=None, max_length=6)


# older drafts' `definitions`, and a reference from one definition to another
LEGACY = {"type": "object", "required": ["p"], "additionalProperties": False,
          "properties": {"p": {"$ref": "#/definitions/Pair"}},
          "definitions": {
              "Pair": {"type": "array", "items": {"$ref": "#/definitions/Digit"},
                       "minItems": 2, "maxItems": 2},
              "Digit": {"type": "integer", "minimum": 0, "maximum": 9}}}  # fmt: skip
DEFS_TOOLS = [
    {"type": "function", "function": {"name": "plan_trip", "parameters": Trip.model_json_schema()}},
    {"type": "function", "function": {"name": "pair", "parameters": LEGACY}},
]
DEFS_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in DEFS_TOOLS}


@pytest.mark.parametrize("choice", ["required", "auto", "plan_trip", "pair"])
def test_tools_whose_schemas_use_defs_are_called_validly(served, opening: int, choice) -> None:
    """Pydantic's `model_json_schema()` (references into `$defs`) and a draft-07 schema
    (`definitions`): held to valid calls under every tool_choice, whole and streamed
    alike (auto pushed to a call by a logit bias on its opening marker)."""
    client, model = served
    named = {"type": "function", "function": {"name": choice}}
    kw = dict(model=model, messages=ASK, tools=DEFS_TOOLS, temperature=1.0, seed=2,
              max_tokens=600, parallel_tool_calls=False,
              tool_choice=choice if choice in ("required", "auto") else named)  # fmt: skip
    if choice == "auto":
        kw["logit_bias"] = {str(opening): 100}
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls", whole
    (call,) = whole.message.tool_calls
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, DEFS_SCHEMAS[call.function.name])
    if call.function.name == "plan_trip":
        Trip.model_validate(arguments)
    assert choice in ("required", "auto", call.function.name)
    assert streamed_calls(client, **kw) == ([(call.function.name, arguments)], "tool_calls")


def test_the_responses_api_calls_tools_whose_schemas_use_defs(served) -> None:
    client, model = served
    tools = [{"type": "function", **t["function"]} for t in DEFS_TOOLS]
    kw = dict(model=model, input="Plan a trip", tools=tools, temperature=1.0,
              max_output_tokens=600, tool_choice={"type": "function", "name": "plan_trip"})  # fmt: skip
    whole = client.responses.create(**kw)
    (call,) = [item for item in whole.output if item.type == "function_call"]
    Trip.model_validate_json(call.arguments)
    with client.responses.stream(**kw) as stream:
        final = stream.get_final_response()
    (streamed,) = [item for item in final.output if item.type == "function_call"]
    Trip.model_validate_json(streamed.arguments)
