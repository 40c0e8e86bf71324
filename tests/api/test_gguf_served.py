"""A GGUF file served (`kvserve serve model.gguf`): its name without .gguf is the model id,
the tokenizer and the chat template come from its metadata, and the official client's
completion is the greedy text of the file's model loaded in-process."""

from pathlib import Path

import openai
import torch

from model.generate import generate
from model.tokenizer import Tokenizer
from model.weights import load_model
from tests.factories import start_server, write_llama, write_tokenizer
from tests.gguf_files import write_gguf
from tests.model.backends import auto_backend

CHATML = (
    "{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
)


def test_a_gguf_file_serves_its_own_tokenizer_template_and_weights(tmp_path: Path) -> None:
    write_llama(tmp_path / "hf", tied=False)
    write_tokenizer(tmp_path / "hf")
    path = write_gguf(tmp_path / "hf", tmp_path / "tiny-Q4_0.gguf", template=CHATML)
    ours = load_model(path)
    prompt = "the quick brown fox"
    server = start_server(str(tmp_path), "--model", str(path), "--dtype", "float32")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny-Q4_0"]
        r = client.completions.create(
            model="tiny-Q4_0", prompt=prompt, max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        tokenizer = Tokenizer.from_dir(path)
        ids = tokenizer.encode(prompt)
        want = list(generate(ours, ids, 8, backend=auto_backend(ours.cfg, torch.float32)))
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 8
        assert r.choices[0].text == tokenizer.decode(want)
        chat = client.chat.completions.create(
            model="tiny-Q4_0", messages=[{"role": "user", "content": "the lazy dog"}],
            max_tokens=4, temperature=0,
        )  # fmt: skip
        rendered = "<|bos|>user\nthe lazy dog<|eos|>\n<|bos|>assistant\n"
        assert chat.usage.prompt_tokens == len(tokenizer.encode(rendered))
    finally:
        server.stop()
