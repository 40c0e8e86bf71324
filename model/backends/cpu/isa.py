"""The CPU's instruction-set levels and the compiler flags that build kvserve's C kernels
for each, read from /proc/cpuinfo; KVSERVE_CPU_ISA holds the kernels to a lower level."""

from __future__ import annotations

import functools
import os
from pathlib import Path


@functools.cache
def _cpuinfo(field: str) -> str:
    """The first CPU's `field` in /proc/cpuinfo ('' where Linux does not report it)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    line = next((line for line in text.splitlines() if line.startswith(field)), "")
    return line.partition(":")[2].strip()


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (empty where it does not)."""
    return frozenset(_cpuinfo("flags").split())


# The instruction-set levels kvserve's C kernels are built for, lowest first: the CPU
# flags each needs, and the compiler flags that hold a -march=native build to it (so a
# machine can build and test every level up to its own).
_NO_AMX = ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")
ISA_LEVELS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "avx2": (("avx2", "fma"), ("-mno-avx512f", *_NO_AMX)),
    "avx512f": (("avx512f", "avx512bw"), ("-mno-avx512bf16", "-mno-avx512vnni", *_NO_AMX)),
    "avx512-bf16": (("avx512f", "avx512bw", "avx512_bf16"), _NO_AMX),
    "amx": (("amx_tile", "amx_bf16", "avx512_bf16"), ()),
}
ISA_ENV = "KVSERVE_CPU_ISA"  # run the kernels at a lower level than the CPU's own


def isa_missing(level: str) -> tuple[str, ...]:
    """The CPU flags this machine lacks for `level` (empty: it can run it)."""
    return tuple(f for f in ISA_LEVELS[level][0] if f not in cpu_flags())


def native_isa() -> str:
    """The highest level this CPU runs ('baseline' below AVX2 + FMA)."""
    return next((lv for lv in reversed(ISA_LEVELS) if not isa_missing(lv)), "baseline")


def cpu_has_amx() -> bool:
    """Whether the CPU has the AMX tile unit with bf16 support."""
    return native_isa() == "amx"


def cpu_isa() -> str:
    """The level the C kernels run at: the CPU's own, or KVSERVE_CPU_ISA's below it."""
    return _resolve_isa(os.environ.get(ISA_ENV) or None)


@functools.cache
def _resolve_isa(forced: str | None) -> str:
    if forced is None:
        return native_isa()
    if forced not in ISA_LEVELS:
        raise ValueError(f"{ISA_ENV} must be one of {list(ISA_LEVELS)}, got {forced!r}")
    if missing := isa_missing(forced):
        raise ValueError(
            f"{ISA_ENV}={forced} needs CPU flags {', '.join(missing)}, which this CPU "
            f"lacks (it runs up to {native_isa()})"
        )
    return forced


def cpu_vendor() -> str:
    """The CPU's vendor as Linux reports it ('GenuineIntel', 'AuthenticAMD'; '' where not)."""
    return _cpuinfo("vendor_id")


def onednn_packs_bf16() -> bool:
    """Whether torch's oneDNN takes a prepacked bf16 weight on this CPU: it needs
    AVX-NE-CONVERT or AVX-512 BW/VL/DQ (torch refuses the reorder otherwise). An
    AVX2-only CPU (AMD Zen 3, Intel before Skylake-SP) has neither; there a bf16 linear
    outside the shapes of kvserve's kernels stays with F.linear."""
    flags = cpu_flags()
    return "avx_ne_convert" in flags or {"avx512bw", "avx512vl", "avx512dq"} <= flags


def prefer_fma(level: str) -> bool:
    """Whether the compute-bound bf16 work at `level` multiplies as bf16 -> float32 and
    FMA rather than with vdpbf16ps: the linears' passes of four rows or more (a batch's
    decode step, a prefill; the same bits either way) and the bf16 attention (the float32
    kernel of the avx512f level). Below avx512-bf16 there is no other way. At avx512-bf16,
    on Intel's cores: vdpbf16ps issues at a quarter of the 512-bit FMA's rate there, half
    its FLOPs. Not on AMD's, where the avx512f level's FMAs measured slower (both in
    docs/decisions.md). The amx level keeps vdpbf16ps (its bf16 linears and, where the shape
    fits, attention are on the tile unit, one or two rows' linears in FMAs that add as
    the tiles do, kernels/linear_bf16.c; the rest was not measured)."""
    return level in ("avx512f", "avx2") or (
        level == "avx512-bf16" and cpu_vendor() == "GenuineIntel"
    )


def isa_flags(level: str) -> tuple[str, ...]:
    """Compiler flags, after -march=native, for a build at `level` (PREFER_FMA where
    prefer_fma says so at a level that has vdpbf16ps)."""
    flags = ISA_LEVELS[level][1] if level in ISA_LEVELS else ()
    return (*flags, "-DPREFER_FMA") if level == "avx512-bf16" and prefer_fma(level) else flags
