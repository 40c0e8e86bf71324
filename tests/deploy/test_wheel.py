"""What users install: the wheel `pip install .` builds (what the Dockerfile runs),
installed non-editable into a fresh venv with the pinned torch, serves from there: the
chat page, a completion on the C kernels, /metrics."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import httpx
import pytest

from tests.factories import Server, free_port

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def run(*cmd: str, cwd: Path | None = None) -> None:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"


def source_tree(dest: Path) -> Path:
    """The checkout's files as a fresh clone has them: no build/ or *.egg-info left by an
    earlier build (they can carry files into a wheel that a clean build would lack)."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    for name in listed:
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def test_the_built_wheel_serves(tmp_path: Path) -> None:
    src = source_tree(tmp_path / "src")
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(src))
    wheel = next(tmp_path.glob("kvserve-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("model/backends/cpu/kernels/fused.c", "model/backends/cpu/kernels/kvserve.h",
                   "service/api/static/index.html"):  # fmt: skip
        assert needed in names, f"the wheel lacks {needed}"
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", str(venv))
    py = str(venv / "bin" / "python")
    constraints = str(ROOT / "constraints.txt")
    # --no-compile: Python compiles what the server imports when it imports it (pip's
    # byte-compiling all of torch took half of this test)
    install = (py, "-m", "pip", "install", "-q", "--no-compile", "-c", constraints)
    run(*install, "torch==2.13.0")
    run(*install, str(wheel))
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "KVSERVE_KERNEL_CACHE": str(tmp_path / "k")}
    log = tmp_path / "server.log"
    with open(log, "w") as out:  # run from elsewhere: nothing of the checkout on the path
        proc = subprocess.Popen(
            [str(venv / "bin" / "kvserve"), "serve", "--port", str(port), "--kv-cache-gib", "0.25"],
            cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        Server(proc, url, str(log)).wait_healthy()  # fails with the log's tail if it exits
        page = httpx.get(url + "/", timeout=10)
        assert page.status_code == 200 and "<html" in page.text.lower()
        body = {"prompt": "Hello", "max_tokens": 8, "temperature": 0}
        done = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert done.status_code == 200, done.text
        assert done.json()["usage"]["completion_tokens"] == 8
        card = httpx.get(url + "/v1/models/kvserve-demo-random", timeout=10).json()
        assert card["memory"]["attention_backend"]["name"] == "cpu"  # the C kernels compiled
        assert "kvserve_generation_tokens_total" in httpx.get(url + "/metrics", timeout=10).text
        site = subprocess.run(
            [py, "-c", "import model, service; print(model.__file__, service.__file__)"],
            cwd=tmp_path, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        assert str(ROOT) not in site  # the installed copy, not the checkout
    finally:
        proc.terminate()
        proc.wait(30)
