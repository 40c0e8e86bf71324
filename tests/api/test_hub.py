"""Models by Hugging Face repo id (and one GGUF file of a repo): served from a Hub cache
laid out as huggingface_hub lays it out (refs/main -> snapshots/<commit>/...) with the
network off, and one-line
errors for a model not in the cache, an unknown repo and a gated one (the last two from
a stand-in Hub on 127.0.0.1 that answers the way the Hub does)."""

import http.server
import os
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from tests.factories import free_port, start_server, write_hub_cache
from tests.gguf_files import write_gguf

pytestmark = pytest.mark.slow


def kvserve(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "service.cli", *args],
        capture_output=True, text=True, env={**os.environ, **env}, timeout=120, check=False,
    )  # fmt: skip


def assert_serves_offline(tmp_path: Path, model: str, cache: Path, served_as: str) -> None:
    """`--model model` from the cache with the network off: listed as served_as, and a
    completion answered."""
    srv = start_server(
        str(tmp_path), "--model", model, "--download-dir", str(cache),
        env={"HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    try:
        models = httpx.get(srv.url + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == [served_as]
        body = {"model": served_as, "prompt": [5, 6, 7], "max_tokens": 4}
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        srv.stop()


def test_serve_a_repo_id_from_the_cache_offline(tmp_path: Path) -> None:
    cache = tmp_path / "hf"
    snapshot = write_hub_cache(cache, "org/tiny-llama")
    env = {"HF_HUB_OFFLINE": "1"}
    assert_serves_offline(tmp_path, "org/tiny-llama", cache, "org/tiny-llama")
    got = kvserve("download", "org/tiny-llama", "--download-dir", str(cache), env=env)
    assert got.returncode == 0 and got.stdout.strip() == str(snapshot)


def test_a_gguf_file_of_a_repo_serves_from_the_cache_offline(tmp_path: Path) -> None:
    """One GGUF file of a repo, named as llama.cpp and Ollama name it (`org/repo:QUANT`,
    any case) or by its path (`org/repo/file.gguf`): from the cache with the network
    off, served under the file's name; a QUANT the repo lacks fails in one line."""
    cache = tmp_path / "hf"
    snapshot = write_hub_cache(cache, "org/tiny-GGUF")
    for name in ("tiny-Q4_0.gguf", "tiny-Q8_0.gguf"):
        write_gguf(snapshot, snapshot / name)
    env = {"HF_HUB_OFFLINE": "1"}
    assert_serves_offline(tmp_path, "org/tiny-GGUF:q4_0", cache, "tiny-Q4_0")
    got = kvserve("download", "org/tiny-GGUF/tiny-Q8_0.gguf", "--download-dir", str(cache),
                  env=env)  # fmt: skip
    assert got.returncode == 0 and got.stdout.strip() == str(snapshot / "tiny-Q8_0.gguf")
    out = kvserve("download", "org/tiny-GGUF:Q5_K_M", "--download-dir", str(cache), env=env)
    line = next(x for x in out.stderr.splitlines() if x.startswith("kvserve: error:"))
    assert out.returncode != 0 and "no GGUF files ending in Q5_K_M.gguf" in line


def test_a_split_gguf_file_of_a_repo_is_named_by_its_quant(tmp_path: Path) -> None:
    """A repo's split GGUF files, as the large ones are published: NAME-QUANT-00001-of-
    0000N.gguf beside the others, or in a QUANT folder; `org/repo:QUANT` names the first
    shard (its shards come with it), served under NAME-QUANT."""
    cache = tmp_path / "hf"
    snapshot = write_hub_cache(cache, "org/big-GGUF")
    (snapshot / "Q4_K_M").mkdir()
    write_gguf(snapshot, snapshot / "Q4_K_M" / "big-Q4_K_M.gguf", split_max_tensors=8)
    q6 = write_gguf(snapshot, snapshot / "big-Q6_K.gguf", split_max_tensors=8)
    env = {"HF_HUB_OFFLINE": "1"}
    assert_serves_offline(tmp_path, "org/big-GGUF:q4_k_m", cache, "big-Q4_K_M")
    got = kvserve("download", "org/big-GGUF:Q6_K", "--download-dir", str(cache), env=env)
    assert got.returncode == 0 and got.stdout.strip() == str(q6)
    assert q6.name.startswith("big-Q6_K-00001-of-")


def test_a_model_not_in_the_cache_fails_in_one_line(tmp_path: Path) -> None:
    cache = tmp_path / "hf"
    cache.mkdir()
    env = {"HF_HUB_OFFLINE": "1"}
    port = str(free_port())
    out = kvserve("serve", "--model", "org/absent", "--download-dir", str(cache), "--port", port,
                  env=env)  # fmt: skip
    assert out.returncode != 0
    line = next(x for x in out.stderr.splitlines() if x.startswith("kvserve: error:"))
    assert "'org/absent' is not in the Hugging Face cache" in line and "kvserve download" in line


class FakeHub(http.server.BaseHTTPRequestHandler):
    """Answers every model lookup the way the Hub does for an unknown or a gated repo."""

    def do_GET(self) -> None:
        gated = "/gated" in self.path
        self.send_response(403 if gated else 404)
        self.send_header("X-Error-Code", "GatedRepo" if gated else "RepoNotFound")
        self.send_header("X-Error-Message", "gated" if gated else "Repository not found")
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": "no"}')

    do_HEAD = do_GET

    def log_message(self, *args: object) -> None:
        pass


def test_unknown_and_gated_repos_fail_in_one_line(tmp_path: Path) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = {
        "HF_ENDPOINT": f"http://127.0.0.1:{server.server_address[1]}",
        "HF_HUB_OFFLINE": "0",
        "HF_TOKEN": "",
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    try:
        cache = str(tmp_path / "hf")
        unknown = kvserve("download", "org/unknown", "--download-dir", cache, env=env)
        gated = kvserve("download", "org/gated", "--download-dir", cache, env=env)
    finally:
        server.shutdown()
    assert unknown.returncode == 2 and gated.returncode == 2
    assert unknown.stderr.strip().splitlines()[-1] == (
        "kvserve: error: model 'org/unknown': no such repository on the Hugging Face Hub "
        "(or a private one: set HF_TOKEN)"
    )
    assert "is gated on the Hugging Face Hub" in gated.stderr.strip().splitlines()[-1]
