"""int4 weights (linear_vec.c's linear_int4, --quantization int4) at every instruction-set
level the CPU runs (the `isa` fixture): the packing's round trip, bit for bit against a
torch reference of the kernel's arithmetic at every row count (so every level gives the
same bits), and the fused SwiGLU against the unfused ops."""

import pytest
import torch
import torch.nn.functional as F

from model.backends.cpu.kernels.linear import (
    INT4_GROUP,
    int4_dequantize,
    int4_pack,
    int4_quantize,
    int4_quantize_reference,
    int4_supported,
    swiglu_layout,
    tile_linear,
)


def weights(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) / k**0.5, torch.randn(n, generator=g)


def int4_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel's arithmetic: x's rows to int8 (q = rint(x * 127 / max|x|)), each group's
    exact sum of q * xq, then per group in order acc += d * sum + m * sum(xq) in float32
    (two products, two adds), times the row's scale, + bias, one bf16 rounding."""
    q, d, m = int4_quantize(w)
    xf = x.float()
    amax = xf.abs().amax(dim=1)
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, 0)
    xq = torch.round(xf * inv[:, None]).clamp(-127, 127)
    groups = w.shape[1] // INT4_GROUP
    acc = torch.zeros(x.shape[0], w.shape[0])
    for g in range(groups):
        cols = slice(g * INT4_GROUP, (g + 1) * INT4_GROUP)
        sums = (xq[:, cols].double() @ q[:, cols].double().T).float()  # exact
        xsum = xq[:, cols].sum(dim=1, keepdim=True)
        acc = acc + (d[:, g].float()[None, :] * sums + m[:, g].float()[None, :] * xsum)
    y = acc * (amax / 127)[:, None]
    return (y + bias if bias is not None else y).to(torch.bfloat16)


def run(x, w, bias, swiglu: bool = False) -> torch.Tensor:
    return tile_linear(x, int4_pack(w), bias, swiglu, shape=tuple(w.shape), kind="int4")


def test_quantize_keeps_each_groups_nearest_cut() -> None:
    """Each group's weights come back no farther (summed squares) than the plain
    min..max range rounded to nearest puts them, and that range within half a step."""
    w, _ = weights(128, 96)
    q, d, m = int4_quantize(w)
    assert q.max() <= 15 and d.dtype == torch.bfloat16 and m.dtype == torch.bfloat16
    groups = w.reshape(128, -1, INT4_GROUP)
    err = (int4_dequantize(q, d, m) - w).reshape(groups.shape).square().sum(dim=2)
    lo, hi = groups.amin(dim=2), groups.amax(dim=2)
    m0 = lo.to(torch.bfloat16).float()
    d0 = ((hi - m0) / 15).to(torch.bfloat16).float()
    q0 = torch.round((groups - m0[..., None]) / d0[..., None]).clamp(0, 15)
    plain = q0 * d0[..., None] + m0[..., None]
    # the minimum is rounded to bf16 first: within half a step, plus that rounding
    assert ((plain - groups).abs() <= d0[..., None] / 2 + groups.abs() / 128 + 1e-7).all()
    assert (err <= (plain - groups).square().sum(dim=2) + 1e-9).all()
    assert int4_pack(w).numel() == 128 * 96 // 2 + 128 * 96 // INT4_GROUP * 4  # 5/8 a weight


def test_the_c_rounding_is_the_references_at_every_level(isa: str) -> None:
    """linear_vec.c's int4_quantize gives the torch reference's q, d and m bit for bit:
    weights of several scales (ties and zero groups among them) and a 4-bit grid."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(192, 256, generator=g) * torch.logspace(-4, 1, 192)[:, None]
    w[5, :64] = 0  # zero groups: d 0
    w[7] = torch.round(w[7] * 4) / 4  # groups of few levels
    grid = ((torch.randint(0, 16, (64, 256), generator=g) - 8) * 0.013).to(torch.bfloat16)
    for weight in (w, w.to(torch.bfloat16), grid):
        got, want = int4_quantize(weight), int4_quantize_reference(weight)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_a_4bit_checkpoints_grid_is_kept() -> None:
    """Weights that lie on a grid of 16 levels per 128 (a GPTQ/AWQ file's, rounded to the
    bf16 they are served in: a group of 32 spans fewer levels) come back on their own
    levels, within a tenth of a step; the plain range would misplace them by up to half
    a step and more."""
    g = torch.Generator().manual_seed(0)
    scale = (torch.rand(64, 2, generator=g) * 0.02 + 0.001).repeat_interleave(128, dim=1)
    u = torch.round(torch.randn(64, 256, generator=g) * 2.5 + 8).clamp(0, 15)
    w = ((u - 8) * scale).to(torch.bfloat16).float()
    q, d, m = int4_quantize(w)
    assert ((int4_dequantize(q, d, m) - w).abs() <= 0.1 * scale).all()
    lo, hi = w.reshape(64, -1, INT4_GROUP).amin(dim=2), w.reshape(64, -1, INT4_GROUP).amax(dim=2)
    assert ((hi - lo) / scale[:, ::INT4_GROUP] < 14.5).any()  # groups of under 16 levels


@pytest.mark.parametrize("rows", [1, 2, 5, 16])
def test_int4_gives_the_references_bits_at_every_level(isa: str, rows: int) -> None:
    w, bias = weights(192, 128)
    assert int4_supported(w)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    assert torch.equal(run(x, w, bias), int4_reference(x, w, bias))
    assert torch.equal(run(x, w, None), int4_reference(x, w, None))
    # and each row is the row alone
    assert torch.equal(run(x[-1:], w, bias), run(x, w, bias)[-1:])


def test_int4_swiglu_is_the_unfused_ops(isa: str) -> None:
    """The (gate | up) weight in swiglu_layout: silu(gate) * up from one call, as the
    separate int4 projections give them (the epilogue is the int8 kernel's)."""
    w, _ = weights(256, 96, seed=3)
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    fused = run(x, swiglu_layout(w), None, swiglu=True).float()
    gate, up = run(x, w[:128], None).float(), run(x, w[128:], None).float()
    want = (F.silu(gate).to(torch.bfloat16).float() * up).to(torch.bfloat16).float()
    assert (fused - want).abs().max().item() <= 0.02 * want.abs().max().item()
