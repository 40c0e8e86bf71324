"""deploy/kubernetes: both overlays render with `kubectl kustomize`, every object
validates against the Kubernetes API schemas (kubernetes-validate, strict) and the
ServiceMonitor against the Prometheus Operator's CRD schema (@kubernetes-models, run by
node); the manifests agree with kvserve's own settings; and the autoscaler's query,
rendered from the prometheus-adapter rule, is evaluated by a real Prometheus scraping a
live server and rises above the HPA's target when requests queue."""

import asyncio
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from service.config import load_settings
from tests.deploy.tools import running_prometheus
from tests.factories import free_port, start_server
from tests.require import missing

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ROOT / "deploy/kubernetes/overlays"
NPM = Path(sys.prefix) / "npm"  # make test installs @kubernetes-models there
K8S_VERSION = "1.33.0"
CRD_CHECK = """
import { ServiceMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor";
new ServiceMonitor(JSON.parse(process.argv[1])).validate();
"""


def render(overlay: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        missing("kubectl", "not installed (it renders the kustomize overlays)")
    out = subprocess.run(
        [kubectl, "kustomize", str(OVERLAYS / overlay)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def by_kind(objects: list[dict]) -> dict[str, dict]:
    return {o["kind"]: o for o in objects if o["kind"] != "ConfigMap"} | {
        "ConfigMap/" + o["metadata"]["name"].rsplit("-", 1)[0]: o
        for o in objects
        if o["kind"] == "ConfigMap"
    }


def validate_crd(obj: dict) -> None:
    node = shutil.which("node")
    if node is None or not (NPM / "node_modules/@kubernetes-models/prometheus-operator").is_dir():
        missing("kubernetes-models", f"node and @kubernetes-models/prometheus-operator in {NPM}")
    check = subprocess.run(
        [node, "--input-type=module", "-e", CRD_CHECK, json.dumps(obj)],
        cwd=NPM,
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stderr[-2000:]


@pytest.mark.parametrize("overlay", ["cpu", "gpu"], ids=["cpu-nodes", "gpu-nodes"])
def test_overlays_render_and_validate(overlay: str) -> None:
    import kubernetes_validate

    objects = render(overlay)
    kinds = {o["kind"] for o in objects}
    assert kinds >= {
        "Deployment", "Service", "PodDisruptionBudget", "ServiceMonitor",
        "HorizontalPodAutoscaler", "ConfigMap", "PersistentVolumeClaim",
    }  # fmt: skip
    for obj in objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            validate_crd(obj)
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    # and the validators do bite: a misspelt field, a wrong type
    bad = by_kind(objects)["Deployment"]
    bad["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
    monitor = by_kind(objects)["ServiceMonitor"]
    monitor["spec"]["endpoints"][0]["interval"] = "15 seconds"
    with pytest.raises(AssertionError, match="interval"):
        validate_crd(monitor)


@pytest.mark.parametrize("overlay", ["cpu", "gpu"], ids=["cpu-nodes", "gpu-nodes"])
def test_manifests_agree_with_kvserve(overlay: str) -> None:
    objs = by_kind(render(overlay))
    env = objs["ConfigMap/kvserve"]["data"]
    settings = load_settings(env=env)  # every variable a real setting, each value valid
    pod = objs["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == f"kvserve:{overlay}"
    assert settings.device == ("cpu" if overlay == "cpu" else "cuda")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    # SIGTERM comes after preStop; the drain must end before the grace period does
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + settings.shutdown_timeout + 5
    live = container["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > settings.shutdown_timeout
    gpus = container["resources"]["limits"].get("nvidia.com/gpu")
    assert gpus == (1 if overlay == "gpu" else None)
    selector = objs["Service"]["spec"]["selector"]
    assert objs["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"] == selector
    assert objs["ServiceMonitor"]["spec"]["selector"]["matchLabels"] == selector
    assert objs["ServiceMonitor"]["spec"]["endpoints"][0]["port"] == "http"
    hpa = objs["HorizontalPodAutoscaler"]["spec"]
    assert hpa["scaleTargetRef"]["name"] == objs["Deployment"]["metadata"]["name"]
    rule = adapter_rule(objs)
    assert hpa["metrics"][0]["external"]["metric"]["name"] == rule["name"]["as"]


def adapter_rule(objs: dict[str, dict]) -> dict:
    config = yaml.safe_load(objs["ConfigMap/kvserve-prometheus"]["data"]["config.yaml"])
    (rule,) = config["externalRules"]
    return rule


def adapter_query(rule: dict, namespace: str) -> str:
    """The PromQL prometheus-adapter sends for the HPA's metric in `namespace`."""
    series = re.match(r"\w+", rule["seriesQuery"]).group(0)
    return (
        rule["metricsQuery"]
        .replace("<<.Series>>", series)
        .replace("<<.LabelMatchers>>", f'namespace="{namespace}"')
        .replace("<<.GroupBy>>", "namespace")
    )


async def queue_up(url: str, n: int) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        body = {"prompt": "autoscale " * 8, "max_tokens": 48, "ignore_eos": True}
        rs = await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(n)))
    assert all(r.status_code == 200 for r in rs)


def test_the_autoscaler_query_rises_above_its_target_when_requests_queue(
    tmp_path: Path,
) -> None:
    objs = by_kind(render("cpu"))
    rule = adapter_rule(objs)
    target = float(
        objs["HorizontalPodAutoscaler"]["spec"]["metrics"][0]["external"]["target"]["averageValue"]
    )
    query = adapter_query(rule, "kvserve-test")
    server = start_server(str(tmp_path), "--max-num-seqs", "1")  # one at a time: a queue
    labels = {"namespace": "kvserve-test", "service": "kvserve"}  # as the operator adds
    try:
        with running_prometheus(
            server.url.removeprefix("http://"), tmp_path, free_port(), labels
        ) as prom:

            def value() -> float | None:
                r = httpx.get(prom + "/api/v1/query", params={"query": query}, timeout=10).json()
                assert r["status"] == "success", r
                return float(r["data"]["result"][0]["value"][1]) if r["data"]["result"] else None

            deadline = time.monotonic() + 30
            while (idle := value()) is None and time.monotonic() < deadline:
                time.sleep(0.5)
            assert idle == 0.0  # scraped, nothing waiting
            load = subprocess.Popen(  # 40 requests at once, from another process
                [sys.executable, "-c", f"import asyncio, {__name__} as t; asyncio.run(t.queue_up({server.url!r}, 40))"],
                cwd=ROOT,
            )  # fmt: skip
            peak = 0.0
            while load.poll() is None and peak <= target:
                peak = max(peak, value() or 0.0)
                time.sleep(0.5)
            failed = load.poll()  # None: still queued, its requests no longer needed
            load.kill()
            load.wait(60)
            assert failed in (None, 0)
    finally:
        server.stop()
    assert peak > target, f"{query} peaked at {peak}, the HPA's target is {target}"
