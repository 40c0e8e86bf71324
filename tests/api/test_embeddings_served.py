"""/v1/embeddings over HTTP with the official openai client (which asks for base64) and
plain JSON (floats): each input's embedding is transformers' final hidden state of it,
pooled (the last token's, and with --pooling mean the mean) and normalised, in fp32;
`dimensions` other than the model's and empty inputs are 400s naming the parameter."""

import httpx
import openai
import pytest
import torch

from tests.factories import start_server, write_qwen3, write_tokenizer

pytestmark = pytest.mark.slow

TEXTS = ["The quick brown fox", "jumps over the lazy dog, again and again", "a"]


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_are_transformers_pooled_states(pooling: str, tmp_path) -> None:
    hf = write_qwen3(tmp_path)
    write_tokenizer(tmp_path)
    server = start_server(
        str(tmp_path), "--model", str(tmp_path), "--dtype", "float32", "--pooling", pooling
    )
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        resp = client.embeddings.create(model=model, input=TEXTS)  # base64 on the wire
        assert [d.index for d in resp.data] == [0, 1, 2]
        plain = httpx.post(
            f"{server.url}/v1/embeddings",
            json={"model": model, "input": TEXTS, "encoding_format": "float"},
            timeout=60,
        ).json()
        for text, got, floats in zip(TEXTS, resp.data, plain["data"], strict=True):
            ids = httpx.post(f"{server.url}/tokenize", json={"prompt": text}).json()["tokens"]
            with torch.no_grad():
                h = hf.model(torch.tensor([ids])).last_hidden_state[0].float()
            want = torch.nn.functional.normalize(h.mean(0) if pooling == "mean" else h[-1], dim=0)
            assert len(got.embedding) == hf.config.hidden_size
            assert (torch.tensor(got.embedding) - want).abs().max().item() <= 1e-4
            assert floats["embedding"] == pytest.approx(got.embedding, abs=1e-6)
        assert resp.usage.prompt_tokens == plain["usage"]["total_tokens"] > 0
        with pytest.raises(openai.BadRequestError) as err:
            client.embeddings.create(model=model, input="x", dimensions=8)
        assert err.value.body["param"] == "dimensions"
        with pytest.raises(openai.BadRequestError) as err:
            client.embeddings.create(model=model, input=["a", ""])
        assert err.value.body["param"] == "input"
        # the whole context is the input's: no token is generated, none is asked for
        limit = client.models.list().data[0].max_model_len
        full = client.embeddings.create(model=model, input=[[5] * limit])
        assert full.usage.prompt_tokens == limit
        with pytest.raises(openai.BadRequestError) as err:
            client.embeddings.create(model=model, input=[[5] * (limit + 1)])
        body = err.value.body
        assert body["param"] == "input" and body["code"] == "context_length_exceeded"
        assert "max_tokens" not in body["message"] and f"{limit + 1} tokens" in body["message"]
    finally:
        assert server.stop() == 0
