"""`--api-server-count 2`: two front processes on one port in front of one engine process.
Requests reach both fronts, each stream completes in the front it started in, and
/metrics from either front counts all the traffic (the histograms merged, not one
front's share)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from service.fronts import process_key
from tests.factories import Server, start_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def temp_root(tmp_path_factory) -> Path:
    """The server's temporary folder, holding beforehand the run folder of a supervisor
    killed with its stored responses (its pid gone), one of a supervisor still running
    (this test's process) and a folder that is not a run folder."""
    root = tmp_path_factory.mktemp("tmp")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for name, owner in (
        ("kvserve-dead", f"{dead.pid} 1"),
        ("kvserve-alive", process_key(os.getpid())),
    ):
        (root / name).mkdir(mode=0o700)
        (root / name / "owner").write_text(owner)
        (root / name / "responses.sqlite").write_text("a user's conversation")
    (root / "kvserve-other").mkdir()
    return root


@pytest.fixture(scope="module")
def fronts(tmp_path_factory, temp_root: Path) -> Server:
    server = start_server(str(tmp_path_factory.mktemp("fronts")), "--api-server-count", "2",
                          env={"TMPDIR": str(temp_root)})  # fmt: skip
    yield server.wait_fronts(2)
    assert server.stop() == 0


def sample(text: str, name: str, labels: str = "") -> float:
    """One sample's value from the Prometheus text (0 when absent)."""
    pattern = rf"^{re.escape(name)}{{([^}}]*)}} (\S+)$"
    total = 0.0
    for match in re.finditer(pattern, text, re.MULTILINE):
        if labels in match.group(1):
            total += float(match.group(2))
    return total


async def by_front(url: str, n: int, call) -> dict[int, list]:
    """n calls, each on a fresh connection, grouped by the front that answered."""

    async def one(i: int) -> tuple[int, object]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await call(client, i)

    seen: dict[int, list] = {}
    for front, result in await asyncio.gather(*(one(i) for i in range(n))):
        seen.setdefault(front, []).append(result)
    return seen


def test_both_fronts_serve_streams_and_every_scrape_counts_all_traffic(fronts: Server) -> None:
    before = httpx.get(fronts.url + "/metrics").text
    done_before = sample(before, "kvserve_e2e_request_latency_seconds_count")

    async def stream(client: httpx.AsyncClient, i: int) -> tuple[int, tuple[str, int]]:
        front = (await client.get("/health")).json()["front"]
        body = {"prompt": f"request {i}", "max_tokens": 12, "ignore_eos": True, "stream": True}
        body["stream_options"] = {"include_usage": True}
        text, tokens = "", 0
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
                    elif event["choices"]:
                        text += event["choices"][0]["text"]
        return front, (text, tokens)

    seen: dict[int, list] = {}
    sent = 0
    for _ in range(5):  # the kernel hands connections to whichever front accepts first
        for front, results in asyncio.run(by_front(fronts.url, 16, stream)).items():
            seen.setdefault(front, []).extend(results)
        sent += 16
        if len(seen) == 2:
            break
    assert sorted(seen) == [0, 1], f"one front took every connection: {list(seen)}"
    assert all(tokens == 12 for results in seen.values() for _, tokens in results)

    async def scrape(client: httpx.AsyncClient, _: int) -> tuple[int, str]:
        resp = await client.get("/metrics")
        return int(resp.headers["x-kvserve-front"]), resp.text

    scrapes: dict[int, list] = {}
    for _ in range(10):
        for front, texts in asyncio.run(by_front(fronts.url, 8, scrape)).items():
            scrapes.setdefault(front, []).extend(texts)
        if len(scrapes) == 2:
            break
    assert sorted(scrapes) == [0, 1]
    assert all('reason="queue_full"' in text for texts in scrapes.values() for text in texts)

    async def health(client: httpx.AsyncClient, _: int) -> tuple[int, int]:
        resp = await client.get("/health")
        return int(resp.headers["x-kvserve-front"]), resp.json()["front"]

    answers = asyncio.run(by_front(fronts.url, 8, health))
    assert all(front == body for front, said in answers.items() for body in said)
    for texts in scrapes.values():
        for text in texts:
            finished = sample(text, "kvserve_e2e_request_latency_seconds_count") - done_before
            generated = sample(text, "kvserve_request_generation_tokens_sum")
            http = sample(text, "kvserve_http_requests_total", 'route="/v1/completions"')
            assert finished == sent
            assert generated >= 12 * sent
            assert http >= sent  # this test's and the module's other requests
            assert sample(text, "kvserve_requests_running") == 0


def test_the_openai_client_streams_through_either_front(fronts: Server) -> None:
    client = openai.OpenAI(base_url=fronts.url + "/v1", api_key="x", max_retries=0)
    texts = []
    for i in range(6):  # a new connection each time: either front may take it
        stream = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": f"hello {i}"}],
            max_tokens=8,
            temperature=0,
            stream=True,
        )
        texts.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    again = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "hello 0"}],
        max_tokens=8,
        temperature=0,
    )
    assert again.choices[0].message.content == texts[0]  # greedy: the same in either front
    assert fronts.wait_idle()["kv_cache"]["blocks_used"] == 0


