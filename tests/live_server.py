"""A real `kvserve serve` process on 127.0.0.1 with a random free port."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

from service.launch import free_port


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log_path: str

    def client(self, **kw: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kw)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def wait_idle(self, timeout: float = 10.0) -> dict:
        """Wait until no request runs or waits and no KV block is in use."""
        deadline = time.monotonic() + timeout
        while True:
            h = self.health()
            if (h["running"], h["waiting"], h["kv_cache"]["blocks_used"]) == (
                0,
                0,
                0,
            ) or time.monotonic() > deadline:
                return h
            time.sleep(0.05)

    def wait_healthy(self, timeout: float = 120.0) -> Server:
        """Wait until /health answers 200 (servers started with wait=False start side by
        side: their imports overlap)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {_tail(self.log_path)}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server did not become healthy: {_tail(self.log_path)}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def _tail(path: str) -> str:
    with open(path) as f:
        return f.read()[-2000:]


def start_server(
    tmp_dir: str,
    *args: str,
    wait: bool = True,
    module: str = "service.cli",
    env: dict[str, str] | None = None,
) -> Server:
    """`python -m <module> serve --port <free> ...`; `module` may be a launcher that wraps
    the real CLI (tests.reliability.harness), `env` adds environment variables."""
    port = free_port()
    log_path = os.path.join(tmp_dir, f"server-{port}.log")
    cmd = [
        sys.executable,
        "-m",
        module,
        "serve",
        "--port",
        str(port),
        "--kv-cache-gib",
        "0.25",
        *args,
    ]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    server = Server(proc, f"http://127.0.0.1:{port}", log_path)
    return server.wait_healthy() if wait else server
