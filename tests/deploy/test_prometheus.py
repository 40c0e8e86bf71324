"""A real Prometheus scrapes a live kvserve; every query of the Grafana dashboard is
evaluated through Prometheus' HTTP API and must be valid and return data."""

import json
import time
from pathlib import Path

import httpx
import pytest

from tests.deploy.tools import running_prometheus
from tests.live_server import Server, free_port

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy/grafana/dashboards/kvserve.json"


def dashboard_queries() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]


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
    queries = dashboard_queries()
    assert len(queries) >= 20
    deadline = time.monotonic() + 30  # scrapes are 1 s apart; a loaded machine may lag
    while True:
        empty = []
        for title, expr in queries:
            query = expr.replace("$__rate_interval", "30s")
            resp = httpx.get(prom + "/api/v1/query", params={"query": query}, timeout=10)
            body = resp.json()
            assert resp.status_code == 200 and body["status"] == "success", (
                f"{title}: {query}: {body}"
            )
            if not body["data"]["result"]:
                empty.append(f"{title}: {query}")
        if not empty or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert not empty, "queries without data:\n" + "\n".join(empty)
