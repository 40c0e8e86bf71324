"""Every error status in OpenAI's shape, and none of them disturbs other requests."""

import concurrent.futures
import json

import httpx
import pytest

from tests.factories import Server, start_server


def assert_error(
    resp: httpx.Response, status: int, param: str | None = None, code: str | None = None
) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param
    if code is not None:
        assert body["error"]["code"] == code
    return body["error"]


def stream_text(server: Server, prompt: str, n: int) -> str:
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
    text = ""
    with server.client() as c, c.stream("POST", "/v1/completions", json=body) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def test_error_matrix_leaves_others_untouched(server: Server) -> None:
    reference = stream_text(server, "A steady request", 40)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        busy = pool.submit(stream_text, server, "A steady request", 40)
        with server.client() as c:
            post = c.post
            assert_error(
                post("/v1/completions", json={"prompt": "x", "temperature": 5}), 400, "temperature"
            )
            assert_error(
                post("/v1/completions", json={"prompt": "x", "max_tokens": 0}), 400, "max_tokens"
            )
            assert_error(post("/v1/completions", json={"prompt": "x", "n": 99}), 400, "n")
            assert_error(post("/v1/completions", json={"temperature": 1}), 400, "prompt")
            assert_error(post("/v1/completions", json={"prompt": []}), 400, "prompt")
            assert_error(post("/v1/completions", json={"prompt": [1, 10**9]}), 400, "prompt")
            assert_error(
                post("/v1/completions", json={"prompt": "x", "suffix": "y"}), 400, "suffix"
            )
            assert_error(
                post(
                    "/v1/completions",
                    json={"prompt": "x", "stream_options": {"include_usage": True}},
                ),
                400,
                "stream_options",
            )
            assert_error(
                post("/v1/completions", json={"prompt": "x", "logit_bias": {"abc": 1}}),
                400,
                "logit_bias",
            )
            assert_error(
                post(
                    "/v1/completions",
                    content=b"{not json",
                    headers={"content-type": "application/json"},
                ),
                400,
            )
            long = assert_error(
                post("/v1/completions", json={"prompt": "hi " * 5000, "max_tokens": 10}),
                400,
                code="context_length_exceeded",
            )
            assert "4096" in long["message"] and "5" in long["message"]
            over = assert_error(
                post("/v1/completions", json={"prompt": "hi", "max_tokens": 5000}),
                400,
                code="context_length_exceeded",
            )
            assert "max_tokens" in over["message"]
            assert_error(post("/v1/chat/completions", json={"messages": []}), 400, "messages")
            assert_error(
                post(
                    "/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]}
                ),
                400,
            )
            assert_error(
                post(
                    "/v1/chat/completions",
                    json={
                        "messages": [{"role": "user", "content": "x"}],
                        "tools": [{"type": "function"}],
                    },
                ),
                400,
                "tools[0]",
            )
            for choice in ("auto", "required", {"type": "function", "function": {"name": "f"}}):
                body = {"messages": [{"role": "user", "content": "x"}], "tool_choice": choice}
                assert_error(post("/v1/chat/completions", json=body), 400, "tool_choice")
            body = {"messages": [{"role": "user", "content": "x"}], "tool_choice": "none"}
            assert post("/v1/chat/completions", json={**body, "max_tokens": 1}).status_code == 200
            assert_error(
                post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}),
                404,
                "model",
                "model_not_found",
            )
            assert_error(c.get("/v1/models/gpt-9"), 404, "model")
            assert_error(c.get("/v1/nothing-here"), 404)
            assert_error(post("/detokenize", json={"tokens": [-1]}), 400, "tokens")
            assert_error(post("/detokenize", json={"tokens": [791, 100256]}), 400, "tokens")
            assert_error(
                post(
                    "/v1/completions",
                    content=b"x" * (5 << 20),
                    headers={"content-type": "application/json"},
                ),
                413,
            )
        assert busy.result(timeout=60) == reference
    assert server.health()["status"] == "ok"
    assert server.wait_idle()["kv_cache"]["blocks_used"] == 0


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory):
    srv = start_server(str(tmp_path_factory.mktemp("auth")), "--api-keys", "key-one,key-two")
    yield srv
    srv.stop()


