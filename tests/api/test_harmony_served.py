"""gpt-oss's harmony through the official client, on a gpt-oss checkpoint (random
weights) behind a harmony template and tokenizer: a named tool_choice is held to a call
on the commentary channel and answered as a tool call (whole and streamed: the same
call for the same seed), reasoning_effort reaches the template, and whatever the free
model writes comes back without harmony's markers."""

import json

import openai
import pytest

from tests.api.test_tools_served import TOOLS as TOOLS_SERVED
from tests.factories import GPT_OSS_ROPE, start_server, write_gpt_oss, write_harmony_tokenizer

pytestmark = pytest.mark.slow

TEMPLATE = """\
{%- if reasoning_effort is defined %}<|start|>system<|message|>Reasoning: {{ reasoning_effort }}<|end|>{% endif %}
{%- if tools %}<|start|>developer<|message|>{{ tools | tojson }}<|end|>{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>
{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""
TOOLS = TOOLS_SERVED[:1]  # get_weather
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("gpt-oss")
    rope = GPT_OSS_ROPE | {"original_max_position_embeddings": 256}  # the tools' JSON is long
    write_gpt_oss(path, max_position_embeddings=1024, rope_parameters=rope)
    write_harmony_tokenizer(path, TEMPLATE, 'commentary to=functions.get_weather {"city": "x"}')
    server = start_server(str(path), "--model", str(path))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    client.model = client.models.list().data[0].id  # the folder's name
    yield client
    server.stop()


def test_a_named_tool_is_called_on_the_commentary_channel(client: openai.OpenAI) -> None:
    kw = dict(model=client.model, messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=60)
    r = client.chat.completions.create(**kw, temperature=1.0, seed=3)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
    streamed = {"name": "", "arguments": ""}
    for chunk in client.chat.completions.create(**kw, temperature=1.0, seed=3, stream=True):
        for c in chunk.choices[0].delta.tool_calls or []:
            streamed["name"] += c.function.name or ""
            streamed["arguments"] += c.function.arguments or ""
    assert streamed == {"name": "get_weather", "arguments": call.function.arguments}


def test_reasoning_effort_reaches_the_template_from_chat_and_responses(
    client: openai.OpenAI,
) -> None:
    plain = client.chat.completions.create(model=client.model, messages=ASK, max_tokens=1)
    high = client.chat.completions.create(
        model=client.model, messages=ASK, max_tokens=1, reasoning_effort="high"
    )
    assert high.usage.prompt_tokens > plain.usage.prompt_tokens
    ask = {"model": client.model, "input": ASK[0]["content"], "max_output_tokens": 1}
    plain = client.responses.create(**ask)
    high = client.responses.create(**ask, reasoning={"effort": "high"})
    assert high.usage.input_tokens > plain.usage.input_tokens


def test_free_output_comes_back_without_markers(client: openai.OpenAI) -> None:
    for seed in range(4):
        r = client.chat.completions.create(
            model=client.model, messages=ASK, max_tokens=40, temperature=1.0, seed=seed
        )
        message = r.choices[0].message
        reasoning = getattr(message, "reasoning_content", None) or ""
        for text in (message.content or "", reasoning):
            assert not any(m in text for m in ("<|channel|>", "<|message|>", "<|start|>"))
