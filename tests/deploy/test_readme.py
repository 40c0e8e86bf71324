"""The README is true: its shell examples run as written against a live server, every
`kvserve` subcommand it names exists, and every metric its table lists is exported."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx

from tests.live_server import Server
from tests.require import missing

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def sh_blocks() -> list[str]:
    return re.findall(r"```sh\n(.*?)```", README, flags=re.S)


def test_the_curl_examples_run_as_written(server: Server) -> None:
    if shutil.which("curl") is None:
        missing("curl", "the README's examples use it")
    blocks = [b for b in sh_blocks() if b.lstrip().startswith("curl")]
    assert blocks, "no curl examples found"
    port = server.url.rsplit(":", 1)[1]
    for block in blocks:
        script = block.replace("localhost:8000", f"127.0.0.1:{port}")
        out = subprocess.run(
            ["bash", "-e", "-c", script], capture_output=True, text=True, timeout=120, check=False
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.count('"choices"') >= 2 and "data: [DONE]" in out.stdout
        assert '"error"' not in out.stdout


def test_every_kvserve_command_named_exists() -> None:
    named = set(re.findall(r"`kvserve (\w+)", README)) | set(
        re.findall(r"kvserve (\w+) --", README)
    )
    assert {"serve", "plan", "bench", "generate", "audit", "download"} <= named
    for command in sorted(named):
        out = subprocess.run(
            [sys.executable, "-m", "service.cli", command, "--help"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert out.returncode == 0, f"kvserve {command}: {out.stderr}"


def test_every_metric_in_the_table_is_exported(server: Server) -> None:
    with server.client() as c:  # traffic first: some series appear on first use
        body = {"prompt": "metrics", "max_tokens": 4}
        assert c.post("/v1/completions", json=body).status_code == 200
        assert c.post("/v1/completions", json={"prompt": ""}).status_code == 400
        exported = c.get("/metrics").text
    rows = re.findall(r"^\| `(kvserve_\w+)` \| (\w+) \|", README, flags=re.M)
    assert len(rows) > 20
    names = {line.split("{")[0].split(" ")[0] for line in exported.splitlines() if line[:1] != "#"}
    for name, kind in rows:
        wanted = f"{name}_bucket" if kind == "histogram" else name
        assert wanted in names, f"README lists {name} ({kind}); /metrics has no {wanted}"
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_every_environment_variable_kvserve_reads_is_in_the_configuration_tables() -> None:
    """Each setting's KVSERVE_* variable, and every KVSERVE_* name the code reads, is a row
    of the README's configuration tables; every variable those rows name is read."""
    from dataclasses import fields

    from service.config import Settings

    section = README.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\|[^|\n]*\| `(KVSERVE_\w+)` \|", section, flags=re.M))
    documented |= set(re.findall(r"^\| `(KVSERVE_\w+)` \|", section, flags=re.M))
    settings = {"KVSERVE_" + f.name.upper() for f in fields(Settings)}
    sources = [p for d in ("model", "service") for p in (ROOT / d).rglob("*.py")]
    literal = {
        name for p in sources for name in re.findall(r"\"(KVSERVE_[A-Z0-9_]+)\"", p.read_text())
    }
    assert "KVSERVE_CPU_ISA" in literal and "KVSERVE_KERNEL_CACHE" in literal
    read = settings | literal
    assert read - documented == set(), "read by kvserve but not in the README's tables"
    assert documented - read == set(), "in the README's tables but read nowhere"
