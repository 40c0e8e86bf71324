"""The house's size rule, checked: no module of the engine (service/engine/) over 300
lines, so each part of a step stays readable in a sitting (DESIGN.md: small files)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE_MAX_LINES = 300


def test_no_engine_module_is_over_300_lines() -> None:
    sizes = {
        p.name: len(p.read_text().splitlines()) for p in (ROOT / "service/engine").glob("*.py")
    }
    assert len(sizes) > 20  # the folder was read
    assert {name: n for name, n in sizes.items() if n > ENGINE_MAX_LINES} == {}
