"""An AWQ checkpoint served as vLLM users start it (`kvserve serve FOLDER`, its
quantization_config read from config.json): the official client's completion is the
greedy text of the checkpoint's model loaded in-process, and `--quantization int4` serves
it too."""

from pathlib import Path

import openai
import torch

from model.generate import generate
from model.tokenizer import Tokenizer
from model.weights import load_model
from tests.factories import start_server, write_llama, write_tokenizer
from tests.int_checkpoints import write_packed
from tests.model.backends import auto_backend


def test_an_awq_checkpoint_serves_its_weights(tmp_path: Path) -> None:
    write_llama(tmp_path / "hf", tied=False, hidden_size=128, intermediate_size=256)
    write_tokenizer(tmp_path / "hf")
    path = tmp_path / "tiny-AWQ"
    write_packed(tmp_path / "hf", path, "awq", group=64)
    ours = load_model(path)
    prompt = "the quick brown fox"
    tokenizer = Tokenizer.from_dir(path)
    ids = tokenizer.encode(prompt)
    want = list(generate(ours, ids, 8, backend=auto_backend(ours.cfg, torch.float32)))
    for flags in (["--dtype", "float32"], ["--dtype", "bfloat16", "--quantization", "int4"]):
        server = start_server(str(tmp_path), "--model", str(path), *flags)
        try:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
            assert [m.id for m in client.models.list().data] == ["tiny-AWQ"]
            r = client.completions.create(
                model="tiny-AWQ", prompt=prompt, max_tokens=8, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert r.usage.completion_tokens == 8
            if "float32" in flags:  # int4 rounds again: its text may differ
                assert r.choices[0].text == tokenizer.decode(want)
        finally:
            server.stop()
