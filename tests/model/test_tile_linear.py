"""The AMX tile kernel for bf16 linears (model/kernels/linear_bf16.c) against fp32 matmul,
and its promise that a row's result does not depend on the rows beside it; its fused
SwiGLU against the unfused ops."""

import pytest
import torch
import torch.nn.functional as F

from model.config import ModelConfig
from model.kernels import (
    swiglu_layout,
    tile_layout,
    tile_linear,
    tile_linear_supported,
)
from model.layers import Linear, SwiGLU

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


@pytest.mark.parametrize(("f", "k"), [(64, 32), (192, 96), (1536, 576)])
@pytest.mark.parametrize("rows", [1, 16, 45, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_swiglu_matches_the_unfused_bf16_ops(
    f: int, k: int, rows: int, with_bias: bool
) -> None:
    w, bias = weights(2 * f, k, seed=2)
    x = torch.randn(rows, k).to(torch.bfloat16)
    b = bias if with_bias else None
    fused = tile_layout(swiglu_layout(w))
    got = tile_linear(x, fused, swiglu_layout(b) if b is not None else None, swiglu=True)
    gate, up = tile_linear(x, tile_layout(w), b).split(f, dim=-1)
    want = F.silu(gate) * up  # what SwiGLU computes without the fused kernel
    assert got.dtype == torch.bfloat16 and got.shape == (rows, f)
    # the same roundings; silu's exp differs from torch's in the last float32 bits, which
    # can move a result by one bf16 ulp
    torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-3)
    assert (got == want).float().mean().item() > 0.97
    assert torch.equal(
        tile_linear(x[-1:], fused, None, swiglu=True),
        tile_linear(x, fused, None, swiglu=True)[-1:],
    )


def test_swiglu_module_packs_fused_where_the_shape_allows() -> None:
    cfg = ModelConfig(vocab_size=8, d_model=64, n_layers=1, n_heads=2, d_ff=192)
    torch.manual_seed(0)
    ffn = SwiGLU(cfg).to(torch.bfloat16)
    x = torch.randn(5, 64).to(torch.bfloat16)
    with torch.no_grad():
        want = ffn(x)
        ffn.pack()
        assert ffn.w_in.gated and ffn.w_out.packed
        torch.testing.assert_close(ffn(x).float(), want.float(), rtol=2e-2, atol=2e-3)
    odd = SwiGLU(ModelConfig(vocab_size=8, d_model=64, n_layers=1, n_heads=2, d_ff=96))
    odd.to(torch.bfloat16).pack()  # 2 x 96 rows: no whole gate/up block pairs
    assert not odd.w_in.gated and odd.w_in.packed
