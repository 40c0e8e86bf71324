"""Structured outputs over HTTP, with the official openai client where it has the
parameter: OpenAI's response_format (json_schema, json_object) on chat and completions,
vLLM's structured_outputs and guided_* extras; streamed deltas concatenate to the valid
document; a bad or unsupported constraint is a 400 naming the parameter."""

import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.api.json_schemas import SCHEMAS
from tests.factories import Server

MODEL = "kvserve-demo-random"


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def schema_format(name: str) -> dict:
    return {
        "type": "json_schema",
        "json_schema": {"name": name, "schema": SCHEMAS[name][0], "strict": True},
    }


@pytest.mark.parametrize("name", ["nested_object", "array_of_objects", "string_formats"])
def test_chat_response_format_json_schema(client: openai.OpenAI, name: str) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "A record, please."}],
        response_format=schema_format(name),
        max_tokens=300,
        temperature=1.0,
        n=2,
        seed=7,
    )
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name][0])


def test_streamed_deltas_concatenate_to_the_valid_document(client: openai.OpenAI) -> None:
    """Seeded: the same document every run, in several deltas (how many depends on the
    reader's pace: a lagging reader gets steps coalesced). Text the grammar forces
    arrives with the token before it (jump-forward); the name, city and zip code are
    sampled."""
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Stream JSON."}],
        response_format=schema_format("nested_object"),
        max_tokens=100,
        temperature=1.0,
        seed=11,
        stream=True,
    )
    parts, finish = [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert len([p for p in parts if p]) > 1 and finish == "stop"
    jsonschema.validate(json.loads("".join(parts)), SCHEMAS["nested_object"][0])


def test_completions_with_vllm_extras(client: openai.OpenAI) -> None:
    def complete(**extra: object) -> str:
        r = client.completions.create(
            model=MODEL, prompt="Say:", max_tokens=40, temperature=1.0, extra_body=extra
        )
        assert r.choices[0].finish_reason == "stop"
        return r.choices[0].text

    assert complete(guided_choice=["alpha", "beta"]) in ("alpha", "beta")
    assert re.fullmatch(r"\d{3}-[a-z]{2}", complete(guided_regex=r"\d{3}-[a-z]{2}"))
    assert complete(structured_outputs={"choice": ["up", "down"]}) in ("up", "down")
    assert complete(structured_outputs={"grammar": 'root ::= "x" | "y" "z"'}) in ("x", "yz")
    doc = complete(guided_json=SCHEMAS["number_bounds"][0])
    jsonschema.validate(json.loads(doc), SCHEMAS["number_bounds"][0])
    fmt = {"type": "json_schema", "json_schema": {"name": "e", "schema": SCHEMAS["any_of"][0]}}
    jsonschema.validate(json.loads(complete(response_format=fmt)), SCHEMAS["any_of"][0])


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
             "schema": {"type": "array", "uniqueItems": True}}}},
            "response_format.json_schema.schema",
            "uniqueItems",
        ),
        ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
        ({"guided_regex": "([a-z"}, "guided_regex", "unclosed"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_choice": []}, "guided_choice", "non-empty"),
        ({"structured_outputs": {"grammar": 'start: "a" | b'}}, "structured_outputs.grammar", "unknown name"),
        ({"structured_outputs": {"xml": "x"}}, "structured_outputs.xml", "json, regex"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "give one"),
    ],
)  # fmt: skip
def test_a_bad_constraint_is_a_400_naming_the_parameter(
    server: Server, body: dict, param: str, says: str
) -> None:
    for route, base in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi"}),
    ):
        r = httpx.post(server.url + route, json={"model": MODEL, **base, **body}, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and says in error["message"], error
    assert httpx.get(server.url + "/health", timeout=10).json()["status"] == "ok"
