"""The Triton kernels compile for an H100 (sm_90) here, without a GPU: Triton's compiler
and the ptxas it ships, in a process without the interpreter (tests/model/triton_sm90.py
lists the launches compiled). The interpreter the other tests run the kernels in does
not type-check or lower them as the GPU compiler does."""

import os
import subprocess
import sys
from pathlib import Path

from tests.require import missing

ROOT = Path(__file__).resolve().parents[2]


def test_every_kernel_compiles_for_sm90(tmp_path: Path) -> None:
    try:
        import triton  # noqa: F401
    except ImportError:
        missing("triton", "the Triton kernels cannot be compiled without triton")
    from tests.model.triton_sm90 import VARIANTS  # imports triton

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compiled here, not taken from a cache
    proc = subprocess.run(
        [sys.executable, "-m", "tests.model.triton_sm90"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    done = [ln for ln in proc.stdout.splitlines() if ln.startswith("ok ")]
    assert len(done) == len(VARIANTS), proc.stdout
    assert all("sm_90 code" in ln for ln in done)
