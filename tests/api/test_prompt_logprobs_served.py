"""Prompt logprobs over HTTP with the official openai client: `echo` with `logprobs`
(max_tokens 0 and 1, as lm-evaluation-harness sends for loglikelihoods) gives the prompt's
tokens and their logprobs from a full forward, the same streamed, after the prompt was
cached, and vLLM's `prompt_logprobs` on completions and chat; max_tokens 0 without echo
is a 400 naming it."""

import httpx
import openai
import pytest
import torch

from model.weights import load_model
from tests.factories import Server, start_server, write_llama, write_tokenizer

PROMPT = "The quick brown fox jumps over the lazy dog, again and again"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("echo")
    write_llama(path, tied=False)
    write_tokenizer(path)
    server: Server = start_server(str(path), "--model", str(path), "--dtype", "float32")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}, timeout=30)
    yield client, path.name, load_model(path, torch.float32), r.json()["tokens"]
    server.stop()


def full_forward(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor(ids)).float(), dim=-1)


def test_echo_with_logprobs_scores_the_prompt(served) -> None:
    client, name, model, ids = served
    lp = full_forward(model, ids)
    client.completions.create(model=name, prompt=PROMPT, max_tokens=2, temperature=0)  # cached
    for max_tokens in (0, 1):
        resp = client.completions.create(
            model=name, prompt=PROMPT, max_tokens=max_tokens, echo=True, logprobs=2, temperature=0
        )
        c = resp.choices[0]
        n = len(ids) + max_tokens
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == n
        assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
        for i in range(1, len(ids)):
            assert abs(c.logprobs.token_logprobs[i] - lp[i - 1, ids[i]].item()) <= 1e-4
            # by token text: two byte pieces that decode alike share one key
            top2 = lp[i - 1].topk(2).values.tolist()
            values = c.logprobs.top_logprobs[i].values()
            assert 0 < len(values) <= 2
            assert all(min(abs(v - w) for w in top2) <= 1e-4 for v in values)
        assert c.text.startswith(PROMPT)
        assert resp.usage.completion_tokens == max_tokens
        assert resp.usage.prompt_tokens_details.cached_tokens == 0  # every token computed
        if max_tokens == 0:
            assert c.text == PROMPT and c.finish_reason == "length"

    stream = client.completions.create(
        model=name, prompt=PROMPT, max_tokens=3, echo=True, logprobs=2, temperature=0, stream=True
    )
    chunks = [ch.choices[0] for ch in stream if ch.choices]
    whole = client.completions.create(
        model=name, prompt=PROMPT, max_tokens=3, echo=True, logprobs=2, temperature=0
    ).choices[0]
    assert "".join(ch.text for ch in chunks) == whole.text
    streamed = [v for ch in chunks if ch.logprobs for v in ch.logprobs.token_logprobs]
    assert streamed == whole.logprobs.token_logprobs


def test_vllm_prompt_logprobs_on_completions_and_chat(served) -> None:
    client, name, model, ids = served
    lp = full_forward(model, ids)
    resp = client.completions.create(
        model=name, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 1}
    )
    got = resp.choices[0].model_extra["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    for i, entry in enumerate(got[1:], 1):
        own = entry[str(ids[i])]
        assert abs(own["logprob"] - lp[i - 1, ids[i]].item()) <= 1e-4
        assert own["rank"] == int((lp[i - 1] > lp[i - 1, ids[i]]).sum()) + 1
        assert str(int(lp[i - 1].argmax())) in entry  # the top alternative

    chat = client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=1,
        extra_body={"prompt_logprobs": 0},
    )
    scored = chat.model_extra["prompt_logprobs"]
    assert scored[0] is None and len(scored) == chat.usage.prompt_tokens
    assert all(len(e) == 1 for e in scored[1:])  # the token itself, no alternatives


def test_max_tokens_zero_needs_echo(served) -> None:
    client, name, _, _ = served
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=name, prompt=PROMPT, max_tokens=0)
    assert err.value.body["param"] == "max_tokens"
    assert "echo" in err.value.body["message"]