def test_a_response_stored_by_one_front_is_continued_through_the_other(fronts: Server) -> None:
    """The fronts share the Responses store: a response made in one front is retrieved,
    listed, continued and deleted through the other."""

    async def create(client: httpx.AsyncClient, i: int) -> tuple[int, str]:
        front = (await client.get("/health")).json()["front"]  # this connection's
        body = {"input": f"turn {i}", "max_output_tokens": 4, "temperature": 0}
        resp = await client.post("/v1/responses", json=body)
        assert resp.status_code == 200, resp.text
        return front, resp.json()["id"]

    made: dict[int, list] = {}
    for _ in range(10):
        for front, ids in asyncio.run(by_front(fronts.url, 8, create)).items():
            made.setdefault(front, []).extend(ids)
        if len(made) == 2:
            break
    assert sorted(made) == [0, 1]

    async def reach(client: httpx.AsyncClient, i: int) -> tuple[int, tuple[str, list[int]]]:
        front = (await client.get("/health")).json()["front"]
        rid = made[1 - front][0]  # the other front's first response
        got = await client.get(f"/v1/responses/{rid}")
        items = await client.get(f"/v1/responses/{rid}/input_items")
        later = await client.post(
            "/v1/responses", json={"input": "and?", "max_output_tokens": 2,
                                   "previous_response_id": rid},
        )  # fmt: skip
        codes = [got.status_code, items.status_code, later.status_code]
        assert got.json()["id"] == rid and items.json()["data"][0]["content"][0]["text"]
        return front, (rid, codes)

    seen: dict[int, list] = {}
    for _ in range(10):
        for front, results in asyncio.run(by_front(fronts.url, 8, reach)).items():
            seen.setdefault(front, []).extend(results)
        if len(seen) == 2:
            break
    assert sorted(seen) == [0, 1]
    for front, results in seen.items():
        assert all(codes == [200, 200, 200] for _, codes in results)
        assert {rid for rid, _ in results} == {made[1 - front][0]}
    gone = httpx.delete(f"{fronts.url}/v1/responses/{made[0][0]}")
    assert gone.json()["deleted"] is True
    for _ in range(6):  # gone in whichever front answers
        assert httpx.get(f"{fronts.url}/v1/responses/{made[0][0]}").status_code == 404


def test_each_process_is_named_for_ps(fronts: Server) -> None:
    """ps shows the engine core and each front by name, not as multiprocessing's spawn
    (beside them, multiprocessing's own resource tracker)."""
    children = Path(f"/proc/{fronts.proc.pid}/task/{fronts.proc.pid}/children").read_text()
    lines = [Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
             for pid in children.split()]  # fmt: skip
    named = sorted(line.strip() for line in lines if line.startswith("kvserve"))
    assert named == ["kvserve: engine core", "kvserve: front 0", "kvserve: front 1"], lines
    assert all("resource_tracker" in line for line in lines if not line.startswith("kvserve"))


def test_a_dead_supervisors_run_folder_is_deleted_at_start(fronts: Server, temp_root: Path) -> None:
    """Its stored responses with it; a running supervisor's and other folders stay, and
    this server's own folder names its owner."""
    left = sorted(p.name for p in temp_root.iterdir() if p.name.startswith("kvserve-"))
    assert "kvserve-dead" not in left and {"kvserve-alive", "kvserve-other"} <= set(left)
    (own,) = [temp_root / n for n in left if n not in ("kvserve-alive", "kvserve-other")]
    assert (own / "owner").read_text() == process_key(fronts.proc.pid)
    assert stat.S_IMODE(own.stat().st_mode) == 0o700
