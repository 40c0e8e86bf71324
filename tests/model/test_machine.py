"""The machine's measured limits (model/backends/machine.py): the matmul rate is that of what
kvserve's linears run, and never a probe of a path they do not take."""

import pytest
import torch

from model.backends import machine
from model.backends.cpu.isa import native_isa
from model.backends.cpu.kernels.linear import tile_linear_supported


def test_the_bf16_kernel_rate_is_measured_where_the_kernel_runs() -> None:
    runs = tile_linear_supported(torch.empty(1536, 576, dtype=torch.bfloat16))
    assert runs == (native_isa() != "baseline")
    rate = machine.bf16_kernel_rate(rows=16)
    assert (rate > 1e8) if runs else rate == 0.0


@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "no-onednn"])
def test_the_bf16_matmul_rate_takes_torch_only_where_onednn_has_bf16(
    onednn: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    kernel = 1e6  # below any real matmul: torch's rate wins wherever it is measured
    monkeypatch.setattr(machine, "bf16_kernel_rate", lambda: kernel)
    monkeypatch.setattr(machine, "onednn_packs_bf16", lambda: onednn)
    rate = machine.matmul_throughput(torch.bfloat16, n=128, repeats=1)
    # without oneDNN's bf16 path (an AVX2-only CPU) torch's bf16 matmul is a reference
    # loop the linears never run: the kernel's rate stands alone
    assert rate > kernel if onednn else rate == kernel
    monkeypatch.setattr(machine, "bf16_kernel_rate", lambda: 0.0)  # no kernel: torch's
    assert machine.matmul_throughput(torch.bfloat16, n=128, repeats=1) > kernel
    assert machine.matmul_throughput(torch.float32, n=128, repeats=1) > kernel
