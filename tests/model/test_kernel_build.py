"""What the compiler makes of the kernel sources: the prefetches they ask for are in the
machine code. A helper whose only effect is prefetching looks side-effect free to GCC,
which then deletes the calls to it without a word (common.h's PREFETCH_HELPER); these
tests compile each source for every instruction-set level, whatever CPU runs them (a
named -march for each level, object files only, nothing executed), and read the
disassembly."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from model.backends.cpu.isa import ISA_LEVELS, isa_flags
from model.backends.cpu.kernels.attention import ATTENTION_FLAGS
from model.backends.cpu.kernels.build import HERE, c_compiler
from model.backends.cpu.kernels.linear import VECTOR_FLAGS
from tests.require import missing

# A CPU of each level for -march (the builds themselves use -march=native).
MARCH = {
    "avx2": "haswell",
    "avx512f": "skylake-avx512",
    "avx512-bf16": "cooperlake",
    "amx": "sapphirerapids",
}


def test_every_level_has_a_march() -> None:
    assert set(MARCH) == set(ISA_LEVELS)


def functions(source: str, flags: list[str], level: str, tmp: Path) -> dict[str, list[str]]:
    """source compiled as the build compiles it at `level`, but for MARCH[level]: each
    function's instruction mnemonics."""
    compiler = c_compiler()
    if compiler is None:
        missing("cc", "no C compiler")
    if shutil.which("objdump") is None:
        missing("cc", "no objdump (binutils, which the C compiler comes with)")
    march = [f"-march={MARCH[level]}" if f == "-march=native" else f for f in flags]
    obj = tmp / f"{Path(source).stem}-{level}.o"
    cmd = [compiler, *march, *isa_flags(level), "-c", str(HERE / source), "-o", str(obj)]
    built = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert built.returncode == 0, built.stderr
    listing = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", str(obj)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    found: dict[str, list[str]] = {}
    current = None
    for line in listing.splitlines():
        if head := re.match(r"^[0-9a-f]+ <(.+)>:$", line):
            current = found.setdefault(head.group(1), [])
        elif current is not None and (insn := re.match(r"^\s+[0-9a-f]+:\s+(\S+)", line)):
            current.append(insn.group(1))
    return found


def mnemonics_of(found: dict[str, list[str]], entry: str) -> list[str]:
    """The instructions of `entry` and its OpenMP bodies (entry._omp_fn.N)."""
    ops = [op for name, body in found.items() if name.split(".")[0] == entry for op in body]
    assert ops, f"no function {entry} in {sorted(found)}"
    return ops


@pytest.mark.parametrize("level", list(ISA_LEVELS))
def test_linear_tiles_keep_their_k_step_prefetch(level: str, tmp_path: Path) -> None:
    """linear_vec.c's tiles fetch the weights PREFETCH bytes ahead into L1 (prefetch_step,
    prefetcht0) in the bf16 and the int8 linears: without it one row's linears took far
    longer (docs/decisions.md)."""
    found = functions("linear_vec.c", VECTOR_FLAGS, level, tmp_path)
    for entry in ("linear_bf16_vec", "linear_int8"):
        assert "prefetcht0" in mnemonics_of(found, entry), entry
        assert "prefetcht1" in mnemonics_of(found, entry), entry  # the next block, to L2


@pytest.mark.parametrize("level", list(ISA_LEVELS))
def test_attention_keeps_its_block_prefetches(level: str, tmp_path: Path) -> None:
    """paged_attention.c's vector kernels fetch the blocks ahead into L2 (prefetcht1:
    prefetch_share through the score pass, prefetch_ahead in the AVX-512 BF16 kernel);
    the AMX kernel the next two blocks into L1 (prefetch_block, prefetcht0), the only
    prefetches of either kind in the file."""
    flags = [*ATTENTION_FLAGS, "-DHEAD_DIM=64", "-DBLOCK_SIZE=16", "-DGROUP=3"]
    found = functions("paged_attention.c", flags, level, tmp_path)
    ops = [op for body in found.values() for op in body]
    assert "prefetcht1" in mnemonics_of(found, "paged_attention_f32")  # DEFINE_KERNEL's
    assert "prefetcht1" in mnemonics_of(found, "paged_attention_bf16")
    assert ("prefetcht0" in ops) == (level == "amx")
