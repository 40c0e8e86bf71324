"""Comments say what and why: none in the code cites the lab notebook, a round of work, a
virtual machine or a measured timing, which all go stale (the numbers behind a decision
are in docs/decisions.md, written once)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("model", "service", "benchmarks", "tests")
SUFFIXES = {".py", ".c", ".h", ".sh"}
NUMBER_WORDS = (
    "one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|thirteen|fourteen|"
    "fifteen|sixteen|seventeen|eighteen|nineteen|twenty|thirty|forty|[a-z]+ty-[a-z]+"
)
STALE = {
    "the lab notebook": re.compile(r"RESULTS\.md"),
    "a round of work": re.compile(rf"(?<!-)\brounds? ({NUMBER_WORDS}|[0-9]+)\b"),
    "a virtual machine": re.compile(r"\bVMs?\b"),
    "a timing": re.compile(r"\b[0-9][0-9.,]*(-[0-9.,]+)? ?(ms|µs|us|ns)\b"),
}


def sources() -> list[Path]:
    found = [p for d in FOLDERS for p in (ROOT / d).rglob("*") if p.suffix in SUFFIXES]
    return sorted(p for p in found if p != Path(__file__))


def test_the_patterns_catch_what_they_are_for() -> None:
    said = "measured 12 ms on the VM (benchmarks/RESULTS.md, round twenty-six)"
    assert all(p.search(said) for p in STALE.values())
    plain = "a timeout_ms of 40, rounds of 3 steps, --rounds 6"
    assert not any(p.search(plain) for p in STALE.values())


def test_no_code_cites_a_round_a_vm_or_a_timing() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{n}: {what}: {line.strip()}"
        for path in sources()
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        for what, pattern in STALE.items()
        if pattern.search(line)
    ]
    assert not found, "\n".join(found)
