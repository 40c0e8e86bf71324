"""A real Prometheus scrapes a live kvserve; every query of the Grafana dashboard is
evaluated through Prometheus' HTTP API and must be valid and return data."""

import time
from pathlib import Path

import httpx
import pytest

from tests.deploy.tools import dashboard_queries, empty_dashboard_queries, running_prometheus
from tests.factories import Server, free_port


@pytest.fixture
def prom(server: Server, tmp_path: Path):
    with running_prometheus(server.url.removeprefix("http://"), tmp_path, free_port()) as url:
        yield url


def traffic(server: Server) -> None:
    with server.client() as c:
        for i in range(3):
            r = c.post(
                "/v1/completions", json={"prompt": f"prometheus traffic {i} " * 8, "max_tokens": 12}
            )
            assert r.status_code == 200
        assert c.post("/v1/completions", json={"prompt": "x", "top_p": 0}).status_code == 400


def test_every_dashboard_query_returns_data(server: Server, prom: str) -> None:
    traffic(server)
    time.sleep(3)  # several scrapes
    traffic(server)
    time.sleep(3)
    up = httpx.get(prom + "/api/v1/query", params={"query": "up"}, timeout=10).json()
    assert up["data"]["result"] and up["data"]["result"][0]["value"][1] == "1"
    assert len(dashboard_queries()) >= 20
    empty = empty_dashboard_queries(prom, rate_window="30s", wait_s=30)
    assert not empty, "queries without data:\n" + "\n".join(empty)
