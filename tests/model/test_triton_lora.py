"""The Triton LoRA kernels (model/backends/triton/lora.py) against the torch reference's
add_delta (model/adapters.py), in the interpreter without a GPU: rows of several slots
and of none, ranks padded with zeros, outputs that are not whole bank blocks."""

import pytest
import torch

from model.adapters import BLOCK, add_delta, blocked

pytestmark = pytest.mark.interpreter


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_add_each_rows_delta_as_the_reference(dtype: torch.dtype) -> None:
    from model.backends.triton.lora import lora_add

    gen = torch.Generator().manual_seed(0)
    slots_n, width, k, n = 3, 24, 96, 160  # 160: two and a half blocks of outputs
    a = torch.randn(slots_n, width, k, generator=gen).to(dtype)
    a[:, 20:] = 0  # an adapter narrower than the bank's widest
    b = torch.randn(slots_n, n, width, generator=gen) * 0.1
    bt = torch.stack([blocked(m.t()) for m in b]).to(dtype)
    assert bt.shape == (slots_n, -(-n // BLOCK), width, BLOCK)
    x = torch.randn(7, k, generator=gen).to(dtype)
    slots = torch.tensor([2, -1, 0, 0, 1, -1, 2])
    y = torch.randn(7, n, generator=gen).to(dtype)
    want = add_delta(x, a, bt, slots, y)
    got = lora_add(x, a, bt, slots, y.clone())
    base = slots < 0
    assert torch.equal(got[base], y[base])  # rows of no adapter untouched
    assert not torch.equal(want[~base], y[~base])
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7  # a bf16 rounding apart at most
    torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance)
