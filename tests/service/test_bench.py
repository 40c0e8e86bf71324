"""The serving benchmark client against a live server."""

import asyncio
import json

import httpx
import pytest

from service import bench
from service.bench import SSEData, run, workload
from service.bench_cli import main
from tests.factories import Server


def test_closed_and_open_loop(server: Server, tmp_path) -> None:
    reqs = workload("fixed", 6, 20, 8, 30000, seed=1)
    closed = asyncio.run(run(server.url, reqs, 3, None, 60, None, None, 0))
    assert closed["completed"] == 6 and closed["errors"] == 0
    assert (
        closed["output_tok_s"] > 0 and closed["ttft_ms"]["p50"] > 0 and closed["itl_ms"]["p99"] > 0
    )
    assert abs(closed["output_tok_s"] * closed["duration_s"] - 6 * 8) < 1e-6
    assert closed["client_transport"] == "httpx+aiohttp"  # the bench extra is installed
    assert closed["client_cpu_s"] > 0
    chat = workload("chat", 5, 20, 8, 30000, seed=2)
    assert len({len(p) for p, _ in chat}) > 1
    opened = asyncio.run(run(server.url, chat, None, 20.0, 60, None, None, 0))
    assert opened["completed"] == 5 and opened["request_rate"] == 20.0
    out = tmp_path / "bench.json"
    assert (
        main(
            [
                "--url",
                server.url,
                "--concurrency",
                "1",
                "2",
                "--num-requests",
                "2",
                "--output-len",
                "4",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    assert out.exists()


def test_sse_data_survives_any_split_and_line_ending() -> None:
    for end in (b"\n", b"\r\n", b"\r"):
        stream = (
            end.join(
                [
                    b'data: {"a":1}',
                    b"",
                    b": comment",
                    b'data:{"b":"x y"}',
                    b"",
                    b"data: [DONE]",
                    b"",
                ]
            )
            + end
        )
        for cut in range(len(stream) + 1):
            sse = SSEData()
            got = sse.feed(stream[:cut]) + sse.feed(stream[cut:])
            assert [json.loads(p) for p in got] == [{"a": 1}, {"b": "x y"}], (end, cut)
    sse = SSEData()
    assert [json.loads(p) for b in b'data: {"c":2}\n\n' for p in sse.feed(bytes([b]))] == [{"c": 2}]


@pytest.mark.parametrize("transport", ["httpx+aiohttp", "httpx"])
def test_either_transport_counts_tokens_and_errors(
    server: Server, transport: str, monkeypatch
) -> None:
    if transport == "httpx":  # as without the bench extra: httpx's own transport
        monkeypatch.setattr(
            bench, "client_transport", lambda limits: (None, (httpx.HTTPError,), "httpx")
        )
    reqs = workload("fixed", 4, 12, 5, 30000, seed=3)
    good = asyncio.run(run(server.url, reqs, 2, None, 60, None, None, 0))
    assert good["client_transport"] == transport
    assert (good["completed"], good["errors"]) == (4, 0)
    assert round(good["output_tok_s"] * good["duration_s"]) == 4 * 5
    itl = good["itl_ms"]
    assert set(itl) == {"mean", "p50", "p90", "p99", "max"} and 0 < itl["p50"] <= itl["max"]
    bad = asyncio.run(run(server.url, reqs[:2], 2, None, 60, "no-such-model", None, 0))
    assert (bad["completed"], bad["errors"]) == (0, 2)
    assert all("HTTP 404" in e and "no-such-model" in e for e in bad["error_examples"])
    gone = asyncio.run(run("http://127.0.0.1:9", reqs[:1], 1, None, 60, None, None, 0))
    assert gone["errors"] == 1 and gone["error_examples"][0]  # refused: counted, not raised
