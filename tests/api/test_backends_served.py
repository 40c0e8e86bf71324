"""`kvserve serve --attention-backend triton` (Triton's interpreter on the CPU) against
`--attention-backend cpu` on a checkpoint transformers wrote: the same greedy tokens
over HTTP. Gemma 2's: grouped K/V heads, windowed layers beside global ones and
soft-capped scores and logits. Every family's logits on each backend, with every kind of
attention the kernels take (a partial rotation, windows beside global layers, sandwich
norms), are tests/model/test_hf_parity.py's, in process."""

from pathlib import Path

import httpx
import pytest

from tests.factories import (
    start_server,
    write_gemma2,
    write_llama,
    write_tokenizer,
)
from tests.model.backends import make_backend

pytestmark = [pytest.mark.slow, pytest.mark.interpreter]

WRITERS = {"gemma2_softcaps": write_gemma2}


@pytest.mark.parametrize("family", list(WRITERS))
def test_triton_serves_the_cpu_backends_tokens(family: str, tmp_path: Path) -> None:
    hf = WRITERS[family](tmp_path)
    write_tokenizer(tmp_path)
    from model.config import ModelConfig

    for name in ("cpu", "triton"):  # skip (or fail where required) saying what is missing
        make_backend(name, ModelConfig.from_hf_config(hf.config.to_dict()))
    prompt = [(7 * i + 3) % 290 for i in range(40)]
    body = {
        "model": tmp_path.name,
        "prompt": prompt,
        "max_tokens": 20,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 1,
    }
    answers = {}
    # both servers start side by side; float32: the backends' arithmetic, not bf16
    # rounding, compared
    flags = ["--model", str(tmp_path), "--dtype", "float32"]
    servers = {
        name: start_server(str(tmp_path), *flags, "--attention-backend", name, wait=False)
        for name in ("cpu", "triton")
    }
    try:
        for name, srv in servers.items():
            with httpx.Client(base_url=srv.wait_healthy().url, timeout=300) as c:
                card = c.get(f"/v1/models/{tmp_path.name}").json()
                assert card["memory"]["attention_backend"]["name"] == name
                assert card["architecture"] == hf.config.architectures[0]
                assert card["features"] == ModelConfig.from_hf_config(hf.config.to_dict()).features
                r = c.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                choice = r.json()["choices"][0]
                answers[name] = (choice["text"], choice["logprobs"]["token_logprobs"])
            assert "attention backend " + name in Path(srv.log_path).read_text()
    finally:
        for srv in servers.values():
            srv.stop()
    (cpu_text, cpu_lp), (tr_text, tr_lp) = answers["cpu"], answers["triton"]
    assert tr_text == cpu_text and len(tr_lp) == 20
    assert max(abs(a - b) for a, b in zip(cpu_lp, tr_lp)) < 1e-3


def test_int8_weights_serve_and_say_so(tmp_path: Path) -> None:
    """`kvserve serve --quantization int8`: bf16 activations picked by --dtype auto, the
    weights named in the start-up line, the model card and kvserve_model_info."""
    write_llama(tmp_path, tied=True, intermediate_size=128)
    write_tokenizer(tmp_path)
    srv = start_server(str(tmp_path), "--model", str(tmp_path), "--quantization", "int8")
    try:
        with httpx.Client(base_url=srv.url, timeout=300) as c:
            memory = c.get(f"/v1/models/{tmp_path.name}").json()["memory"]
            assert memory["quantization"] == "int8" and memory["dtype"] == "bfloat16"
            body = {"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
            assert 'quantization="int8"' in c.get("/metrics").text
        assert "weights int8" in Path(srv.log_path).read_text()
    finally:
        srv.stop()
