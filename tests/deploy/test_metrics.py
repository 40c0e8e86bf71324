"""/metrics after real traffic: promtool lint, histograms that counted it, KV gauges
that moved and came back to idle."""

import subprocess
import threading

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

from model.backends.device import dtype_name, pick_dtype
from tests.deploy.tools import promtool
from tests.factories import Server


def scrape(server: Server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model")
            values[f"{sample.name}{{{labels}}}"] = sample.value
    return values


def test_metrics_lint_and_count_traffic(server: Server) -> None:
    server.wait_idle()
    before = scrape(server)
    busy = threading.Event()
    seen_used = []

    def watch() -> None:
        while not busy.is_set():
            seen_used.append(scrape(server)["kvserve_kv_cache_used_blocks{}"])

    watcher = threading.Thread(target=watch)
    watcher.start()
    with server.client() as c:
        for i in range(4):
            r = c.post(
                "/v1/completions",
                json={"prompt": f"traffic {i} " * 20, "max_tokens": 30, "ignore_eos": True},
            )
            assert r.status_code == 200
        with c.stream(
            "POST",
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 20,
                "ignore_eos": True,  # sampled at temperature 1: may draw <|endoftext|>
                "stream": True,
            },
        ) as s:
            assert s.status_code == 200 and b"[DONE]" in b"".join(s.iter_bytes())
        assert c.post("/v1/completions", json={"prompt": "x", "temperature": 9}).status_code == 400
    busy.set()
    watcher.join()
    server.wait_idle()
    after = scrape(server)

    text = httpx.get(server.url + "/metrics", timeout=10).text
    lint = subprocess.run(
        [promtool(), "check", "metrics"], input=text, capture_output=True, text=True, check=False
    )
    assert lint.returncode == 0 and not lint.stdout.strip() and not lint.stderr.strip(), (
        lint.stdout + lint.stderr
    )

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("kvserve_time_to_first_token_seconds_count{}") == 5
    assert delta("kvserve_e2e_request_latency_seconds_count{}") == 5
    assert delta("kvserve_generation_tokens_total{}") == 4 * 30 + 20
    assert delta("kvserve_inter_token_latency_seconds_count{}") == 4 * 29 + 19
    assert delta("kvserve_time_per_output_token_seconds_count{}") == 5
    assert delta("kvserve_requests_finished_total{finish_reason=length}") == 5
    assert delta("kvserve_requests_rejected_total{reason=invalid_request}") == 1
    assert delta("kvserve_http_requests_total{route=/v1/completions,status=200}") == 4
    assert delta("kvserve_engine_step_duration_seconds_count{}") > 0
    assert max(seen_used) > 0  # the KV gauges moved during traffic ...
    assert after["kvserve_kv_cache_used_blocks{}"] == 0  # ... and came back to idle
    assert (
        after["kvserve_kv_cache_used_bytes{}"] == 0 and after["kvserve_kv_cache_usage_ratio{}"] == 0
    )
    assert after["kvserve_kv_cache_capacity_bytes{}"] > 0
    blocks = after["kvserve_kv_cache_capacity_blocks{}"]
    config = [k for k in after if k.startswith("kvserve_cache_config_info")]
    assert config == [f"kvserve_cache_config_info{{block_size=16,num_gpu_blocks={blocks:.0f}}}"]
    info = [k for k in after if k.startswith("kvserve_model_info")]
    auto = dtype_name(pick_dtype("auto", torch.device("cpu")))  # bf16 from AVX2 up
    assert info and f"dtype={auto}" in info[0] and "device=cpu" in info[0]


def test_every_rejection_reason_is_exported_from_the_start(server: Server) -> None:
    """Each reason's series exists before any such rejection (at 0 until one), so a
    dashboard panel or alert on it reads a number, not "no data"."""
    from service.api.metrics import REJECTION_REASONS

    metrics = scrape(server)
    for reason in REJECTION_REASONS:
        assert metrics.get(f"kvserve_requests_rejected_total{{reason={reason}}}", -1) >= 0, reason
