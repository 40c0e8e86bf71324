"""The prefix cache's host and disk tiers through `kvserve serve` (the demo model, a KV
pool of 48 blocks): a conversation's next turn, after others evicted it, is served from
the host tier (usage's cached_tokens, the kvserve_kv_host_* counters); after a restart
(SIGTERM writes the cached blocks to disk) the same turn is read from the disk tier."""

import stat
import time
from pathlib import Path

import httpx
import pytest
import zmq

from tests.deploy.test_metrics import scrape
from tests.factories import free_port, start_server

pytestmark = pytest.mark.slow
FLAGS = ("--num-kv-blocks", "48", "--block-size", "16", "--kv-host-gib", "0.05")


def turn(url: str, prompt: str) -> dict:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    resp = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_a_turn_comes_back_from_the_host_tier_then_from_disk(tmp_path) -> None:
    disk = tmp_path / "kv"
    server = start_server(str(tmp_path), *FLAGS, "--kv-disk-path", str(disk))
    try:
        first = "a conversation that comes back " * 40
        answer = turn(server.url, first)["choices"][0]["text"]
        for i in range(4):  # others that take the whole pool
            turn(server.url, f"another user {i} asks something else " * 30)
        again = turn(server.url, first + answer + " and then?")
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 16 * 10
        metrics = scrape(server)
        assert metrics["kvserve_kv_host_restored_blocks_total{}"] >= cached // 16
        assert metrics["kvserve_kv_host_capacity_bytes{}"] > 0
    finally:
        assert server.stop() == 0  # SIGTERM: the cached blocks to disk
    assert len(list(disk.rglob("*.kvb"))) >= 10
    restarted = start_server(str(tmp_path), *FLAGS, "--kv-disk-path", str(disk))
    try:
        later = turn(restarted.url, first + answer + " and then?")
        assert later["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
        assert later["choices"][0]["text"] == again["choices"][0]["text"]
        metrics = scrape(restarted)
        assert metrics["kvserve_kv_disk_read_blocks_total{}"] == cached // 16
        assert metrics["kvserve_kv_disk_corrupt_blocks_total{}"] == 0
    finally:
        assert restarted.stop() == 0


def test_kv_events_warn_of_a_wildcard_and_survive_malformed_replay_requests(tmp_path) -> None:
    """A publisher bound to every interface is warned of in the log; replay requests of
    the wrong shape are dropped and counted while /health stays 200 and a well-formed
    request is still answered; the disk tier's files are the server user's alone."""
    pub, replay = free_port(), free_port()
    disk = tmp_path / "kv"
    server = start_server(str(tmp_path), *FLAGS, "--kv-disk-path", str(disk),
                          "--kv-events-endpoint", f"tcp://0.0.0.0:{pub}",
                          "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}")  # fmt: skip
    ctx = zmq.Context()
    try:
        log = Path(server.log_path).read_text()
        assert "KV events bound to every interface" in log and f"tcp://0.0.0.0:{pub}" in log
        turn(server.url, "a prompt to publish " * 20)
        for frames in ([b"x"], [b"", b"1", b"2"], [b"", b"short"]):
            bad = ctx.socket(zmq.DEALER)
            bad.connect(f"tcp://127.0.0.1:{replay}")
            bad.send_multipart(frames)
        good = ctx.socket(zmq.DEALER)
        good.connect(f"tcp://127.0.0.1:{replay}")
        good.send_multipart([b"", (0).to_bytes(8, "big")])
        assert good.poll(10_000) and len(good.recv_multipart()) == 3  # a batch, then more
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        deadline = time.monotonic() + 10  # an idle engine's snapshot follows within a second
        while (metrics := scrape(server))["kvserve_kv_events_replay_malformed_total{}"] < 3:
            assert time.monotonic() < deadline, metrics
            time.sleep(0.2)
        assert metrics["kvserve_kv_events_replay_failed{}"] == 0
        assert metrics["kvserve_kv_events_replay_malformed_total{}"] == 3
    finally:
        ctx.destroy(linger=0)
        assert server.stop() == 0
    files = [disk, *disk.rglob("*")]
    assert len(files) > 3 and all(stat.S_IMODE(f.stat().st_mode) & 0o077 == 0 for f in files)
