"""What a hostile or careless user reaches besides the completions themselves: tool
schemas as clients and attackers write them, the KV events replay socket fed malformed
frames, and the disk tier's files (their permissions, a write that fails)."""

from __future__ import annotations

import json
import stat
import time
from pathlib import Path

import httpx
import jsonschema
import pytest
import zmq

from tests.api.test_tools_served import DEFS_TOOLS, TEMPLATE
from tests.factories import free_port, start_server, write_qwen3, write_qwen_tokenizer
from tests.reliability.conftest import Row, harness

pytestmark = pytest.mark.reliability

ASK = [{"role": "user", "content": "Plan a trip"}]


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


HOSTILE = [
    ("a reference to no definition", tool("f", {"$ref": "#/$defs/Missing"})),
    ("definitions that only refer to each other",
     tool("f", {"$ref": "#/$defs/A", "$defs": {"A": {"$ref": "#/$defs/B"},
                                               "B": {"$ref": "#/$defs/A"}}})),
    ("a reference out of the document", tool("f", {"$ref": "https://example.com/s.json"})),
    ("10,000 definitions (past the size cap)",
     tool("f", {"$defs": {f"D{i}": {"type": "integer"} for i in range(10_000)}})),
    ("parameters that are not an object", tool("f", ["type", "object"])),  # type: ignore[arg-type]
]  # fmt: skip
ALLOWED = [
    ("pydantic's nested models and older drafts' definitions", DEFS_TOOLS),
    ("a recursive tree (a definition refers to itself)",
     [tool("tree", {"$ref": "#/$defs/Node", "$defs": {"Node": {
         "type": "object", "required": ["v"], "additionalProperties": False,
         "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                        "kids": {"type": "array", "maxItems": 2,
                                 "items": {"$ref": "#/$defs/Node"}}}}}})]),
    ("objects nested 12 deep", [tool("deep", nested(12))]),
]  # fmt: skip


def test_hostile_tool_schemas(tmp_path, row: Row) -> None:
    """Hostile tool schemas"""
    path = tmp_path / "qwen3"
    write_qwen3(path, max_position_embeddings=2048)
    write_qwen_tokenizer(path, TEMPLATE, '{"name": "add", "arguments": {"a": 1}}', thinks=False)
    # the front compiles and refuses them, the same code in either transport
    server = harness(tmp_path, "--model", str(path))
    refused, held = [], []
    try:
        with httpx.Client(base_url=server.url, timeout=300) as client:
            for what, bad in HOSTILE:
                t0 = time.perf_counter()
                r = client.post("/v1/chat/completions", json={"messages": ASK, "tools": [bad],
                                                               "tool_choice": "required"})  # fmt: skip
                assert r.status_code == 400, (what, r.text[:300])
                refused.append((what, r.status_code, r.json()["error"], time.perf_counter() - t0))
            for what, tools in ALLOWED:
                body = {"messages": ASK, "tools": tools, "tool_choice": "required",
                        "temperature": 1.0, "seed": 3, "max_tokens": 600,
                        "parallel_tool_calls": False}  # fmt: skip
                r = client.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, (what, r.text)
                (call,) = r.json()["choices"][0]["message"]["tool_calls"]
                schema = next(t["function"]["parameters"] for t in tools
                              if t["function"]["name"] == call["function"]["name"])  # fmt: skip
                jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
                held.append(what)
        health = server.wait_idle()
    finally:
        server.stop()
    row.load = (
        f"{len(HOSTILE)} hostile tool schemas ({'; '.join(w for w, _ in HOSTILE)}) and "
        f"{len(ALLOWED)} legitimate ones ({'; '.join(w for w, _ in ALLOWED)}), tool_choice "
        "required, sampled at temperature 1"
    )
    slowest = max(seconds for *_, seconds in refused)
    row.add(
        f"hostile: {[status for _, status, _, _ in refused]}, each naming "
        f"{sorted({e['param'] for _, _, e, _ in refused})}, the slowest in {slowest * 1000:.0f} ms"
    )
    row.add(f"legitimate: {len(held)}/{len(ALLOWED)} called with arguments their schemas accept")
    row.add(
        f"afterwards: /health {health['status']}, KV blocks used {health['kv_cache']['blocks_used']}"
    )
    assert all(status == 400 and e["param"].startswith("tools") for _, status, e, _ in refused)
    assert health["kv_cache"]["blocks_used"] == 0


