"""The prefix cache's host and disk tiers through `kvserve serve` (the demo model, a KV
pool of 48 blocks): a conversation's next turn, after others evicted it, is served from
the host tier (usage's cached_tokens, the kvserve_kv_host_* counters); after a restart
(SIGTERM writes the cached blocks to disk) the same turn is read from the disk tier."""

import httpx
import pytest

from tests.deploy.test_metrics import scrape
from tests.factories import start_server

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
