"""The AMX tile kernel for bf16 linears (model/kernels/linear_bf16.c) against fp32 matmul,
and its promise that a row's result does not depend on the rows beside it."""

import pytest
import torch
import torch.nn.functional as F

from model.kernels import tile_layout, tile_linear, tile_linear_supported
from model.layers import Linear

pytestmark = pytest.mark.skipif(
    not tile_linear_supported(torch.empty(64, 32, dtype=torch.bfloat16)),
    reason="no AMX tiles on this CPU (or no C compiler)",
)


def weights(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16)
    return w, torch.randn(n, generator=g)


@pytest.mark.parametrize(("n", "k"), [(64, 32), (192, 96), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 32, 45, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_fp32_matmul(n: int, k: int, rows: int, with_bias: bool) -> None:
    w, bias = weights(n, k)
    x = torch.randn(rows, k).to(torch.bfloat16)
    got = tile_linear(x, tile_layout(w), bias if with_bias else None)
    want = x.float() @ w.float().T + (bias if with_bias else 0)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # fp32 accumulation in another order, then one bf16 rounding: within 1-2 bf16 ulps.
    torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=2e-3)


def test_a_row_gives_the_same_bits_alone_in_any_batch_and_thread_count() -> None:
    w, bias = weights(192, 96, seed=1)
    tiles = tile_layout(w)
    x = torch.randn(300, 96).to(torch.bfloat16)  # 300 rows: 2x2 tiles, 1x4 tail, two chunks
    full = tile_linear(x, tiles, bias)
    for i in (0, 15, 16, 31, 33, 255, 256, 299):
        assert torch.equal(tile_linear(x[i : i + 1], tiles, bias)[0], full[i])
    assert torch.equal(tile_linear(x[5:50], tiles, bias), full[5:50])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(tile_linear(x, tiles, bias), full)
    finally:
        torch.set_num_threads(threads)


def test_leading_dimensions_and_empty_input() -> None:
    w, _ = weights(64, 64)
    tiles = tile_layout(w)
    x = torch.randn(2, 3, 64).to(torch.bfloat16)
    assert torch.equal(
        tile_linear(x, tiles, None), tile_linear(x.view(6, 64), tiles, None).view(2, 3, 64)
    )
    assert tile_linear(x[:0], tiles, None).shape == (0, 3, 64)


def test_linear_packs_into_tiles_where_the_shape_allows() -> None:
    fits, odd = Linear(96, 128, bias=True), Linear(96, 100, bias=False)
    for layer in (fits, odd):
        layer.to(torch.bfloat16)
    x = torch.randn(5, 96).to(torch.bfloat16)
    before = [F.linear(x, layer.weight, layer.bias).float() for layer in (fits, odd)]
    for layer in (fits, odd):
        layer.pack()
    assert fits._tiles is not None and fits._packed is None
    assert odd._tiles is None and odd._packed is not None  # 100 features: oneDNN's layout
    for layer, want in zip((fits, odd), before):
        assert layer.packed and layer.weight.device.type == "meta"
        torch.testing.assert_close(layer(x).float(), want, rtol=8e-3, atol=2e-3)
