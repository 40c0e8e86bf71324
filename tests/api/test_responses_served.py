"""/v1/responses with the official openai client, over the chat path of a Qwen3 checkpoint
behind a Hermes-style template: text in and out (with instructions, a cap of output
tokens), streamed events whose deltas add up to the response, previous_response_id over
the bounded store (a miss is a 404), a stored response retrieved and deleted, function
calls out and their outputs back in, and a JSON Schema text format."""

import json

import httpx
import jsonschema
import openai
import pytest

from tests.api.test_tools_served import TEMPLATE, TOOLS
from tests.factories import start_server, write_qwen3, write_qwen_tokenizer

pytestmark = pytest.mark.slow

FUNCTIONS = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses shape


def serve(tmp_path_factory: pytest.TempPathFactory, *flags: str):
    """The Qwen3 checkpoint behind the tools template, served with `flags`."""
    path = tmp_path_factory.mktemp("qwen3-responses")
    write_qwen3(path, max_position_embeddings=2048)
    write_qwen_tokenizer(path, TEMPLATE, "the weather in paris is mild", thinks=False)
    return start_server(str(path), "--model", str(path), *flags)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    server = serve(tmp_path_factory, "--responses-store-size", "3")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    yield client, client.models.list().data[0].id
    assert server.stop() == 0


def test_text_streamed_and_continued(served) -> None:
    client, model = served
    kw = dict(model=model, input="Hello there", instructions="Be brief.",
              max_output_tokens=6, temperature=0)  # fmt: skip
    first = client.responses.create(**kw)
    assert first.object == "response" and first.id.startswith("resp_")
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    assert first.usage.output_tokens == 6 and first.output_text
    [item] = first.output
    assert item.type == "message" and item.content[0].type == "output_text"
    [given] = client.responses.input_items.list(first.id).data  # the text as a message
    assert given.type == "message" and given.role == "user" and given.id.startswith("msg_")
    assert given.content[0].text == "Hello there"

    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == first.output_text == events[-1].response.output_text

    fresh = client.responses.create(model=model, input="And then?", max_output_tokens=2)
    later = client.responses.create(
        model=model, input="And then?", max_output_tokens=2, previous_response_id=first.id
    )
    assert later.previous_response_id == first.id
    assert later.usage.input_tokens > fresh.usage.input_tokens  # the earlier turn with it
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=model, input="x", previous_response_id="resp_nope")
    assert err.value.body["param"] == "previous_response_id"
    # retrieved as it was returned (a streamed one too), then deleted
    assert client.responses.retrieve(later.id).model_dump() == later.model_dump()
    streamed = events[-1].response
    assert client.responses.retrieve(streamed.id).output_text == streamed.output_text
    deleted = client.responses.delete(later.id)  # the SDK returns nothing
    assert deleted is None
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.retrieve(later.id)
    assert err.value.body["code"] == "not_found"
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(later.id)
    # a store of three: the first response is evicted by the fourth (later)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=model, input="x", previous_response_id=first.id)
    metrics = httpx.get(str(client.base_url).removesuffix("v1/") + "metrics").text
    for route, status in (("/v1/responses", 200), ("/v1/responses/{id}", 404)):
        assert f'route="{route}",status="{status}"' in metrics


def test_function_calls_and_their_outputs(served) -> None:
    client, model = served
    # 600 tokens: room for the longest call the schemas allow (a 12-character city of
    # escaped surrogate pairs is 144 one-character tokens of this tokenizer's)
    kw = dict(model=model, input="What is the weather in Paris?", tools=FUNCTIONS,
              tool_choice="required", parallel_tool_calls=False, temperature=1.0,
              max_output_tokens=600)  # fmt: skip
    calls = [i for i in client.responses.create(**kw).output if i.type == "function_call"]
    assert len(calls) == 1 and calls[0].call_id.startswith("call_")
    schema = {t["name"]: t["parameters"] for t in FUNCTIONS}[calls[0].name]
    jsonschema.validate(json.loads(calls[0].arguments), schema)
    events = list(client.responses.create(**kw, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and events[-1].type == "response.completed"
    follow = client.responses.create(
        model=model, tools=FUNCTIONS, max_output_tokens=3, temperature=0.0, input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name,
             "arguments": calls[0].arguments},
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"},
        ],
    )  # fmt: skip
    assert follow.usage.input_tokens > 0 and follow.status == "incomplete"
    # the input items listed newest first by default, a page at a time
    listed = client.responses.input_items.list(follow.id, order="asc")
    assert [i.type for i in listed.data] == ["message", "function_call", "function_call_output"]
    newest = client.responses.input_items.list(follow.id, limit=2)
    assert [i.type for i in newest.data] == ["function_call_output", "function_call"]
    assert newest.has_more and newest.last_id == listed.data[1].id
    rest = client.responses.input_items.list(follow.id, limit=2, after=newest.last_id)
    assert [i.id for i in rest.data] == [listed.data[0].id] and not rest.has_more


