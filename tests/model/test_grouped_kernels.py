"""Grouped weights at every instruction-set level the CPU runs (the `isa` fixture): int4
(linear_vec.c's linear_int4, --quantization int4) and int8g (linear_int8g: a GGUF file's
5 to 8-bit tensors under --quantization auto): the roundings' C against their torch
references, a checkpoint's grid kept, the kernels bit for bit against a torch reference
of their arithmetic at every row count (so every level gives the same bits), and the
fused SwiGLU against the unfused ops."""

import pytest
import torch
import torch.nn.functional as F

from model.backends.cpu.kernels.linear import (
    grouped_supported,
    int4_pack,
    int4_quantize,
    int5_pack,
    int5_quantize,
    int8g_pack,
    int8g_quantize,
    swiglu_layout,
    tile_linear,
)
from model.grouped import (
    GROUP,
    int4_dequantize,
    int4_quantize_reference,
    int5_quantize_reference,
    int8g_dequantize,
    int8g_quantize_reference,
)

PACKS = {"int4": int4_pack, "int5": int5_pack, "int8g": int8g_pack}


def weights(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) / k**0.5, torch.randn(n, generator=g)


def grouped_reference(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, kind: str
) -> torch.Tensor:
    """The kernels' arithmetic: each group of 32 of x's rows to int8 (q = rint(x * 127 /
    max|x|), scale max|x| / 127), each group's exact sum of q * xq, then per group in
    order acc += sx * (d * sum + m * sum(xq)) (int4) or sx * (d * sum) (int8g) in float32,
    + bias, one bf16 rounding."""
    if kind == "int4":
        q, d, m = int4_quantize(w)
    elif kind == "int5":
        q, d, m = int5_quantize_reference(w)
    else:
        q, d = int8g_quantize(w)
    groups = w.shape[1] // GROUP
    xf = x.float().reshape(x.shape[0], groups, GROUP)
    amax = xf.abs().amax(dim=2)
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, 0)
    xq = torch.round(xf * inv[..., None]).clamp(-127, 127)
    sx = amax / 127
    acc = torch.zeros(x.shape[0], w.shape[0])
    for g in range(groups):
        cols = slice(g * GROUP, (g + 1) * GROUP)
        sums = (xq[:, g].double() @ q[:, cols].double().T).float()  # exact
        t = d[:, g].float()[None, :] * sums
        if kind != "int8g":
            t = t + m[:, g].float()[None, :] * xq[:, g].sum(dim=1, keepdim=True)
        acc = acc + sx[:, g : g + 1] * t
    return (acc + bias if bias is not None else acc).to(torch.bfloat16)


def run(x, w, bias, kind: str = "int4", swiglu: bool = False) -> torch.Tensor:
    return tile_linear(x, PACKS[kind](w), bias, swiglu, shape=tuple(w.shape), kind=kind)


def test_quantize_fits_each_group_by_weighted_least_squares() -> None:
    """Each weight counts its group's root mean square plus its own magnitude: the groups'
    weighted squared error comes out a sixth below the plain range's (min..max, the
    minimum capped at 0, in 15 steps) and no group more than 2% above it (the search's
    fit is in float32, then rounded to float16); the minimum is at most 0."""
    w, _ = weights(128, 96)
    q, d, m = int4_quantize(w)
    assert q.max() <= 15 and d.dtype == torch.float16 and m.dtype == torch.float16
    assert (m.float() <= 0).all()
    groups = w.reshape(128, -1, GROUP)
    wt = groups.square().mean(dim=2, keepdim=True).sqrt() + groups.abs()
    ours = (wt * (int4_dequantize(q, d, m).reshape(groups.shape) - groups).square()).sum(2)
    lo, hi = groups.amin(dim=2), groups.amax(dim=2)
    m0 = torch.where(lo < 0, lo, 0.0).to(torch.float16).float()
    d0 = ((hi - m0) / 15).to(torch.float16).float()
    q0 = torch.round((groups - m0[..., None]) / d0[..., None]).clamp(0, 15)
    plain = (wt * (q0 * d0[..., None] + m0[..., None] - groups).square()).sum(dim=2)
    assert ours.sum() < 0.85 * plain.sum()
    assert (ours <= 1.02 * plain).all()
    assert int4_pack(w).numel() == 128 * 96 // 2 + 128 * 96 // GROUP * 4  # 5/8 a weight


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


