"""`docker compose up` on a real Docker engine, as a user runs it: the CPU image built from
the project's own Dockerfile through `docker compose build`, then kvserve and Prometheus
up, and the user's first steps checked against the containers. The tests run in order
on one stack (tests/deploy/docker_engine.py has the engine and the base images)."""

from __future__ import annotations

import contextlib
import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.deploy.docker_engine import Engine, base_images, docker_engine, run, torch_index
from tests.deploy.tools import dashboard_queries, empty_dashboard_queries
from tests.factories import write_hub_cache

pytestmark = [pytest.mark.docker, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
FILES = ("-f", "docker-compose.yml", "-f", "docker-compose.cpu.yml")
KVSERVE, PROMETHEUS = "http://127.0.0.1:8000", "http://127.0.0.1:9090"
HOST_UID = 4321  # a host user who is neither root nor the image's user
HUB_MODEL = "org/tiny-llama"


class Stack:
    """The project (its tracked and untracked files, copied so that compose's bind mounts
    create nothing in the checkout) and `docker compose` over it."""

    def __init__(self, engine: Engine, workdir: Path, torch_index_url: str | None) -> None:
        self.engine, self.src = engine, workdir / "src"
        files = run("git", "ls-files", "-co", "--exclude-standard", "-z", cwd=ROOT).stdout
        for name in filter(None, files.split("\0")):
            if (ROOT / name).is_file():
                (self.src / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, self.src / name)
        self.env = {"TORCH_INDEX_URL": torch_index_url or "", "HF_HOME": str(workdir / "hf")}

    def compose(self, *args: str, timeout: float = 900, check: bool = True, **env: str):
        return self.engine("compose", *FILES, *args, cwd=self.src, timeout=timeout,
                           check=check, env={**self.env, **env})  # fmt: skip

    def up(self, **env: str) -> None:
        got = self.compose("up", "-d", "--wait", "kvserve", "prometheus", timeout=600,
                           check=False, **env)  # fmt: skip
        if got.returncode != 0:
            logs = self.compose("logs", "--tail", "40", check=False).stdout
            raise AssertionError(f"compose up failed: {got.stderr[-2000:]}\n{logs}")

    def exec(self, *cmd: str, user: str | None = None) -> str:
        as_user = ("-u", user) if user else ()
        return self.compose("exec", "-T", *as_user, "kvserve", *cmd, timeout=60).stdout.strip()

    def running(self) -> list[str]:
        out = self.engine("ps", "-a", "-q", "--filter", "label=com.docker.compose.project=kvserve")
        return out.stdout.split()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("compose")
    with docker_engine(workdir) as engine:
        trusts_index = base_images(engine, workdir)
        with torch_index(workdir) if trusts_index else contextlib.nullcontext() as index:
            s = Stack(engine, workdir, index)
            try:
                yield s
            finally:
                s.compose("down", "--remove-orphans", check=False, timeout=120)


def test_compose_build_gives_a_cpu_torch(stack: Stack) -> None:
    """BuildKit through `docker compose build`; the build itself checks torch's CUDA
    (the Dockerfile's last step of its torch install), and so does the image."""
    t0 = time.monotonic()
    stack.compose("build", "kvserve", timeout=1800)
    print(f"compose build: {time.monotonic() - t0:.0f} s")
    probe = "import torch; print(torch.__version__, torch.version.cuda)"
    got = stack.engine("run", "--rm", "--entrypoint", "python", "kvserve:cpu", "-c", probe)
    assert got.stdout.split() == ["2.13.0+cpu", "None"]
    size = stack.engine("image", "inspect", "-f", "{{.Size}}", "kvserve:cpu").stdout
    print(f"kvserve:cpu: {int(size) / 1e9:.2f} GB")


def test_the_gpu_variant_refuses_a_cpu_torch(stack: Stack) -> None:
    """The legacy builder (no BuildKit) on the GPU variant, given an index whose only
    torch is the CPU build: the build stops at the check, naming what it got."""
    if not stack.env["TORCH_INDEX_URL"]:
        pytest.skip("needs the local CPU-only torch index (a base whose pip trusts it)")
    got = stack.engine(
        "build", "--force-rm", "--build-arg", "VARIANT=gpu", "--build-arg",
        f"TORCH_INDEX_URL={stack.env['TORCH_INDEX_URL']}", "-t", "kvserve:check-gpu", ".",
        cwd=stack.src, env={"DOCKER_BUILDKIT": "0"}, check=False, timeout=1200,
    )  # fmt: skip
    assert got.returncode != 0
    assert "VARIANT=gpu got torch 2.13.0+cpu (CUDA: None)" in got.stdout + got.stderr


def test_up_serves_out_of_the_box(stack: Stack) -> None:
    """No variable set (every KVSERVE_* one reaches the container as ""), no Hugging Face
    cache on the host (Docker makes the folder, root's): the demo model serves."""
    t0 = time.monotonic()
    stack.up()
    print(f"compose up --wait: {time.monotonic() - t0:.0f} s")
    env = json.loads(
        stack.exec("python", "-c", "import json, os; print(json.dumps(dict(os.environ)))")
    )
    assert env["KVSERVE_MAX_NUM_SEQS"] == "" and env["KVSERVE_MODEL"] == ""
    assert stack.exec("stat", "-c", "%u", "/proc/1") == "10001"  # the cache given to it
    readme_curl = [
        "curl", "-fsS", "localhost:8000/v1/completions", "-H", "Content-Type: application/json",
        "-d", '{"prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0}',
    ]  # fmt: skip
    body = json.loads(run(*readme_curl).stdout)
    assert body["model"] == "kvserve-demo-random" and body["usage"]["completion_tokens"] == 16
    page = httpx.get(KVSERVE + "/", timeout=10)
    assert page.status_code == 200 and "<title>kvserve chat</title>" in page.text


def test_an_sse_stream(stack: Stack) -> None:
    body = {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 24,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    events = []
    with httpx.stream("POST", KVSERVE + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 24
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")) > 1


def test_prometheus_scrapes_and_every_dashboard_query_has_data(stack: Stack) -> None:
    with httpx.Client(base_url=KVSERVE, timeout=60) as c:
        for round_ in range(2):  # rates need two scrapes (5 s apart) that saw traffic
            for i in range(3):
                body = {"prompt": f"dashboard {round_} {i} " * 8, "max_tokens": 12}
                assert c.post("/v1/completions", json=body).status_code == 200
            assert c.post("/v1/completions", json={"prompt": "x", "top_p": 0}).status_code == 400
            time.sleep(11)
        assert "kvserve_requests_finished_total{" in c.get("/metrics").text
    targets = httpx.get(PROMETHEUS + "/api/v1/targets", timeout=10).json()["data"]
    health = [t["health"] for t in targets["activeTargets"] if t["labels"]["job"] == "kvserve"]
    assert health == ["up"]
    assert len(dashboard_queries()) >= 20
    empty = empty_dashboard_queries(PROMETHEUS, rate_window="60s", wait_s=60)
    assert not empty, "queries without data:\n" + "\n".join(empty)


def test_stop_drains_a_stream_and_exits_zero(stack: Stack) -> None:
    """`docker compose stop` sends SIGTERM during a long stream: the stream runs to its
    end, then the container exits 0."""
    # long enough to be running at SIGTERM, short enough to end within the 30 s drain on a
    # loaded 2-core machine
    body = {"prompt": "drain", "max_tokens": 300, "stream": True, "ignore_eos": True}
    result: dict[str, object] = {}

    def stream() -> None:
        with httpx.stream("POST", KVSERVE + "/v1/completions", json=body, timeout=120) as r:
            events = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 3:
                        result["started"] = time.monotonic()
            result["events"], result["ended"] = events, time.monotonic()

    reader = threading.Thread(target=stream)
    reader.start()
    deadline = time.monotonic() + 60
    while "started" not in result and time.monotonic() < deadline:
        time.sleep(0.01)
    stopping = time.monotonic()
    stack.compose("stop", "kvserve", timeout=120)
    reader.join(60)
    events = result["events"]
    assert isinstance(events, list) and events[-1] == "[DONE]"
    assert stopping < result["ended"]  # SIGTERM came while the stream ran
    texts = [json.loads(e)["choices"][0] for e in events[:-1] if json.loads(e)["choices"]]
    assert texts[-1]["finish_reason"] == "length"
    state = stack.engine("inspect", "-f", "{{.State.ExitCode}}", "kvserve-kvserve-1").stdout
    assert state.strip() == "0"


def test_a_hub_model_from_a_host_cache_of_another_uid(stack: Stack, tmp_path: Path) -> None:
    """KVSERVE_MODEL=org/name over a host cache laid out as huggingface_hub does and owned
    by a host user the image does not know: kvserve runs as that user, serves the model
    offline, and what it writes into the cache is that user's on the host."""
    cache = tmp_path / "hf"
    write_hub_cache(cache / "hub", HUB_MODEL)
    run("chown", "-R", f"{HOST_UID}:{HOST_UID}", str(cache))
    stack.env["HF_HOME"] = str(cache)
    stack.up(KVSERVE_MODEL=HUB_MODEL, HF_HUB_OFFLINE="1")
    assert stack.exec("stat", "-c", "%u:%g", "/proc/1") == f"{HOST_UID}:{HOST_UID}"
    models = httpx.get(KVSERVE + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [HUB_MODEL]
    body = {"model": HUB_MODEL, "prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True}
    got = httpx.post(KVSERVE + "/v1/completions", json=body, timeout=60)
    assert got.status_code == 200 and got.json()["usage"]["completion_tokens"] == 4
    stack.exec("sh", "-c", "echo written > /hf/hub/.kvserve-write-check", user=str(HOST_UID))
    written = cache / "hub" / ".kvserve-write-check"
    assert written.read_text() == "written\n" and written.stat().st_uid == HOST_UID


def test_down_leaves_nothing_running(stack: Stack) -> None:
    stack.compose("down", timeout=120)
    assert stack.running() == []
    networks = stack.engine(
        "network", "ls", "-q", "--filter", "label=com.docker.compose.project=kvserve"
    )
    assert networks.stdout.split() == []
