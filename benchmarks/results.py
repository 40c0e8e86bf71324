"""The one table of current results: docs/results.md, rewritten by the benchmarks
themselves. Each product benchmark ends with `record(...)`, which replaces that
benchmark's rows for this machine in docs/results.json (kept in git) and renders the
table again, so the table always holds each benchmark's latest run on each machine,
with the CPU (or GPU) and the command that made it.

    PYTHONPATH=. .venv/bin/python benchmarks/results.py   # render the table again
"""

from __future__ import annotations

import datetime
import json
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STORE = ROOT / "docs" / "results.json"
TABLE = ROOT / "docs" / "results.md"
HEAD = """# Results

The latest run of each product benchmark on each machine it ran on, written by the
benchmarks themselves (`benchmarks/results.py`; do not edit by hand). Random-weight
checkpoints of the shapes named; the decisions these numbers led to are in
[decisions.md](decisions.md).

| benchmark | machine | measure | result | run on | command |
|---|---|---|---|---|---|
"""


def machine() -> str:
    """The CPU this ran on, by its model name and numbers (and the GPU, where one ran)."""
    from service.bench_report import cpu_model

    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name()} (host: {cpu_model()})"
    except ImportError:
        pass
    return cpu_model()


def record(benchmark: str, rows: dict[str, str], where: str | None = None) -> None:
    """Replace `benchmark`'s rows for this machine with `rows` (measure -> result)."""
    store = json.loads(STORE.read_text()) if STORE.exists() else []
    where = where or machine()
    store = [e for e in store if (e["benchmark"], e["machine"]) != (benchmark, where)]
    command = "PYTHONPATH=. python " + shlex.join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
    day = datetime.date.today().isoformat()
    store.append(
        {"benchmark": benchmark, "machine": where, "rows": rows, "date": day, "command": command}
    )
    store.sort(key=lambda e: (e["benchmark"], e["machine"]))
    STORE.write_text(json.dumps(store, indent=2) + "\n")
    render(store)
    print(f"recorded in {TABLE.relative_to(ROOT)}")


def render(store: list[dict]) -> None:
    lines = [
        f"| `{e['benchmark']}` | {e['machine']} | {measure} | {result} | {e['date']} | "
        f"`{e['command']}` |"
        for e in store
        for measure, result in e["rows"].items()
    ]
    TABLE.write_text(HEAD + "\n".join(lines) + "\n")


if __name__ == "__main__":
    render(json.loads(STORE.read_text()) if STORE.exists() else [])
