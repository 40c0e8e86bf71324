"""Building the C kernels: each source compiled once per machine with the system C
compiler and loaded with ctypes; where no compiler is available the callers fall back to
torch ops.

The build goes to $KVSERVE_KERNEL_CACHE (default ~/.cache/kvserve/kernels), named by a
hash of the source and flags, so a changed kernel is rebuilt and a built one is reused.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from model.backends.cpu.isa import cpu_isa

log = logging.getLogger("kvserve.kernels")

HERE = Path(__file__).parent
CACHE_ENV = "KVSERVE_KERNEL_CACHE"  # where built libraries are kept (empty: the default)
DISABLE_ENV = "KVSERVE_DISABLE_KERNELS"  # any non-empty value: build none
HEADER = HERE / "kvserve.h"  # the prototypes and structs every kernel source includes
BASE_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fPIC"]
# Linked in a separate step without the math flags: linking with -ffast-math would add
# crtfastmath.o, whose constructor sets flush-to-zero for the whole process on load.
LINK_FLAGS = ["-shared", "-fopenmp"]

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
# q, k, v, tables, row_seq, lens, skip, out; R, q_stride, KV, max_blocks; scale, softcap;
# alibi; nthreads
_ATTENTION = [_P] * 8 + [_I] * 4 + [_F, _F, _P, _I]
# The ctypes mirror of kvserve.h's prototypes (result, arguments); a test checks it
# against the header.
PROTOTYPES: dict[str, tuple[type | None, list[type]]] = {
    **{f"add_rms_norm_{t}": (None, [_P, _P, _P, _P, _I, _I, _F, _I]) for t in ("f32", "bf16")},
    **{
        f"rope_store_{t}": (None, [_P, _P, _P, _I, _I, _I, _I, _P, _P, _P, _P, _I, _I])
        for t in ("f32", "bf16")
    },
    **{
        f"qk_norm{whole}_{t}": (None, [_P, _P, _P, _I, _I, _I, _I, _F, _I])
        for t in ("f32", "bf16")
        for whole in ("", "_all")
    },
    **{f"geglu_{t}": (None, [_P, _P, _I, _I, _I]) for t in ("f32", "bf16")},
    **{f"softcap_{t}": (None, [_P, _I, _I, _F, _I]) for t in ("f32", "bf16")},
    **{f"greedy_{t}": (None, [_P, _I, _I, _P, _I]) for t in ("f32", "bf16")},
    "paged_attention_f32": (None, _ATTENTION),
    "paged_attention_bf16": (None, _ATTENTION),
    "paged_attention_amx": (None, _ATTENTION),
    "paged_attention_amx_init": (_I, []),
    "linear_bf16_init": (_I, []),
    "linear_bf16": (None, [_P, _P, _P, _P, _P, _I, _I, _I, _I]),
    "linear_bf16_vec": (None, [_P, _P, _P, _P, _P, _I, _I, _I, _I]),
    "linear_int8": (None, [_P, _P, _P, _P, _P, _I, _I, _I, _I]),
    "linear_int4": (None, [_P, _P, _P, _P, _P, _I, _I, _I, _I]),
    "linear_int5": (None, [_P, _P, _P, _P, _P, _I, _I, _I, _I]),
    "linear_int8g": (None, [_P, _P, _P, _P, _P, _I, _I, _I, _I]),
    "int8g_quantize": (None, [_P, _P, _P, _I, _I, _I]),
    "int4_quantize": (None, [_P, _P, _P, _P, _I, _I, _I, _I]),
    "int5_quantize": (None, [_P, _P, _P, _P, _I, _I]),
    "linear_vec_init": (_I, []),
    "stack_forward": (None, [_P]),
    "experts_forward": (None, [_P]),
    "experts_route": (None, [_P, _I, _I, _I, _I, _I, _P, _P]),
}


def bind(lib: ctypes.CDLL, *names: str) -> None:
    for name in names:
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = PROTOTYPES[name]


def _cache_dir() -> Path:
    default = Path.home() / ".cache" / "kvserve" / "kernels"
    return Path(os.environ.get(CACHE_ENV) or default)


def cpu_identity() -> str:
    """What -march=native compiles for: the CPU's model and feature flags. Part of every
    cached library's name, so a cache shared between machines (a mounted home or volume)
    never hands one CPU a library built for another (which would die with SIGILL)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    keys = ("vendor_id", "cpu family", "model", "model name", "flags")
    lines = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in keys and key.strip() not in lines:
            lines[key.strip()] = value.strip()
    return "|".join(f"{k}={lines.get(k, '')}" for k in keys)


def c_compiler() -> str | None:
    """The C compiler the kernels are built with (cc, else gcc); None where there is none."""
    return shutil.which("cc") or shutil.which("gcc")


@functools.cache
def build(source: str, flags: tuple[str, ...], tag: str) -> ctypes.CDLL | None:
    """Compile HERE/source with flags once per machine and CPU (cached by hash) and load
    it; a cached library that does not load is built again once."""
    if os.environ.get(DISABLE_ENV):
        return None
    compiler = c_compiler()
    if compiler is None:
        log.warning("no C compiler found: %s runs as torch ops", source)
        return None
    path = HERE / source
    recipe = " ".join([*flags, "|", *LINK_FLAGS, "|", cpu_identity()]).encode()
    # the headers the sources include are part of what is built
    headers = b"".join(h.read_bytes() for h in sorted(HERE.glob("*.h")))
    digest = hashlib.sha256(path.read_bytes() + headers + recipe).hexdigest()[:16]
    target = _cache_dir() / f"{path.stem}-{tag}-{digest}.so"
    for attempt in (1, 2):
        if not target.exists() and not _compile(compiler, path, flags, target):
            return None
        try:
            return ctypes.CDLL(str(target))
        except OSError as exc:  # truncated or foreign: build it again, once
            log.warning("cached kernel %s does not load (%s): rebuilding", target, exc)
            if attempt == 1:
                target.unlink(missing_ok=True)
    log.warning("%s does not load after a rebuild, using torch ops", source)
    return None


def _compile(compiler: str, path: Path, flags: tuple[str, ...], target: Path) -> bool:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, out = Path(tmp) / f"{path.stem}.o", Path(tmp) / target.name
        for cmd in (
            [compiler, *flags, "-c", str(path), "-o", str(obj)],
            [compiler, *LINK_FLAGS, str(obj), "-o", str(out), "-lm"],
        ):
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                log.warning("building %s failed, using torch ops:\n%s", path.name, proc.stderr)
                return False
        os.replace(out, target)
    return True


def data_ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's address for a kernel argument; None (NULL) for no tensor."""
    return None if t is None else t.data_ptr()


def vector_level() -> str:
    """The vector code's level here: the CPU's (or KVSERVE_CPU_ISA's), AVX-512-BF16 on
    AMX CPUs (their vector kernels are the avx512-bf16 build)."""
    isa = cpu_isa()
    return "avx512-bf16" if isa == "amx" else isa
