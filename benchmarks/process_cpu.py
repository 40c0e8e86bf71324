"""A server's CPU time by role, read from /proc: the engine core (its process, or the
thread named "engine core" in a server of one process), the fronts (every other thread of
a front process), the supervisor of several fronts, and tensor-parallel ranks. Each is
user + system time of every thread, dead threads included (a process's own figures)."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")
ENGINE_THREAD = "engine core"  # the in-thread core's name (service/proctitle.py)


def _stat(path: Path) -> tuple[str, int, float]:
    """(comm, parent pid, CPU seconds) from a /proc stat file."""
    text = path.read_text()
    comm, rest = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :]
    fields = rest.split()
    return comm, int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK


def _tree(pid: int) -> list[int]:
    """pid and every process descended from it."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = _stat(entry / "stat")[1]
            except (OSError, ValueError):
                continue
    found, frontier = [pid], [pid]
    while frontier:
        frontier = [p for p, parent in parents.items() if parent in frontier]
        found += frontier
    return found


def _role(title: str, top: bool) -> str:
    if "engine core" in title:
        return "engine core"
    if "kvserve: rank" in title:
        return "ranks"
    if "kvserve: front" in title or top:
        return "fronts"
    return "other"


def cpu_by_role(pid: int) -> dict[str, float]:
    """CPU seconds so far of the server whose top process is `pid`, by role. Where fronts
    run as processes of their own, the top process is their supervisor."""
    roles: Counter[str] = Counter()
    titles = {p: _title(p) for p in _tree(pid)}
    several = any("kvserve: front" in title for title in titles.values())
    for p, title in titles.items():
        try:
            role = "supervisor" if p == pid and several else _role(title, p == pid)
            total = _stat(Path(f"/proc/{p}/stat"))[2]
            if role == "fronts":  # a front's thread running the engine core, if any
                threads = [_stat(t / "stat") for t in Path(f"/proc/{p}/task").iterdir()]
                engine = sum(cpu for comm, _, cpu in threads if comm == ENGINE_THREAD)
                roles["engine core"] += engine
                total -= engine
            roles[role] += total
        except (OSError, ValueError):
            continue  # exited while read
    return dict(roles)


def _title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {role: after.get(role, 0.0) - before.get(role, 0.0) for role in after}
