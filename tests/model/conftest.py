import pytest

from model.backends.cpu.isa import ISA_ENV, ISA_LEVELS, isa_missing, native_isa


@pytest.fixture(params=list(ISA_LEVELS))
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each instruction-set level of the C kernels (model/backends/cpu/isa.py), forced with
    KVSERVE_CPU_ISA, so a machine tests every level up to its own: an AMX machine also
    runs the AVX-512-BF16, AVX-512F and AVX2 code. A level this CPU cannot execute skips,
    naming what it lacks."""
    level = request.param
    if lacking := isa_missing(level):
        pytest.skip(
            f"the {level} kernels need CPU flags {', '.join(lacking)}; this CPU runs up to "
            f"{native_isa()}"
        )
    monkeypatch.setenv(ISA_ENV, level)
    return level