def test_kv_events_malformed_frames(tmp_path, row: Row, mode: str) -> None:
    """KV events replay socket fed malformed frames"""
    replay = f"tcp://127.0.0.1:{free_port()}"
    server = harness(tmp_path, "--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}",
                     "--kv-events-replay-endpoint", replay, mode=mode)  # fmt: skip
    shapes = [[b"x"], [b"", b"1", b"2", b"3"], [b"no-delimiter", b"12345678"], [b"", b"short"],
              [b"", b"\xff" * 8 * 1000]]  # fmt: skip
    ctx = zmq.Context()
    try:
        httpx.post(server.url + "/v1/completions", json={"prompt": "publish " * 40,
                   "max_tokens": 2}, timeout=120)  # fmt: skip
        sockets = []  # kept open until their requests are counted
        for _ in range(40):  # 200 malformed requests, each on its own connection
            for frames in shapes:
                sockets.append(bad := ctx.socket(zmq.DEALER))
                bad.connect(replay)
                bad.send_multipart(frames)
        good = ctx.socket(zmq.DEALER)
        good.connect(replay)
        t0 = time.perf_counter()
        good.send_multipart([b"", (0).to_bytes(8, "big")])
        batches = 0
        while good.poll(10_000):
            if not good.recv_multipart()[-1]:
                break
            batches += 1
        answered = time.perf_counter() - t0
        health = httpx.get(server.url + "/health", timeout=10)
        deadline = time.monotonic() + 10
        while True:  # an idle engine's snapshot follows within a second
            text = httpx.get(server.url + "/metrics", timeout=10).text
            malformed = _sample(text, "kvserve_kv_events_replay_malformed_total")
            if malformed >= 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        failed = _sample(text, "kvserve_kv_events_replay_failed")
    finally:
        ctx.destroy(linger=0)
        server.stop()
    row.load = (
        "200 malformed replay requests (one frame, four, no delimiter, a short start, an 8 KB "
        "start), then a well-formed one"
    )
    row.add(
        f"the well-formed one: {batches} batches replayed in {answered * 1000:.0f} ms; "
        f"/health {health.status_code}; kvserve_kv_events_replay_malformed_total {malformed:.0f}, "
        f"kvserve_kv_events_replay_failed {failed:.0f}"
    )
    assert batches >= 1 and health.status_code == 200
    assert malformed == 200 and failed == 0


def _sample(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_disk_tier_permissions_and_failed_writes(tmp_path, row: Row) -> None:
    """Disk tier permissions and failed writes"""
    disk = tmp_path / "kv"
    flags = ("--num-kv-blocks", "48", "--block-size", "16", "--kv-host-gib", "0.002")

    def serve_turns(n: int) -> int:
        """A server on the disk tier: n conversations through it, then SIGTERM (which
        writes every cached block). Its exit status."""
        # the engine writes them, the same code in its thread or its process
        server = harness(tmp_path, *flags, "--kv-disk-path", str(disk))
        try:
            for i in range(n):
                body = {"prompt": f"conversation {i} " * 60, "max_tokens": 2}
                httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        finally:
            code = server.stop()
        return code

    first = serve_turns(6)
    files = [disk, *disk.rglob("*")]
    modes = sorted({f"{stat.S_IMODE(f.stat().st_mode):o}" for f in files})
    # every block's file as a folder: each write's rename then fails
    blocks = list(disk.rglob("*.kvb"))
    for f in blocks:
        f.unlink()
        (f / "in-the-way").mkdir(parents=True)
    second = serve_turns(6)
    left = list(disk.rglob("*.tmp"))
    disk.chmod(0o777)
    refused = start_server(str(tmp_path), *flags, "--kv-disk-path", str(disk), wait=False)
    refused_code = refused.proc.wait(120)
    said = Path(refused.log_path).read_text()
    row.load = (
        "6 conversations through a server on --kv-disk-path, SIGTERM; again with every block's "
        "file name taken by a folder (each write fails at its rename); a start on a folder "
        "others can write to"
    )
    row.add(f"{len(files)} files and folders, modes {modes}; exit statuses {first} and {second}")
    row.add(f"after the failing writes: {len(left)} temporary files left")
    row.add(
        f"world-writable folder: exit {refused_code}, "
        f"`{next((ln for ln in said.splitlines() if ln.startswith('kvserve: error')), '')}`"
    )
    assert blocks and set(modes) <= {"600", "700"}
    assert first == second == 0 and not left
    assert refused_code != 0 and "other users can write to it" in said
