"""At the avx512-bf16 level the compute-bound bf16 work (the linears' passes of four rows or
more, the bf16 attention) multiplies either with vdpbf16ps or as bf16 -> float32 and FMA,
by the CPU's vendor (model/backends/cpu/isa.py's prefer_fma). The level's own tests run the CPU's
choice; these force each way in turn, so that any CPU with AVX-512-BF16 checks both,
whichever its vendor: the linears against the vector code's reference bit for bit, the
attention against torch (and the FMA way against the avx512f level's bits)."""

import pytest
import torch

from model.backends.cpu import isa
from model.backends.cpu.isa import (
    ISA_ENV,
    cpu_vendor,
    isa_flags,
    isa_missing,
    native_isa,
    prefer_fma,
)
from model.backends.cpu.kernels import attention, linear
from model.backends.cpu.kernels.linear import tile_layout, tile_linear
from tests.model.test_kernels import BATCHES, attend_batch
from tests.model.test_linear_kernels import bf16_reference, weights

LEVEL = "avx512-bf16"


def _rebuild() -> None:
    """Forget the libraries built so far: the next call builds with the flags in force."""
    attention._library_at.cache_clear()
    attention._attention_supported.cache_clear()
    linear._vector.cache_clear()


@pytest.fixture(params=[False, True], ids=["vdpbf16ps", "fma"])
def way(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    if lacking := isa_missing(LEVEL):
        pytest.skip(
            f"the {LEVEL} kernels need CPU flags {', '.join(lacking)}; this CPU runs up to "
            f"{native_isa()}"
        )
    own = isa.prefer_fma
    monkeypatch.setattr(
        isa, "prefer_fma", lambda level: request.param if level == LEVEL else own(level)
    )
    monkeypatch.setenv(ISA_ENV, LEVEL)
    _rebuild()
    yield request.param
    _rebuild()


def test_the_decision_follows_the_vendor() -> None:
    assert prefer_fma(LEVEL) == (cpu_vendor() == "GenuineIntel")
    assert ("-DPREFER_FMA" in isa_flags(LEVEL)) == prefer_fma(LEVEL)
    assert prefer_fma("avx512f") and prefer_fma("avx2") and not prefer_fma("amx")
    assert all("-DPREFER_FMA" not in isa_flags(lv) for lv in ("avx2", "avx512f", "amx"))


def test_the_flag_is_in_force(way: bool) -> None:
    assert ("-DPREFER_FMA" in isa_flags(LEVEL)) == way


@pytest.mark.parametrize("rows", [3, 4, 5, 6, 16, 70])
@pytest.mark.parametrize("k", [96, 1536])
def test_linears_give_the_reference_bits(way: bool, rows: int, k: int) -> None:
    w, bias = weights(192, k, seed=rows)
    x = torch.randn(rows, k).to(torch.bfloat16)
    for b in (None, bias):
        assert torch.equal(tile_linear(x, tile_layout(w), b), bf16_reference(x, w, b))


@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(9, 3, 64), (8, 2, 128)])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_attention_matches_torch(
    way: bool, monkeypatch: pytest.MonkeyPatch, heads: int, kv_heads: int, d: int, batch: str
) -> None:
    got, want = attend_batch(heads, kv_heads, d, 16, torch.bfloat16, batch, None)
    assert (got.float() - want).abs().max().item() < 2e-2
    if way:  # the float32 kernel, as the avx512f level builds it
        monkeypatch.setenv(ISA_ENV, "avx512f")
        assert torch.equal(
            attend_batch(heads, kv_heads, d, 16, torch.bfloat16, batch, None)[0], got
        )