def test_the_c_int5_rounding_is_the_references_at_every_level(isa: str) -> None:
    """linear_vec.c's int5_quantize gives the torch reference's q, d and m bit for bit:
    weights of several scales (zero groups among them), Q5_0-like grids rounded to bf16,
    and MXFP4-like blocks (4-bit floats times a power of two: the step scan's groups)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(128, 256, generator=g) * torch.logspace(-4, 1, 128)[:, None]
    w[5, :64] = 0
    scale = (torch.rand(64, 8, 1, generator=g) * 0.02 + 0.001).half().float()
    q5 = (torch.randint(0, 32, (64, 8, GROUP), generator=g) - 16) * scale
    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6])
    fp4 = e2m1[torch.randint(0, 16, (64, 256), generator=g)] * 2.0 ** torch.randint(
        -9, -3, (64, 8), generator=g
    ).repeat_interleave(GROUP, dim=1)
    for weight in (w, w.to(torch.bfloat16), q5.reshape(64, 256).to(torch.bfloat16), fp4):
        got, want = int5_quantize(weight), int5_quantize_reference(weight)
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
    lo, hi = w.reshape(64, -1, GROUP).amin(dim=2), w.reshape(64, -1, GROUP).amax(dim=2)
    assert ((hi - lo) / scale[:, ::GROUP] < 14.5).any()  # groups of under 16 levels


def test_a_k_quants_groups_are_recentred_on_float16_scales() -> None:
    """Q4_K's groups (w = d * sc * q - dmin * mc: float16 d and dmin times 6-bit sc and
    mc, codes 0..15) held in int4's float16 step and minimum: no group farther (summed
    squares) than its own range on 15 steps rounded to float16, and all of them under half
    as far, the minimum re-centred on the kept codes taking back the rounding's offset."""
    g = torch.Generator().manual_seed(2)
    rows, groups = 64, 8
    d = (torch.rand(rows, 1, generator=g) * 1e-3 + 1e-4).half().float()
    dmin = (torch.rand(rows, 1, generator=g) * 1e-3 + 1e-4).half().float()
    sc = torch.randint(1, 64, (rows, groups), generator=g).float()
    mc = torch.randint(0, 64, (rows, groups), generator=g).float()
    u = torch.randint(0, 16, (rows, groups, GROUP), generator=g).float()
    u[..., 0], u[..., 1] = 0, 15  # each group spans its 15 steps
    step, low = (d * sc)[..., None], (dmin * mc)[..., None]
    w = (step * u - low).reshape(rows, groups * GROUP)
    q, dq, mq = int4_quantize(w)
    ours = (int4_dequantize(q, dq, mq) - w).reshape(rows, groups, GROUP).square().sum(2)
    m0 = (-low).to(torch.float16).float()
    d0 = step.to(torch.float16).float()
    u0 = torch.round((w.reshape(rows, groups, GROUP) - m0) / d0).clamp(0, 15)
    plain = (u0 * d0 + m0 - w.reshape(rows, groups, GROUP)).square().sum(2)
    assert (ours <= plain).all()
    assert ours.sum() < 0.5 * plain.sum()


def test_int8g_keeps_each_groups_nearest_step() -> None:
    """Each group's weights come back no farther (summed squares) than the plain step
    max|w| / 127 puts them, that within half a step; 17/16 bytes a weight."""
    w, _ = weights(128, 96)
    q, d = int8g_quantize(w)
    assert q.abs().max() <= 127 and d.dtype == torch.float16
    groups = w.reshape(128, -1, GROUP)
    err = (int8g_dequantize(q, d) - w).reshape(groups.shape).square().sum(dim=2)
    d0 = (groups.abs().amax(dim=2) / 127).half().float()
    plain = torch.round(groups / d0[..., None]).clamp(-127, 127) * d0[..., None]
    assert ((plain - groups).abs() <= d0[..., None] / 2 + groups.abs() / 1024).all()
    assert (err <= (plain - groups).square().sum(dim=2)).all()
    assert int8g_pack(w).numel() == 128 * 96 + 128 * 96 // GROUP * 2


