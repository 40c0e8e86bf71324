"""A Qwen3 checkpoint with a byte-level tokenizer carrying ChatML's markers and `<think>`,
and Qwen3's chat template (without its tool branches): the prompt ids of a conversation
whose earlier answer thought aloud (the template drops that thinking) are transformers'
own `apply_chat_template`, the markers encode as single tokens, and a streamed chat is the
whole."""

import json
from pathlib import Path

import httpx
import openai
import pytest

from tests.factories import start_server, write_qwen3

pytestmark = pytest.mark.slow

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
QWEN3_TEMPLATE = """\
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""
MESSAGES = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "<think>\nTwo and two.\n</think>\n\nFour."},
    {"role": "user", "content": "And héllo in 日本語? 🙂"},
]


def write_chatml_tokenizer(path: Path) -> None:
    """A byte-level BPE (the 256 bytes, merges) with Qwen's markers as special tokens,
    and a tokenizer_config.json as Qwen3's: no BOS, <|im_end|> ends a turn."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=360,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    hf.train_from_iterator(["what is two and four, briefly answered"] * 50, trainer)
    hf.save(str(path / "tokenizer.json"))
    config = {
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "chat_template": QWEN3_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def test_qwen3_chatml_prompt_ids_are_transformers(tmp_path: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    write_qwen3(tmp_path)
    write_chatml_tokenizer(tmp_path)
    reference = PreTrainedTokenizerFast(
        tokenizer_file=str(tmp_path / "tokenizer.json"), eos_token="<|im_end|>"
    )
    reference.chat_template = QWEN3_TEMPLATE
    expected = reference.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    expected = expected if isinstance(expected, list) else expected["input_ids"]
    text = reference.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert "Two and two" not in text  # the earlier answer's thinking is dropped
    markers = {reference.convert_tokens_to_ids(t) for t in SPECIALS[1:3]}
    assert markers <= set(expected)
    server = start_server(str(tmp_path), "--model", str(tmp_path))
    try:
        ids = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()["tokens"]
        assert ids == expected
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        chat = {"model": model, "messages": MESSAGES, "max_tokens": 16, "temperature": 0}
        whole = client.chat.completions.create(**chat)
        assert whole.usage.prompt_tokens == len(expected)
        chunks = client.chat.completions.create(**chat, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == whole.choices[0].message.content
    finally:
        assert server.stop() == 0
