"""KVSERVE_REQUIRE turns a skip for something missing into a failure."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CASE = """
from tests.require import missing

def test_needs_a_tool():
    missing("some-tool", "not installed")
"""


def run(tmp_path: Path, require: str) -> str:
    case = tmp_path / "test_case.py"
    case.write_text(CASE)
    env = {"KVSERVE_REQUIRE": require, "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(case)],
        cwd=tmp_path, capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    return proc.stdout.strip().splitlines()[-1]


def test_a_required_missing_thing_fails_and_another_skips(tmp_path: Path) -> None:
    assert "1 skipped" in run(tmp_path, "")
    assert "1 skipped" in run(tmp_path, "something-else")
    assert "1 failed" in run(tmp_path, "cc,some-tool")