def test_api_keys(keyed: Server) -> None:
    good = {"Authorization": "Bearer key-one"}
    body = {"prompt": "A keyed request", "max_tokens": 40, "temperature": 0, "stream": True}

    def stream() -> str:
        text = ""
        with (
            keyed.client() as c,
            c.stream("POST", "/v1/completions", json=body, headers=good) as resp,
        ):
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    reference = stream()
    pool = concurrent.futures.ThreadPoolExecutor(1)
    busy = pool.submit(stream)
    with keyed.client() as c:
        assert_error(
            c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}),
            401,
            code="invalid_api_key",
        )
        bad = {"Authorization": "Bearer nope"}
        assert_error(
            c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=bad), 401
        )
        assert_error(c.get("/v1/models", headers={"Authorization": "Basic key-one"}), 401)
        for key in ("key-one", "key-two"):
            ok = c.post(
                "/v1/completions",
                json={"prompt": "x", "max_tokens": 1},
                headers={"Authorization": f"Bearer {key}"},
            )
            assert ok.status_code == 200
        assert c.get("/health").status_code == 200  # open by default
        assert c.get("/").status_code == 200
        assert c.get("/metrics").status_code == 200
    assert busy.result(timeout=60) == reference  # the 401s did not disturb it
    pool.shutdown()
    assert keyed.health()["status"] == "ok"


def test_every_per_request_list_is_bounded(server: Server) -> None:
    """Each list a request sends is capped, and going over names the parameter (400)."""
    completions = {
        "logit_bias": {str(i): 1.0 for i in range(301)},  # OpenAI's cap is 300
        "stop": [f"s{i}" for i in range(17)],
        "stop_token_ids": list(range(257)),
        "cache_salt": "",
    }
    with server.client() as c:
        for param, value in completions.items():
            resp = c.post("/v1/completions", json={"prompt": "x", param: value})
            assert_error(resp, 400, param)
        assert_error(
            c.post("/v1/completions", json={"prompt": "x", "stop": "s" * 513}), 400, "stop"
        )
        assert_error(c.post("/v1/completions", json={"prompt": ["a"] * 129}), 400, "prompt")
        messages = [{"role": "user", "content": "hi"}] * 1025
        assert_error(c.post("/v1/chat/completions", json={"messages": messages}), 400, "messages")
        # at the caps, accepted
        ok = {
            "prompt": "x",
            "max_tokens": 2,
            "logit_bias": {str(i): 1.0 for i in range(300)},
            "stop": [f"s{i}" for i in range(16)],
            "cache_salt": "tenant-1",
        }
        assert c.post("/v1/completions", json=ok).status_code == 200


def test_metrics_auth_puts_metrics_behind_the_keys(tmp_path) -> None:
    srv = start_server(str(tmp_path), "--api-keys", "key-one", "--metrics-auth")
    try:
        with srv.client() as c:
            assert_error(c.get("/metrics"), 401, code="invalid_api_key")
            ok = c.get("/metrics", headers={"Authorization": "Bearer key-one"})
            assert ok.status_code == 200 and "kvserve_model_info" in ok.text
            assert c.get("/health").status_code == 200  # probes stay open
    finally:
        srv.stop()


def test_errors_a_new_user_hits(server: Server) -> None:
    """Wrong method, wrong content type, broken JSON, an empty prompt in either form,
    and the browser's favicon request."""
    with server.client() as c:
        wrong = assert_error(c.get("/v1/completions"), 405, code="method_not_allowed")
        assert wrong["type"] == "invalid_request_error" and "POST" in wrong["message"]
        for kind, body in (("text/plain", "hello"), ("application/x-www-form-urlencoded", "a=1")):
            err = assert_error(
                c.post("/v1/completions", content=body, headers={"content-type": kind}), 415
            )
            assert kind in err["message"] and err["type"] == "invalid_request_error"
        broken = c.post(
            "/v1/completions",
            content=b'{"prompt": "x",',
            headers={"content-type": "application/json"},
        )
        assert assert_error(broken, 400)["param"] is None
        empty = [
            assert_error(c.post("/v1/completions", json={"prompt": p}), 400, "prompt")["message"]
            for p in ("", [])
        ]
        assert empty[0] == empty[1] == "prompt: must not be empty"
        icon = c.get("/favicon.ico")
        assert icon.status_code == 200 and icon.headers["content-type"].startswith("image/svg")