def test_the_int8g_rounding_is_the_references_at_every_level(isa: str) -> None:
    """linear_vec.c's int8g_quantize gives the torch reference's q and d bit for bit:
    weights of several scales (zero groups among them), in float32 and bf16, and grids."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(192, 256, generator=g) * torch.logspace(-4, 1, 192)[:, None]
    w[5, :64] = 0
    w[7] = torch.round(w[7] * 4) / 4
    step = (torch.rand(64, 8, generator=g) * 0.01).half().float().repeat_interleave(GROUP, dim=1)
    grid = torch.randint(-16, 16, (64, 256), generator=g) * step
    for weight in (w, w.to(torch.bfloat16), grid, grid.to(torch.bfloat16)):
        got, want = int8g_quantize(weight), int8g_quantize_reference(weight)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_a_gguf_blocks_grid_is_kept_exactly() -> None:
    """Q8_0 blocks (a float16 step of max|w| / 127: codes in -127..127, one at an end)
    and Q5_0 blocks (max|w| / 16: codes in -16..15, one -16), as the gguf package
    dequantizes them to float32, come back exact."""
    g = torch.Generator().manual_seed(2)
    step = (torch.rand(64, 8, generator=g) * 0.02 + 1e-4).half().float()
    step = step.repeat_interleave(GROUP, dim=1)
    for low, high in ((-127, 128), (-16, 16)):
        codes = torch.randint(low, high, (64, 256), generator=g)
        codes[:, ::GROUP] = low
        w = codes * step
        q, d = int8g_quantize(w)
        assert torch.equal(int8g_dequantize(q, d), w)


@pytest.mark.parametrize("kind", ["int4", "int5", "int8g"])
@pytest.mark.parametrize("rows", [1, 2, 5, 16])
def test_grouped_kernels_give_the_references_bits_at_every_level(
    isa: str, rows: int, kind: str
) -> None:
    w, bias = weights(192, 128)
    assert grouped_supported(w, kind)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    x[0, 40:64] = 0  # a group of zeros: scale 0
    assert torch.equal(run(x, w, bias, kind), grouped_reference(x, w, bias, kind))
    assert torch.equal(run(x, w, None, kind), grouped_reference(x, w, None, kind))
    # and each row is the row alone
    assert torch.equal(run(x[-1:], w, bias, kind), run(x, w, bias, kind)[-1:])


@pytest.mark.parametrize("kind", ["int4", "int5", "int8g"])
def test_grouped_swiglu_is_the_unfused_ops(isa: str, kind: str) -> None:
    """The (gate | up) weight in swiglu_layout: silu(gate) * up from one call, as the
    separate projections give them (the epilogue is the int8 kernel's)."""
    w, _ = weights(256, 96, seed=3)
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    fused = run(x, swiglu_layout(w), None, kind, swiglu=True).float()
    gate, up = run(x, w[:128], None, kind).float(), run(x, w[128:], None, kind).float()
    want = (F.silu(gate).to(torch.bfloat16).float() * up).to(torch.bfloat16).float()
    assert (fused - want).abs().max().item() <= 0.02 * want.abs().max().item()


def test_a_5bit_files_groups_are_kept_exactly() -> None:
    """GGUF's 5-bit groups, Q5_0's (float16 d, w = d * (q - 16)) and Q5_1's (float16 d
    and m, w = d * q + m), come back as they are: int5's step and minimum are float16."""
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 32, (64, 256), generator=g).float()
    d = (torch.rand(64, 8, generator=g) * 0.01 + 1e-3).to(torch.float16).float()
    m = (-torch.rand(64, 8, generator=g) * 0.1).to(torch.float16).float()
    for w in (
        (codes.reshape(64, 8, 32) - 16) * d[..., None],  # Q5_0
        codes.reshape(64, 8, 32) * d[..., None] + m[..., None],  # Q5_1
    ):
        w = w.reshape(64, 256)
        q, qd, qm = int5_quantize_reference(w)
        back = q.reshape(64, 8, 32).float() * qd.float()[..., None] + qm.float()[..., None]
        assert torch.equal(back.reshape(64, 256), w)
