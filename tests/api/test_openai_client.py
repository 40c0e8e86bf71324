"""The official openai client against a live server; responses validated against the
client's own models (strict pydantic validation of the raw JSON)."""

import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.completion import Completion as CompletionChunk

from tests.factories import Server


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


MODEL = "kvserve-demo-random"


def check(model_type: type, raw: object) -> None:
    model_type.model_validate(raw.model_dump() if hasattr(raw, "model_dump") else raw, strict=False)


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    card = client.models.retrieve(MODEL)
    memory = card.model_extra["memory"]
    assert memory["parameters"]["total"] > 0 and memory["kv_bytes_per_token"] > 0
    assert memory["kv_pool_tokens"] > 0 and memory["kv_pool_sequences_of_max_len"] >= 1
    floors = memory["floors"]
    assert floors["bandwidth_gb_s"] > 0 and floors["decode_floor_ms_per_token"] > 0
    assert floors["prefill_ceiling_tokens_per_s"] > 0


def test_completion_plain_and_usage(client: openai.OpenAI) -> None:
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="The quick brown fox", max_tokens=8, temperature=0
    )
    resp = Completion.model_validate(raw.http_response.json())
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-")
    assert len(resp.choices) == 1 and isinstance(resp.choices[0].text, str)
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens == 4 and resp.usage.completion_tokens == 8
    assert resp.usage.total_tokens == 12
    again = client.completions.create(
        model=MODEL, prompt="The quick brown fox", max_tokens=8, temperature=0
    )
    assert again.choices[0].text == resp.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens == 0  # 4 tokens < one block


def test_completion_prompt_forms_and_n(client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model=MODEL, prompt=["Hello", "World"], max_tokens=3, n=2, temperature=1.0, seed=1
    )
    assert sorted(c.index for c in resp.choices) == [0, 1, 2, 3]
    ids = client.completions.create(
        model=MODEL, prompt=[791, 4062, 14198, 39935], max_tokens=3, temperature=0
    )
    text = client.completions.create(
        model=MODEL, prompt="The quick brown fox", max_tokens=3, temperature=0
    )
    assert ids.choices[0].text == text.choices[0].text
    lists = client.completions.create(
        model=MODEL, prompt=[[791, 4062], [14198]], max_tokens=2, temperature=0
    )
    assert len(lists.choices) == 2


def test_completion_streaming_with_usage(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    for chunk in chunks:
        # the client reuses Completion for chunks, whose finish_reason is not nullable,
        # while OpenAI (and kvserve) send null until the last chunk of a choice
        dumped = chunk.model_dump()
        for choice in dumped["choices"]:
            assert isinstance(choice["text"], str)
            assert choice["finish_reason"] in (None, "stop", "length")
            choice["finish_reason"] = choice["finish_reason"] or "length"
        CompletionChunk.model_validate(dumped)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    plain = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0
    )
    assert text == plain.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_logprobs_stop_echo_seed(client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=5, temperature=0, logprobs=3
    )
    lp = resp.choices[0].logprobs
    assert (
        len(lp.tokens) == 5
        and len(lp.token_logprobs) == 5
        and all(len(t) == 3 for t in lp.top_logprobs)
    )
    assert all(v <= 0 for v in lp.token_logprobs)
    full = (
        client.completions.create(model=MODEL, prompt="Hello there", max_tokens=20, temperature=0)
        .choices[0]
        .text
    )
    stop = full[5:8]
    stopped = client.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=20, temperature=0, stop=[stop]
    )
    assert (
        stopped.choices[0].text == full[: full.find(stop)]
        and stopped.choices[0].finish_reason == "stop"
    )
    echo = client.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=3, temperature=0, echo=True
    )
    assert echo.choices[0].text.startswith("Hello there")
    a = client.completions.create(
        model=MODEL, prompt="Seeded", max_tokens=10, temperature=1.0, seed=42
    )
    b = client.completions.create(
        model=MODEL, prompt="Seeded", max_tokens=10, temperature=1.0, seed=42
    )
    c = client.completions.create(
        model=MODEL, prompt="Seeded", max_tokens=10, temperature=1.0, seed=43
    )
    assert a.choices[0].text == b.choices[0].text != c.choices[0].text


def test_chat_plain_and_streaming(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0
    )
    resp = ChatCompletion.model_validate(raw.http_response.json())
    assert resp.object == "chat.completion" and resp.choices[0].message.role == "assistant"
    assert isinstance(resp.choices[0].message.content, str) and resp.usage.completion_tokens == 6
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk.model_dump())
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == resp.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == resp.usage.prompt_tokens
    lp = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2
    )
    content = lp.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)


def test_client_errors_are_typed(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, temperature=7)
    assert err.value.body["param"] == "temperature"
