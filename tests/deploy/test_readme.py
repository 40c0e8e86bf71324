"""The README and docs/ are true: their shell examples run as written against a live
server, every `kvserve` subcommand they name exists, every metric the table lists is
exported, every setting is in the configuration tables, and every link leads somewhere."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx

from tests.factories import Server
from tests.require import missing

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README = (ROOT / "README.md").read_text()
ALL_DOCS = "\n".join(p.read_text() for p in DOCS)
README_MAX_LINES = 250  # the front door: what it is, the commands, links to docs/


def sh_blocks() -> list[str]:
    return re.findall(r"```sh\n(.*?)```", ALL_DOCS, flags=re.S)


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
    named = set(re.findall(r"`kvserve (\w+)", ALL_DOCS)) | set(
        re.findall(r"kvserve (\w+) --", ALL_DOCS)
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
    rows = re.findall(r"^\| `(kvserve_\w+)` \| (\w+) \|", ALL_DOCS, flags=re.M)
    assert len(rows) > 20
    names = {line.split("{")[0].split(" ")[0] for line in exported.splitlines() if line[:1] != "#"}
    for name, kind in rows:
        wanted = f"{name}_bucket" if kind == "histogram" else name
        assert wanted in names, f"docs list {name} ({kind}); /metrics has no {wanted}"
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_every_environment_variable_kvserve_reads_is_in_the_configuration_tables() -> None:
    """Each setting's KVSERVE_* variable, and every KVSERVE_* name the code reads, is a row
    of docs/configuration.md's tables; every variable those rows name is read."""
    from dataclasses import fields

    from service.config import Settings

    section = (ROOT / "docs/configuration.md").read_text()
    documented = set(re.findall(r"^\|[^|\n]*\| `(KVSERVE_\w+)` \|", section, flags=re.M))
    documented |= set(re.findall(r"^\| `(KVSERVE_\w+)` \|", section, flags=re.M))
    settings = {"KVSERVE_" + f.name.upper() for f in fields(Settings)}
    sources = [p for d in ("model", "service") for p in (ROOT / d).rglob("*.py")]
    literal = {
        name for p in sources for name in re.findall(r"\"(KVSERVE_[A-Z0-9_]+)\"", p.read_text())
    }
    assert "KVSERVE_CPU_ISA" in literal and "KVSERVE_KERNEL_CACHE" in literal
    read = settings | literal
    assert read - documented == set(), "read by kvserve but not in the configuration tables"
    assert documented - read == set(), "in the configuration tables but read nowhere"


def test_the_readme_is_a_front_door() -> None:
    assert len(README.splitlines()) <= README_MAX_LINES
    linked = set(re.findall(r"\]\((docs/[\w.]+\.md)\)", README))
    assert {f"docs/{p.name}" for p in DOCS[1:]} <= linked | {"docs/decisions.md"}


def test_every_link_leads_somewhere() -> None:
    """Relative links name files that exist, and #anchors headings of the file."""
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path) if path else doc
            assert file.exists(), f"{doc.name} links to {target}: no such file"
            if anchor and file.suffix == ".md":
                slugs = {_slug(h) for h in re.findall(r"^#+ (.+)$", file.read_text(), re.M)}
                assert anchor in slugs, f"{doc.name} links to {target}: no such heading"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
