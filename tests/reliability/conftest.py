"""The reliability scenarios share one table: each test fills a row (its load, what it
measured) and the outcome is added from pytest's report. With KVSERVE_RELIABILITY_REPORT
set (`make reliability`), the table is written there as markdown at the end of the run."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from model.backends.cpu.isa import cpu_isa
from service.bench_report import cpu_model
from tests.factories import ENGINE_MODES, Server, start_server

ROWS: list[Row] = []


@dataclass
class Row:
    scenario: str
    load: str = ""
    measured: list[str] = field(default_factory=list)
    outcome: str = "not run"
    seconds: float = 0.0

    def add(self, text: str) -> None:
        self.measured.append(text)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator:
    report = yield
    if report.when == "call":
        item.stash[_OUTCOME] = report.outcome
    return report


_OUTCOME = pytest.StashKey[str]()


@pytest.fixture
def row(request: pytest.FixtureRequest) -> Iterator[Row]:
    doc = (request.function.__doc__ or request.function.__name__).strip().splitlines()[0]
    entry = Row(scenario=doc)
    start = time.monotonic()
    yield entry
    callspec = getattr(request.node, "callspec", None)
    modes = [v for v in (callspec.params.values() if callspec else ()) if v in ENGINE_MODES]
    if modes and modes[0] not in entry.load:  # which transport the row is of
        entry.load += f", {modes[0]}"
    entry.seconds = time.monotonic() - start
    entry.outcome = request.node.stash.get(_OUTCOME, "error")
    ROWS.append(entry)


# the order: input, disconnects, load, time, start-up, faults
ORDER = (
    "Fuzzing",
    "Oversized",
    "Prompt logprobs",
    "Hostile tool",
    "KV events",
    "Disk tier",
    "Forged",
    "Disconnect",
    "Grammar",
    "Overload",
    "Soak",
    "Bad checkpoints",
    "Kernel cache",
    "Non-finite",
    "Engine",
)


def harness(
    tmp_dir: object, *args: str, fault: str | None = None, mode: str = "engine-thread"
) -> Server:
    """A live `kvserve serve` through tests.reliability.harness (its /debug/state, and the
    fault `fault` injected), its engine core in a thread or a process (mode: a key of
    ENGINE_MODES)."""
    env = {"KVSERVE_TEST_FAULT": fault} if fault else None
    args = ("--engine-process", ENGINE_MODES[mode], *args)
    return start_server(str(tmp_dir), *args, module="tests.reliability.harness", env=env)


@pytest.fixture(params=list(ENGINE_MODES))
def mode(request: pytest.FixtureRequest) -> str:
    """A scenario run against both transports: the engine core in a thread, in a process."""
    return request.param


def engine_process(front: int) -> int:
    """The pid of the engine core process a `kvserve serve --engine-process on` started."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == front and cmdline.startswith(b"kvserve: engine core"):
            return int(stat.parent.name)
    raise AssertionError(f"no engine process under {front}")


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def _commit() -> str:
    commit = _git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return f"{commit} with uncommitted changes" if dirty else commit


def _rank(row: Row) -> int:
    return next((i for i, p in enumerate(ORDER) if row.scenario.startswith(p)), len(ORDER))


def render(rows: list[Row]) -> str:
    lines = [
        "# Reliability",
        "",
        "Each scenario runs against a real `kvserve serve` process (the random-weight demo",
        "model on the CPU) in `tests/reliability/`. Regenerate this file with",
        "`make reliability` (longer soak: `KVSERVE_SOAK_SECONDS=600 make reliability`).",
        "",
        f"Last run: {time.strftime('%Y-%m-%d %H:%M')} · commit {_commit()} · "
        f"{cpu_model()}, {os.cpu_count()} cores, kernels at {cpu_isa()}",
        "",
        "| Scenario | Load | Measured | Result |",
        "|---|---|---|---|",
    ]
    for r in sorted(rows, key=_rank):
        measured = "<br>".join(r.measured) or "—"
        lines.append(f"| {r.scenario} | {r.load} | {measured} | {r.outcome} ({r.seconds:.0f} s) |")
    return "\n".join(lines) + "\n"


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get("KVSERVE_RELIABILITY_REPORT")
    if path and ROWS:
        report = render(ROWS)  # before the file is opened: it is part of the commit's state
        with open(path, "w") as f:
            f.write(report)
