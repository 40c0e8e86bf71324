"""Fuzzing the HTTP API from its own OpenAPI schema (schemathesis strategies, positive and
negative) and with hand-made hostile bodies: never a 5xx, always the OpenAI error shape."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.factories import Server
from tests.reliability.conftest import Row, harness

pytestmark = pytest.mark.reliability  # make test-fast leaves these out

EXAMPLES = 70  # per operation and mode; hypothesis stops early where the space is small
# the same cases every run (a red CI is a change's doing, not a new draw); `make fuzz`
# (KVSERVE_FUZZ=random) draws new ones to look for what the fixed set misses
RANDOM = os.environ.get("KVSERVE_FUZZ") == "random"
DRAWS = {
    "database": None,
    "deadline": None,
    "derandomize": not RANDOM,
    "suppress_health_check": list(HealthCheck),
}
BODY_LIMIT = 64 * 1024
VOCAB = 100277  # the demo model's (cl100k_base)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # with the engine in a thread only: what is fuzzed is the front's parsing and checks,
    # the same code in either transport (what crosses is a checked request)
    srv = harness(
        tmp_path_factory.mktemp("fuzz"),
        "--max-model-len",
        "48",
        "--max-body-bytes",
        str(BODY_LIMIT),
    )
    yield srv
    srv.stop()


class Tally:
    def __init__(self, client: httpx.Client) -> None:
        self.client = client
        self.statuses: Counter[int] = Counter()
        self.problems: list[str] = []

    def send(self, method: str, url: str, **kw: object) -> None:
        resp = self.client.request(method, url, **kw)  # type: ignore[arg-type]
        self.statuses[resp.status_code] += 1
        sent = str(kw.get("json", kw.get("content", kw.get("params", ""))))[:200]
        if problem := check(resp):
            self.problems.append(f"{method} {url} {sent!r}: {problem}")

    @property
    def total(self) -> int:
        return sum(self.statuses.values())


def check(resp: httpx.Response) -> str | None:
    """What is wrong with this response, if anything."""
    if resp.status_code >= 500:
        return f"{resp.status_code}: {resp.text[:300]}"
    if resp.status_code >= 400:
        try:
            err = resp.json()["error"]
        except (ValueError, KeyError, TypeError):
            return f"{resp.status_code} not in the OpenAI error shape: {resp.text[:300]}"
        if not (isinstance(err.get("message"), str) and err["message"]):
            return f"error without a message: {err}"
        if not isinstance(err.get("type"), str) or "param" not in err or "code" not in err:
            return f"error lacks type/param/code: {err}"
        return None
    if resp.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
        if "/v1/responses" in str(resp.url):  # the Responses API ends on its last event
            ends = ('{"type": "response.completed"', '{"type": "response.incomplete"')
            if not events or not events[-1].startswith(ends):
                return f"a Responses stream did not end complete: {resp.text[-300:]}"
            return None
        if not events or events[-1] != "[DONE]":
            return f"stream did not end with [DONE]: {resp.text[-300:]}"
        if any('"error"' in e for e in events[:-1] if e.startswith('{"error"')):
            return f"error event in a stream: {resp.text[-300:]}"
    return None


def schema_cases(server: Server, tally: Tally) -> dict[str, int]:
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    model_id = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    per_op: dict[str, int] = {}
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            before = tally.total

            @given(op.as_strategy(mode), st.booleans())
            @settings(max_examples=EXAMPLES, **DRAWS)
            def run(case: schemathesis.Case, own_model: bool) -> None:
                kw = case.as_transport_kwargs(base_url=server.url)
                if own_model and isinstance(kw.get("json"), dict) and "model" in kw["json"]:
                    kw["json"]["model"] = model_id  # else nearly every case stops at a 404
                body = {"json": kw["json"]} if "json" in kw else {"content": kw.get("data")}
                headers = {k: v for k, v in kw["headers"].items() if k != "Connection"}
                tally.send(kw["method"], kw["url"], params=kw["params"], headers=headers, **body)

            try:
                run()
            except Unsatisfiable:  # nothing to negate (a route without parameters or body)
                continue
            per_op[f"{op.label} {mode.value}"] = tally.total - before
    return per_op


huge_ints = st.sampled_from([-1, 0, -(2**31), 2**31, 2**63, 2**64, 10**30])
odd_numbers = st.one_of(huge_ints, st.floats(allow_nan=False), st.sampled_from([1e308, -1e308]))
token_lists = st.lists(
    st.one_of(st.integers(0, VOCAB - 1), huge_ints, st.just(VOCAB)), min_size=0, max_size=8
)
prompts = st.one_of(
    st.text(max_size=40),
    st.just(""),
    st.just([]),
    st.just("word " * 200),  # far more tokens than the 48-token context
    token_lists,
    st.lists(token_lists, max_size=3),
    st.just("\ud800 lone surrogate"),
)
fields = st.fixed_dictionaries(
    {"prompt": prompts},
    optional={
        k: odd_numbers
        for k in (
            "max_tokens",
            "temperature",
            "top_p",
            "top_k",
            "n",
            "logprobs",
            "seed",
            "presence_penalty",
            "frequency_penalty",
        )
    }
    | {
        "stream": st.booleans(),
        "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=20)),
        "logit_bias": st.dictionaries(st.sampled_from(["1", "-1", "x", str(2**64)]), odd_numbers),
    },
)
raw_bodies = st.one_of(
    st.binary(max_size=64),  # invalid UTF-8 and other garbage
    st.just(b'{"prompt": "a", "max_tokens": NaN}'),
    st.just(b'{"prompt": "a", "temperature": Infinity}'),
    st.just(b'{"prompt": "\xff\xfe", "max_tokens": 2}'),
    st.just(b'{"prompt": "a"'),  # truncated
    st.just(b"[" * 100_000 + b"]" * 100_000),  # nesting deep enough to break naive parsers
    st.just(b'{"prompt": "' + b"x" * (BODY_LIMIT + 10) + b'"}'),  # over the body limit
    st.just(b'{"prompt": "a", "max_tokens": 2}' + b" " * 10),
)


def hostile_cases(server: Server, tally: Tally) -> int:
    before = tally.total
    routes = ["/v1/completions", "/tokenize", "/detokenize", "/v1/embeddings"]

    @given(st.sampled_from(routes), fields)
    @settings(max_examples=300, **DRAWS)
    def structured(route: str, body: dict) -> None:
        if route == "/detokenize":
            body = {"tokens": body["prompt"]}
        if route == "/v1/embeddings":
            body = {"input": body["prompt"]}
        content = json.dumps(body).encode()  # lone surrogates become "\ud800" escapes
        tally.send("POST", route, content=content, headers={"content-type": "application/json"})

    @given(st.sampled_from([*routes, "/v1/chat/completions"]), raw_bodies)
    @settings(max_examples=120, **DRAWS)
    def raw(route: str, body: bytes) -> None:
        tally.send("POST", route, content=body, headers={"content-type": "application/json"})

    structured()
    raw()
    for method, path in [("GET", "/nope"), ("DELETE", "/v1/completions"), ("PUT", "/health")]:
        tally.send(method, path)
    return tally.total - before


def test_fuzz_never_5xx_and_errors_in_openai_shape(server: Server, row: Row) -> None:
    """Fuzzing every route (schema-generated and hostile requests)"""
    with httpx.Client(base_url=server.url, timeout=60) as client:
        tally = Tally(client)
        per_op = schema_cases(server, tally)
        hostile = hostile_cases(server, tally)
    after = server.wait_idle()
    state = httpx.get(server.url + "/debug/state", timeout=10).json()
    row.load = (
        f"{tally.total} requests: {sum(per_op.values())} from the OpenAPI schema "
        f"({len(per_op)} operation×mode sets), {hostile} hostile bodies, "
        + ("new random draws" if RANDOM else "the fixed draws")
    )
    row.add("statuses: " + ", ".join(f"{s}×{n}" for s, n in sorted(tally.statuses.items())))
    row.add(f"problems (5xx or not the OpenAI error shape): {len(tally.problems)}")
    row.add(
        f"afterwards: /health {after['status']}, KV blocks used {after['kv_cache']['blocks_used']}"
    )
    assert tally.problems == [], "\n".join(tally.problems[:20])
    assert tally.total >= 1000
    assert after["status"] == "ok" and after["kv_cache"]["blocks_used"] == 0
    assert (after["running"], after["waiting"]) == (0, 0)
    assert (state["engine_requests"], state["engine_streams"], state["inflight"]) == (0, 0, 0)
