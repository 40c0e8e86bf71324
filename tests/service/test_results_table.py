"""benchmarks/results.py: the one results table, each benchmark's latest rows per machine."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def results_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    spec = importlib.util.spec_from_file_location("results", ROOT / "benchmarks/results.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "STORE", tmp_path / "results.json")
    monkeypatch.setattr(module, "TABLE", tmp_path / "results.md")
    monkeypatch.setattr(module, "ROOT", tmp_path)
    return module


def test_a_new_run_replaces_its_rows_for_its_machine_only(tmp_path, monkeypatch) -> None:
    results = results_module(tmp_path, monkeypatch)
    results.record("offline_throughput", {"bf16": "100 tok/s"}, where="cpu A")
    results.record("offline_throughput", {"bf16": "200 tok/s"}, where="cpu B")
    results.record("serve_vs_offline", {"64 streams": "91%"}, where="cpu A")
    results.record("offline_throughput", {"bf16": "150 tok/s"}, where="cpu A")
    table = (tmp_path / "results.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert len(rows) == 3
    assert "| `offline_throughput` | cpu A | bf16 | 150 tok/s |" in table
    assert "| `offline_throughput` | cpu B | bf16 | 200 tok/s |" in table
    assert "100 tok/s" not in table and "| `serve_vs_offline` | cpu A | 64 streams | 91% |" in table


def test_the_committed_table_is_the_store_rendered() -> None:
    """docs/results.md is what results.py renders from docs/results.json."""
    store, table = ROOT / "docs/results.json", ROOT / "docs/results.md"
    if not store.exists():
        assert not table.exists()
        return
    import json

    entries = json.loads(store.read_text())
    text = table.read_text()
    for e in entries:
        for measure, result in e["rows"].items():
            assert f"| `{e['benchmark']}` | {e['machine']} | {measure} | {result} |" in text
