"""The compiled-kernel cache shared between machines (a mounted home or volume): a
library built for one CPU is never loaded on another, and a cached library that does
not load is rebuilt instead of taking the server down."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from model.backends.cpu.kernels.build import c_compiler
from tests.reliability.conftest import Row
from tests.require import missing

pytestmark = pytest.mark.reliability  # make test-fast leaves these out

BUILD = """
import sys, model.backends.cpu.kernels.build as b
from model.backends.cpu.kernels.fused import fused_library
if len(sys.argv) > 1:
    b.cpu_identity = lambda: sys.argv[1]  # another machine's CPU
lib = fused_library()
print("loaded" if lib is not None else "none")
"""


def build(cache, *args: str) -> str:
    env = {"KVSERVE_KERNEL_CACHE": str(cache), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-c", BUILD, *args], capture_output=True, text=True, env=env, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_kernel_cache_is_keyed_by_cpu_and_survives_a_bad_library(tmp_path, row: Row) -> None:
    """Kernel cache shared between CPUs"""
    if c_compiler() is None:
        missing("cc", "no C compiler")
    cache = tmp_path / "kernels"
    assert build(cache) == "loaded"
    mine = sorted(cache.glob("fused-*.so"))
    assert build(cache, "vendor_id=OtherVendor|flags=sse2") == "loaded"
    both = sorted(cache.glob("fused-*.so"))
    new = [p for p in both if p not in mine]
    mine[0].write_bytes(b"not a shared library")  # truncated / foreign
    t0 = time.perf_counter()
    assert build(cache) == "loaded"
    rebuilt = time.perf_counter() - t0
    row.load = "one kernel cache directory used by this CPU and by a CPU with other features"
    row.add(
        f"libraries: {len(mine)} for this CPU, {len(new)} more for the other (names differ by "
        f"the CPU's model and flags); a corrupt cached library: rebuilt and loaded in {rebuilt:.1f} s"
    )
    assert len(mine) == 1 and len(new) == 1
    assert mine[0].read_bytes()[:4] == b"\x7fELF"  # rebuilt in place
