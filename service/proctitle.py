"""Each of kvserve's processes named for `ps` and `top` ("kvserve: engine core", "kvserve:
front 1", "kvserve: rank 1"): spawned processes would otherwise all read
`python3 -c from multiprocessing.spawn import spawn_main...`."""

from __future__ import annotations

import setproctitle


def name_process(role: str) -> None:
    """Name this process "kvserve: <role>" (its command line as ps shows it, and its
    thread name as top shows it)."""
    setproctitle.setproctitle(f"kvserve: {role}")


def name_thread(role: str) -> None:
    """Name the calling thread `role` as `top -H` and /proc/<pid>/task/<tid>/comm show it
    (15 characters kept)."""
    setproctitle.setthreadtitle(role)
