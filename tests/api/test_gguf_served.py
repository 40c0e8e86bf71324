"""A GGUF file served (`kvserve serve model.gguf`): its name without .gguf is the model id,
the tokenizer and the chat template come from its metadata, and the official client's
completion is the greedy text of the file's model loaded in-process; by default each of
its tensors is held in the kind that keeps its values."""

from pathlib import Path

import httpx
import openai
import pytest
import torch

from model.audit import audit
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


def test_a_4bit_gguf_serves_in_its_own_kinds_by_default(tmp_path: Path) -> None:
    """Default flags on the CPU: bf16, and --quantization auto keeps the file's Q4_0 and
    Q4_1 tensors int4, Q5_0 int5, the F16 head bf16 (its Q8_0 table is the lookup's); the card, the start-up line
    and kvserve_model_info say so, the memory audit counts the bytes as held (less than
    the weights in bf16), and the completion is the greedy text of the file's model
    packed so in-process."""
    write_llama(tmp_path / "hf", tied=False)
    write_tokenizer(tmp_path / "hf")
    path = write_gguf(tmp_path / "hf", tmp_path / "tiny-Q4_0.gguf")
    ours = load_model(path, torch.bfloat16)
    backend = auto_backend(ours.cfg, torch.bfloat16)
    backend.prepare(ours, "auto")
    held = backend.held_bytes(ours)
    server = start_server(str(tmp_path), "--model", str(path))
    try:
        with httpx.Client(base_url=server.url, timeout=300) as c:
            card = c.get("/v1/models/tiny-Q4_0").json()
            memory = card["memory"]
            linears = memory["attention_backend"]["linears"]
            assert (memory["quantization"], memory["dtype"]) == ("auto", "bfloat16")
            assert linears == backend.describe()["linears"]
            assert set(linears) == {"int4", "int5", "bf16"}
            assert memory["weight_bytes"] == held < audit(ours.cfg, "bfloat16").weight_bytes
            floors = memory["floors"]  # a step reads the head, and of the lookup table a row
            read = floors["decode_floor_ms_per_token"] * floors["bandwidth_gb_s"] * 1e6
            table = ours.cfg.vocab_size * ours.cfg.d_model * 2
            assert read == pytest.approx(held - table, rel=1e-6)
            body = {"prompt": "the quick brown fox", "max_tokens": 8, "temperature": 0,
                    "ignore_eos": True}  # fmt: skip
            r = c.post("/v1/completions", json=body)
            assert 'quantization="auto"' in c.get("/metrics").text
        tokenizer = Tokenizer.from_dir(path)
        want = list(generate(ours, tokenizer.encode(body["prompt"]), 8, backend=backend))
        assert r.json()["choices"][0]["text"] == tokenizer.decode(want)
        assert "weights auto" in Path(server.log_path).read_text()
    finally:
        server.stop()


def test_a_4bit_gguf_on_the_triton_backend_keeps_its_4_bit_groups_in_int4(tmp_path: Path) -> None:
    """`--attention-backend triton` (its kernels in the interpreter here, a GPU's there):
    --quantization auto holds the file's 4-bit tensors (Q4_0, Q4_1) int4 on the W4A16
    kernel and every other one in the serving dtype; the card counts them and their bytes
    as held, and the completion is the greedy text of the file's model prepared so
    in-process."""
    from tests.model.backends import make_backend

    write_llama(tmp_path / "hf", tied=False)
    write_tokenizer(tmp_path / "hf")
    path = write_gguf(tmp_path / "hf", tmp_path / "tiny-Q4_0.gguf")
    ours = load_model(path, torch.float32)
    backend = make_backend("triton", ours.cfg)
    assert backend.prepare(ours, "auto")
    server = start_server(str(tmp_path), "--model", str(path), "--attention-backend", "triton",
                          "--dtype", "float32")  # fmt: skip
    try:
        with httpx.Client(base_url=server.url, timeout=300) as c:
            memory = c.get("/v1/models/tiny-Q4_0").json()["memory"]
            linears = memory["attention_backend"]["linears"]
            assert linears == backend.describe()["linears"]
            assert set(linears) == {"int4", "torch"}
            assert memory["quantization"] == "auto"
            assert memory["weight_bytes"] == backend.held_bytes(ours)
            body = {"prompt": "the quick brown fox", "max_tokens": 8, "temperature": 0,
                    "ignore_eos": True}  # fmt: skip
            r = c.post("/v1/completions", json=body)
        tokenizer = Tokenizer.from_dir(path)
        want = list(generate(ours, tokenizer.encode(body["prompt"]), 8, backend=backend))
        assert r.json()["choices"][0]["text"] == tokenizer.decode(want)
    finally:
        server.stop()
