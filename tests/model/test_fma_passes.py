"""At the avx512-bf16 level the bf16 linears take passes of four rows or more either on
vdpbf16ps or as convert + FMA, by the CPU's vendor (model/device.py's fma_passes). The
level's tests run the CPU's own choice; this builds linear_vec.c both ways, so that a
machine with AVX-512-BF16 checks both against the vector code's reference, whichever
its vendor."""

import pytest
import torch

from model.device import cpu_vendor, fma_passes, isa_flags, isa_missing, native_isa
from model.kernels.build import bind, build
from model.kernels.linear import VECTOR_FLAGS, tile_layout, vector_flags
from tests.model.test_linear_kernels import bf16_reference, weights

LEVEL = "avx512-bf16"


@pytest.fixture(params=[False, True], ids=["vdpbf16ps", "fma"])
def linear(request: pytest.FixtureRequest):
    if lacking := isa_missing(LEVEL):
        pytest.skip(
            f"the {LEVEL} kernels need CPU flags {', '.join(lacking)}; this CPU runs up to "
            f"{native_isa()}"
        )
    flags = (*VECTOR_FLAGS, *isa_flags(LEVEL), *(["-DFMA_PASSES"] if request.param else []))
    lib = build("linear_vec.c", flags, f"{LEVEL}-test")
    assert lib is not None, "no C compiler"
    bind(lib, "linear_bf16_vec")
    return lib.linear_bf16_vec


def test_the_level_builds_fma_passes_on_intel_only() -> None:
    assert fma_passes(LEVEL) == (cpu_vendor() == "GenuineIntel")
    assert ("-DFMA_PASSES" in vector_flags(LEVEL)) == fma_passes(LEVEL)
    assert fma_passes("avx512f") and fma_passes("avx2") and not fma_passes("amx")


@pytest.mark.parametrize("rows", [3, 4, 5, 6, 16, 70])
@pytest.mark.parametrize("k", [96, 1536])
def test_both_passes_give_the_reference_bits(linear, rows: int, k: int) -> None:
    w, bias = weights(192, k, seed=rows)
    x = torch.randn(rows, k).to(torch.bfloat16)
    packed = tile_layout(w)
    for b in (None, bias):
        out = torch.empty(rows, 192, dtype=torch.bfloat16)
        linear(
            x.data_ptr(),
            packed.data_ptr(),
            None if b is None else b.data_ptr(),
            out.data_ptr(),
            None,
            rows,
            192,
            k,
            torch.get_num_threads(),
        )
        assert torch.equal(out, bf16_reference(x, w, b))
