"""Checkpoints whose tokenizer is SentencePiece-style (model/sentencepiece.py), served and
called through the official openai client: a Mistral with Mistral v0.3's Metaspace
tokenizer and `[INST]` template, and Llamas with Phi-3's tokenizer and `<|user|>` turns and
with Gemma's tokenizer and turn template. The prompt ids are transformers' own
`apply_chat_template`; streamed text is the whole."""

from pathlib import Path

import httpx
import openai
import pytest

from tests.factories import start_server, write_llama, write_mistral
from tests.sentencepiece_files import write

pytestmark = pytest.mark.slow

MISTRAL_TEMPLATE = (  # Mistral-7B-Instruct's
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% endif %}{% endfor %}"
)
GEMMA_TEMPLATE = (  # Gemma's
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)
PHI3_TEMPLATE = (  # Phi-3-mini-instruct's
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{'<|system|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)
FAMILIES = {
    "mistral": ("metaspace", MISTRAL_TEMPLATE, lambda p: write_mistral(p, vocab_size=400)),
    "phi3": ("phi3", PHI3_TEMPLATE, lambda p: write_llama(p, tied=True, vocab_size=400)),
    "gemma_tokenizer": (
        "gemma",
        GEMMA_TEMPLATE,
        lambda p: write_llama(p, tied=True, vocab_size=400),
    ),
}
MESSAGES = [
    {"role": "user", "content": "Héllo there — how are you? 🙂"},
    {"role": "assistant", "content": "Fine, thank you."},
    {"role": "user", "content": "Write one line about 日本."},
]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_chat_prompt_ids_are_transformers_and_streams_are_whole(
    family: str, tmp_path: Path
) -> None:
    from transformers import PreTrainedTokenizerFast

    form, template, write_model = FAMILIES[family]
    write_model(tmp_path)
    lib = write(tmp_path, form, 400, chat_template=template)
    bos, eos = ("<bos>", "<eos>") if form == "gemma" else ("<s>", "</s>")
    reference = PreTrainedTokenizerFast(
        tokenizer_file=str(tmp_path / "tokenizer.json"), bos_token=bos, eos_token=eos
    )
    reference.chat_template = template
    expected = reference.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    expected = expected if isinstance(expected, list) else expected["input_ids"]
    server = start_server(str(tmp_path), "--model", str(tmp_path))
    try:
        ids = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()["tokens"]
        assert ids == expected
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        chat = {"model": model, "messages": MESSAGES, "max_tokens": 24, "temperature": 0}
        whole = client.chat.completions.create(**chat).choices[0].message.content
        chunks = client.chat.completions.create(**chat, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == whole  # random weights: lone byte pieces come out as U+FFFD, alike
        # a prompt echoed is its text as sent; prompt ids echoed are their decode
        text = "Ünïcödé 🎉 and plain words"
        done = client.completions.create(
            model=model, prompt=text, max_tokens=4, temperature=0, echo=True
        )
        prompt_ids = [lib.token_to_id(bos), *lib.encode(text, add_special_tokens=False).ids]
        assert done.choices[0].text.startswith(text)
        assert done.usage.prompt_tokens == len(prompt_ids)
        done = client.completions.create(
            model=model, prompt=prompt_ids[1:], max_tokens=4, temperature=0, echo=True
        )
        assert done.choices[0].text.startswith(lib.decode(prompt_ids[1:]))
    finally:
        assert server.stop() == 0
