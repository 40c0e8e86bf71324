"""gpt-oss's harmony through the official client, on a gpt-oss checkpoint (random
weights) behind a harmony template and tokenizer: a named tool_choice is held to a call
on the commentary channel and answered as a tool call (whole and streamed: the same
call for the same seed), reasoning_effort reaches the template, and whatever the free
model writes comes back without harmony's markers; the same as a GGUF file (its experts
in MXFP4), whose harmony ends the server finds by their text."""

import json

import openai
import pytest

from model.gguf import open_gguf
from model.weights import load_config
from tests.api.test_tools_served import TOOLS as TOOLS_SERVED
from tests.factories import GPT_OSS_ROPE, start_server, write_gpt_oss, write_harmony_tokenizer
from tests.gguf_files import gpt_oss_types, write_gguf

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


@pytest.fixture(scope="module", params=["safetensors", "gguf"])
def client(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("gpt-oss")
    rope = GPT_OSS_ROPE | {"original_max_position_embeddings": 256}  # the tools' JSON is long
    write_gpt_oss(path, max_position_embeddings=1024, rope_parameters=rope)
    write_harmony_tokenizer(path, TEMPLATE, 'commentary to=functions.get_weather {"city": "x"}')
    model = path
    if request.param == "gguf":
        model = write_gguf(path, path / "gpt-oss.gguf", gpt_oss_types)
    server = start_server(str(path), "--model", str(model))
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


def test_a_gguf_file_ends_its_turns_at_harmonys_ends(tmp_path) -> None:
    """A gpt-oss GGUF holds one eos (<|return|>); generation also ends at <|call|>, as the
    checkpoint's generation_config says and llama.cpp's loader finds by its text."""
    write_gpt_oss(tmp_path)
    write_harmony_tokenizer(tmp_path, TEMPLATE, "commentary")
    path = write_gguf(tmp_path, tmp_path / "gpt-oss.gguf", gpt_oss_types)
    tokens = open_gguf(path).field("tokenizer.ggml.tokens")
    ends = {tokens.index("<|return|>"), tokens.index("<|call|>")}
    assert open_gguf(path).field("tokenizer.ggml.eos_token_id") == tokens.index("<|return|>")
    assert set(load_config(path).eos_token_ids) == ends
