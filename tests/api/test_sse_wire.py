"""The SSE stream byte by byte, as a raw HTTP client sees it."""

import json

from tests.factories import Server


def raw_events(server: Server, path: str, body: dict) -> tuple[bytes, list[bytes]]:
    with server.client() as c, c.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        data = b"".join(resp.iter_bytes())
    assert data.endswith(b"\n\n")
    return data, data[:-2].split(b"\n\n")


def test_completion_stream_wire_format(server: Server) -> None:
    body = {
        "prompt": "The quick brown fox",
        "max_tokens": 10,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    data, events = raw_events(server, "/v1/completions", body)
    assert all(e.startswith(b"data: ") and b"\n" not in e for e in events)
    assert events[-1] == b"data: [DONE]" and data.endswith(b"data: [DONE]\n\n")
    assert data.count(b"[DONE]") == 1
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    *deltas, usage_chunk = chunks
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 10
    assert usage_chunk["usage"]["total_tokens"] == usage_chunk["usage"]["prompt_tokens"] + 10
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("cmpl-")
    for c in deltas:
        assert c["object"] == "text_completion" and c["model"] == "kvserve-demo-random"
        (choice,) = c["choices"]
        assert set(choice) == {"index", "text", "logprobs", "finish_reason"}
        assert choice["text"] or choice["finish_reason"]  # empty deltas are skipped
    assert deltas[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in deltas[:-1])
    assert "usage" not in deltas[0]


def test_stream_without_usage_and_chat_chunks(server: Server) -> None:
    _, events = raw_events(
        server, "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "stream": True}
    )
    assert events[-1] == b"data: [DONE]"
    assert all("usage" not in json.loads(e[6:]) for e in events[:-1])
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
        "stream": True,
        "temperature": 0,
    }
    _, events = raw_events(server, "/v1/chat/completions", body)
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-1] == b"data: [DONE]"


def test_streamed_logprobs_cover_every_token(server: Server) -> None:
    """A token whose text is held back (half a UTF-8 character, or an id with no text)
    still has its logprob sent."""
    body = {
        "prompt": "日本語のテキスト 🙂",
        "max_tokens": 40,
        "temperature": 1.0,
        "seed": 3,
        "ignore_eos": True,
        "logprobs": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    _, events = raw_events(server, "/v1/completions", body)
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    tokens = sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks if c["choices"])
    assert tokens == chunks[-1]["usage"]["completion_tokens"] == 40
    chat = {
        "messages": [{"role": "user", "content": "🙂"}],
        "max_tokens": 25,
        "logprobs": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "seed": 4,
        "ignore_eos": True,
        "temperature": 1.0,
    }
    _, events = raw_events(server, "/v1/chat/completions", chat)
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    entries = sum(
        len(c["choices"][0]["logprobs"]["content"])
        for c in chunks
        if c["choices"] and c["choices"][0]["logprobs"]
    )
    assert entries == chunks[-1]["usage"]["completion_tokens"] == 25


def test_tokenize_matches_what_generation_uses(server: Server) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    with server.client() as c:
        tok = c.post("/tokenize", json={"prompt": "The quick brown fox"}).json()
        assert tok["tokens"] == [791, 4062, 14198, 39935] and tok["count"] == 4
        assert (
            c.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
            == "The quick brown fox"
        )
        chat_ids = c.post("/tokenize", json={"messages": messages}).json()
        chat = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
        assert chat_ids["count"] == chat["usage"]["prompt_tokens"]
        both = c.post("/tokenize", json={"prompt": "x", "messages": messages})
        assert both.status_code == 400 and both.json()["error"]["param"] == "prompt"
