"""A Qwen3 checkpoint whose tokenizer keeps `<think>` and `</think>` in its text (as
Qwen3's does) behind Qwen3's chat template, over HTTP with the openai client: the thinking
in `reasoning_content` (and `reasoning`) apart from `content`, streamed deltas equal to the
whole, `chat_template_kwargs` passed to the template (`enable_thinking: false` closes the
block in the prompt; a template variable of the test's opens it, as DeepSeek-R1's
template does), a thinking budget that closes the block after that many tokens, and
structured output held from the block's end on (the thinking free, the answer valid)."""

import json

import jsonschema
import openai
import pytest

from tests.api.test_chatml_served import QWEN3_TEMPLATE
from tests.factories import start_server, write_qwen3, write_qwen_tokenizer

pytestmark = pytest.mark.slow

# DeepSeek-R1's kind of generation prompt: the block opened for the model
TEMPLATE = QWEN3_TEMPLATE + (
    "\n{%- if add_generation_prompt and open_thinking is defined and open_thinking %}"
    "{{- '<think>\\n' }}{%- endif %}"
)
ASK = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("qwen3-think")
    write_qwen3(path)
    write_qwen_tokenizer(path, TEMPLATE, "what is two and four, thinking briefly")
    server = start_server(str(path), "--model", str(path))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    yield client, client.models.list().data[0].id
    assert server.stop() == 0


def streamed(client, **kw) -> tuple[str, str]:
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(**kw, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            extra = delta.model_extra or {}
            assert extra.get("reasoning_content") == extra.get("reasoning")
            reasoning += extra.get("reasoning_content") or ""
            content += delta.content or ""
    return reasoning, content


def test_a_thinking_budget_closes_the_block(served) -> None:
    client, model = served
    kw = dict(
        model=model, messages=ASK, max_tokens=12, temperature=0, extra_body={
            "chat_template_kwargs": {"open_thinking": True}, "max_thinking_tokens": 5,
            "ignore_eos": True}, logprobs=True,
    )  # fmt: skip
    whole = client.chat.completions.create(**kw)
    message = whole.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert message.model_extra["reasoning"] == reasoning
    # five tokens of thinking, the end marker forced (no logprob: not sampled), the answer
    sampled = whole.choices[0].logprobs.content
    thought = b"".join(bytes(e.bytes) for e in sampled[:5]).decode("utf-8", "replace")
    assert reasoning == thought
    assert whole.usage.completion_tokens == 12 and len(sampled) == 11
    answer = b"".join(bytes(e.bytes) for e in sampled[5:]).decode("utf-8", "replace")
    assert message.content == answer.lstrip("\n")
    assert streamed(client, **{k: v for k, v in kw.items() if k != "logprobs"}) == (
        reasoning,
        message.content,
    )


def test_template_kwargs_and_a_block_left_open(served) -> None:
    client, model = served
    plain = client.chat.completions.create(model=model, messages=ASK, max_tokens=1)
    closed = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    assert closed.usage.prompt_tokens > plain.usage.prompt_tokens  # <think>\n\n</think>\n\n
    kw = dict(
        model=model, messages=ASK, max_tokens=10, temperature=0,
        extra_body={"chat_template_kwargs": {"open_thinking": True}, "ignore_eos": True},
    )  # fmt: skip
    whole = client.chat.completions.create(**kw).choices[0].message
    reasoning = whole.model_extra["reasoning_content"]
    assert reasoning  # the block was open: the output thinks until it closes it
    assert streamed(client, **kw) == (reasoning, whole.content)
    hidden = (
        client.chat.completions.create(
            **{**kw, "extra_body": {**kw["extra_body"], "include_reasoning": False}}
        )
        .choices[0]
        .message
    )
    assert "reasoning_content" not in (hidden.model_extra or {})
    assert hidden.content == whole.content


ANSWER = {"type": "object", "properties": {"sum": {"type": "integer", "maximum": 99}},
          "required": ["sum"],
          "additionalProperties": False}  # fmt: skip


@pytest.mark.parametrize("seed", [1, 2])
def test_structured_output_holds_after_the_thinking(served, seed: int) -> None:
    """The schema applies to the answer alone: the thinking (five tokens, at temperature
    1, then the forced end marker) is free text, the content valid JSON, alike streamed."""
    client, model = served
    kw = dict(
        model=model, messages=ASK, max_tokens=40, temperature=1.0, seed=seed,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "answer", "schema": ANSWER}},
        extra_body={"chat_template_kwargs": {"open_thinking": True}, "max_thinking_tokens": 5},
    )  # fmt: skip
    whole = client.chat.completions.create(**kw).choices[0]
    reasoning = whole.message.model_extra["reasoning_content"]
    assert reasoning and whole.finish_reason == "stop"
    jsonschema.validate(json.loads(whole.message.content), ANSWER)
    assert streamed(client, **kw) == (reasoning, whole.message.content)
    # a block the template closed: the answer from the first token
    closed = client.chat.completions.create(**{**kw, "extra_body": {
        "chat_template_kwargs": {"enable_thinking": False}}}).choices[0]  # fmt: skip
    assert "reasoning_content" not in (closed.message.model_extra or {})
    jsonschema.validate(json.loads(closed.message.content), ANSWER)
    # a required tool call, the same way: after the thinking
    tool = {"type": "function", "function": {"name": "answer", "parameters": ANSWER}}
    called = client.chat.completions.create(**{
        **{k: v for k, v in kw.items() if k != "response_format"},
        "tools": [tool], "tool_choice": "required", "parallel_tool_calls": False,
        "max_tokens": 150}).choices[0]  # fmt: skip
    assert called.message.model_extra["reasoning_content"]
    assert called.finish_reason == "tool_calls" and len(called.message.tool_calls) == 1
    jsonschema.validate(json.loads(called.message.tool_calls[0].function.arguments), ANSWER)


def test_bad_template_kwargs_and_budgets(served) -> None:
    client, model = served
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=model, messages=ASK, extra_body={"chat_template_kwargs": {"messages": []}}
        )
    assert err.value.body["param"] == "chat_template_kwargs"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=model, messages=ASK, extra_body={"thinking_token_budget": 0}
        )
    assert "thinking_token_budget" in str(err.value.body)