def test_a_json_schema_text_format(served) -> None:
    client, model = served
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
              "required": ["city"], "additionalProperties": False}  # fmt: skip
    resp = client.responses.create(
        model=model, input="A city?", max_output_tokens=60, temperature=1.0,
        text={"format": {"type": "json_schema", "name": "city", "schema": schema}},
    )  # fmt: skip
    jsonschema.validate(json.loads(resp.output_text), schema)


def test_bad_items_are_400s(served) -> None:
    client, model = served
    cases = [
        ([{"type": "function_call", "name": "add", "arguments": "{}"}], "input[0].call_id"),
        ([{"type": "web_search_call"}], "input[0]"),
        ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
         "input[0].content"),
    ]  # fmt: skip
    for items, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model=model, input=items)
        assert err.value.body["param"] == param, err.value.body
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=model, input="x", tools=[{"type": "web_search"}])
    assert err.value.body["param"] == "tools[0]"


def test_bad_input_item_pages_are_400s(served) -> None:
    client, model = served
    rid = client.responses.create(model=model, input="hi", max_output_tokens=1).id
    for query, param in (("limit=0", "limit"), ("limit=101", "limit"), ("order=up", "order"),
                         ("after=msg_nope", "after")):  # fmt: skip
        resp = httpx.get(f"{client.base_url}responses/{rid}/input_items?{query}")
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nope")


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory):
    """A server with two API keys, as two tenants."""
    server = serve(tmp_path_factory, "--api-keys", "alice-key,bob-key")
    clients = [openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
               for key in ("alice-key", "bob-key")]  # fmt: skip
    yield *clients, clients[0].models.list().data[0].id
    assert server.stop() == 0


def test_a_stored_response_is_its_api_keys_alone(keyed) -> None:
    """Another key can neither read, list, continue nor delete it: each is a 404, as for
    a response never stored; streamed responses are scoped alike."""
    alice, bob, model = keyed
    for stream in (False, True):
        kw = dict(model=model, input="my secret is 4711", max_output_tokens=2)
        if stream:
            events = list(alice.responses.create(**kw, stream=True))
            rid = events[-1].response.id
        else:
            rid = alice.responses.create(**kw).id
        for call, args in (
            (bob.responses.retrieve, {}),
            (bob.responses.input_items.list, {}),
            (bob.responses.delete, {}),
        ):
            with pytest.raises(openai.NotFoundError):
                call(rid, **args)
        with pytest.raises(openai.NotFoundError):
            bob.responses.create(model=model, input="and?", previous_response_id=rid)
        assert alice.responses.retrieve(rid).id == rid
        assert alice.responses.input_items.list(rid).data[0].content[0].text == kw["input"]
        later = alice.responses.create(model=model, input="and?", max_output_tokens=1,
                                       previous_response_id=rid)  # fmt: skip
        assert later.previous_response_id == rid
        alice.responses.delete(rid)


def test_what_is_stored_is_bounded(keyed) -> None:
    """OpenAI's metadata limits (16 pairs, keys of 64 characters, values of 512) and
    unknown `text` keys are 400s naming the field; unknown fields of input items and
    tools are not stored."""
    alice, _, model = keyed
    cases = [
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata"),
        ({"text": {"format": {"type": "text"}, "padding": "x" * 1000}}, "text.padding"),
    ]  # fmt: skip
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            alice.responses.create(model=model, input="hi", max_output_tokens=1, extra_body=extra)
        assert err.value.body["param"].startswith(param), err.value.body
    ok = alice.responses.create(
        model=model, max_output_tokens=1, metadata={f"k{i}": "v" * 512 for i in range(16)},
        input=[{"role": "user", "content": [{"type": "input_text", "text": "hi", "pad": "x" * 999}],
                "padding": "x" * 999}],
        tools=[{**FUNCTIONS[0], "padding": "x" * 999}],
    )  # fmt: skip
    raw = httpx.get(f"{alice.base_url}responses/{ok.id}",
                    headers={"Authorization": "Bearer alice-key"}).text  # fmt: skip
    items = httpx.get(f"{alice.base_url}responses/{ok.id}/input_items",
                      headers={"Authorization": "Bearer alice-key"}).text  # fmt: skip
    assert "x" * 999 not in raw + items and len(ok.metadata) == 16
